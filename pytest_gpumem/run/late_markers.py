"""A max_memory marker added where it can no longer take effect fails its test in one line, instead of
being ignored: from the test function (the call is already running unmeasured or measured as it was
marked before), or after the gpumem fixture was made on another device than the marker names."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from pytest_gpumem.marker import MARKER

if TYPE_CHECKING:
    from pytest_gpumem.measure.measurement import Measurement

_SET_UP: pytest.StashKey[bool] = pytest.StashKey()
_WHERE = "put it on the test (a decorator, pytestmark or pytest.param(..., marks=...)) or add it from a fixture"


def _name(marker: str | pytest.MarkDecorator) -> str:
    return marker if isinstance(marker, str) else marker.name


class _RefusingLateMarkers:
    """A set-up test's `add_marker`: a max_memory marker added while its call runs fails the test at once (a
    meta marker added there would otherwise leave a real-size model running for real on the CPU)."""

    __slots__ = ("add_marker", "item")

    def __init__(self, item: pytest.Item) -> None:
        self.add_marker = item.add_marker
        self.item = item  # its id and stash read only to refuse: every test makes one

    def __call__(self, marker: str | pytest.MarkDecorator, append: bool = True) -> None:
        __tracebackhide__ = True
        if _name(marker) == MARKER and _calling(self.item.stash):
            pytest.fail(
                f"{self.item.nodeid}: max_memory added inside the test function, after its call began: "
                f"it would be ignored; {_WHERE}",
                pytrace=False,
            )
        self.add_marker(marker, append)


def calling(item: pytest.Item) -> bool:
    """Whether `item`'s call runs: its setup has ended and pytest does not say its teardown began (the stash
    holds the first, so that a test that clears os.environ, and with it PYTEST_CURRENT_TEST, keeps it)."""
    return _calling(item.stash)


def _calling(stash: pytest.Stash) -> bool:
    return stash.get(_SET_UP, False) and not os.environ.get("PYTEST_CURRENT_TEST", "").endswith(" (teardown)")


def setting_up(item: pytest.Item) -> None:
    """`item`'s setup begins (a rerun's too): its call has not begun."""
    item.stash[_SET_UP] = False


def refuse_late_markers(item: pytest.Item) -> None:
    """From the end of `item`'s setup on, a max_memory marker added to it while its call runs fails the test."""
    item.stash[_SET_UP] = True
    if not isinstance(item.add_marker, _RefusingLateMarkers):  # a rerun's setup: refused already
        item.add_marker = _RefusingLateMarkers(item)  # type: ignore[method-assign]


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
