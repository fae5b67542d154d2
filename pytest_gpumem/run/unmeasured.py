"""The `gpumem` fixture under --gpumem-disable: a memory suite runs as plain tests, measuring nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_gpumem.errors import GpuMemError

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.results import PhaseResult

_DISABLED = "--gpumem-disable"


class Unmeasured:
    """What the `gpumem` fixture is when measurement is off: the test runs as without the plugin. Phases
    measure nothing, `check_gradients()` checks nothing, and what reads or makes a measurement (`peak()`,
    `result()`, `fit()`, `advise()`, `distributed()`, `simulate_rank()`) skips the test, saying why."""

    def __init__(self, nodeid: str, backend: Callable[[], Backend]) -> None:
        self._nodeid = nodeid
        self._backend = backend
        self.info: dict[str, Any] = {}  # kept for the test's own reading; no result carries it

    @property
    def device(self) -> torch.device:
        """Where the test's tensors would go to be measured."""
        __tracebackhide__ = True
        return self.backend.device

    @property
    def backend(self) -> Backend:
        __tracebackhide__ = True
        return self._backend()

    @property
    def phases(self) -> dict[str, PhaseResult]:
        """None measured."""
        return {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The `with` block runs, measured by nothing; a name the measured run refuses is refused here too,
        so that a suite that passes unmeasured does not fail measured for it."""
        __tracebackhide__ = True
        if not isinstance(name, str) or not name or name == "call":
            raise GpuMemError(f"gpumem.phase() needs a non-empty name other than 'call', got {name!r}")
        yield

    def check_gradients(self, *args: object, **kwargs: object) -> None:
        """Nothing to compare them with: no baseline is judged."""

    def peak(self, name: str | None = None) -> NoReturn:
        __tracebackhide__ = True
        self._skip("peak()")

    def result(self, name: str | None = None) -> NoReturn:
        __tracebackhide__ = True
        self._skip("result()")

    def fit(self, *args: object, **kwargs: object) -> NoReturn:
        __tracebackhide__ = True
        self._skip("fit()")

    def advise(self, *args: object, **kwargs: object) -> NoReturn:
        __tracebackhide__ = True
        self._skip("advise()")

    def distributed(self, *args: object, **kwargs: object) -> NoReturn:
        __tracebackhide__ = True
        self._skip("distributed()")

    def simulate_rank(self, *args: object, **kwargs: object) -> NoReturn:
        __tracebackhide__ = True
        self._skip("simulate_rank()")

    def _skip(self, call: str) -> NoReturn:
        __tracebackhide__ = True
        pytest.skip(f"gpumem.{call} needs a measurement, and measurement is off ({_DISABLED})")
