"""The `gpumem` fixture under --gpumem-disable: a `GpuMem` whose measurement is off, so that a memory suite
runs as plain tests, measuring nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import pytest

from pytest_gpumem.measure.meter import GpuMem, MeasurementOff

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend


def unmeasured(nodeid: str, backend: Callable[[], Backend]) -> GpuMem:
    """The fixture of test `nodeid`; `backend` makes the backend it would be measured on, when first read."""
    return GpuMem(MeasurementOff(nodeid, backend, _skip))


def _skip(call: str) -> NoReturn:
    __tracebackhide__ = True
    pytest.skip(f"gpumem.{call} needs a measurement, and measurement is off (--gpumem-disable)")
