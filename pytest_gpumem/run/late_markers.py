"""A max_memory marker added where it can no longer take effect fails its test in one line, instead of
being ignored: from the test function (the call is already running unmeasured or measured as it was
marked before), or after the gpumem fixture was made on another device than the marker names."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

from pytest_gpumem.budget import MARKER

if TYPE_CHECKING:
    from pytest_gpumem.measure.measurement import Measurement

_WHERE = "put it on the test (a decorator, pytestmark or pytest.param(..., marks=...)) or add it from a fixture"


def _name(marker: str | pytest.MarkDecorator) -> str:
    return marker if isinstance(marker, str) else marker.name


@contextmanager
def markers_refused(item: pytest.Item) -> Generator[None, None, None]:
    """While `item`'s test function runs, adding a max_memory marker to it fails the test at once (a meta
    marker added there would otherwise leave a real-size model running for real on the CPU)."""
    __tracebackhide__ = True
    add_marker = item.add_marker

    def refusing(marker: str | pytest.MarkDecorator, append: bool = True) -> None:
        __tracebackhide__ = True
        if _name(marker) == MARKER:
            pytest.fail(
                f"{item.nodeid}: max_memory added inside the test function, after its call began: "
                f"it would be ignored; {_WHERE}",
                pytrace=False,
            )
        add_marker(marker, append)

    item.add_marker = refusing  # type: ignore[method-assign]
    try:
        yield
    finally:
        del item.add_marker


def marked_meta(item: pytest.Item) -> bool:
    """Whether the closest max_memory marker that names a device names meta (bad markers fail later)."""
    for mark in item.iter_markers(MARKER):
        if "device" in mark.kwargs:
            return bool(mark.kwargs["device"] == "meta")
    return False


def device_too_late(item: pytest.Item, measured: Measurement) -> str | None:
    """Why `item`'s measurement cannot be the one its markers ask for: a fixture that ran after the gpumem
    fixture marked it for meta, while the gpumem fixture was made on another device."""
    if marked_meta(item) and str(measured.device) != "meta":
        return (
            f"max_memory(device='meta') was added after the gpumem fixture was made on {measured.device}: "
            f"the test would run on {measured.device}; {_WHERE} that runs before gpumem"
        )
    return None
