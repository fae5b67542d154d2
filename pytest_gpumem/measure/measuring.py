"""A call measured outside a test (a rank's call, a benchmark's): `measuring()` begins it, gives its
`gpumem` and ends it on the way out, also when the block raises."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, final

from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.meter import GpuMem

if TYPE_CHECKING:
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.results.advice import Advice


@final
class MeasuredCall:
    """A call measured by `measuring()`: its `gpumem` while the block runs, its record once it ended."""

    def __init__(self, meter: GpuMem) -> None:
        self.meter = meter
        self._record: CallRecord | None = None

    @property
    def record(self) -> CallRecord:
        """What the call measured; there is none before the `with` block ended without an error."""
        if self._record is None:
            raise GpuMemError("the call measured by measuring() has a record only once its `with` block ended")
        return self._record


@contextmanager
def measuring(measured: Measurement, advisor: Callable[..., Advice] | None = None) -> Iterator[MeasuredCall]:
    """Measure the `with` block as one call of `measured` (a rank's, a benchmark's), with a `GpuMem` on it
    given `advisor`: begun on entry and ended on the way out, also when the block raises, so that the
    backend's observation never outlives the block."""
    measured.begin()
    call = MeasuredCall(GpuMem(measured, advisor))
    try:
        yield call
    except BaseException:
        measured.end_if_running()
        raise
    call._record = measured.end()
