"""What one measured call leaves behind (`CallRecord`): made once, by `Measurement.end()`, and only read
after. The judge, the test's result and the writers read it; nothing writes it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpumem.results import PhaseResult, WrittenRecord

if TYPE_CHECKING:
    from pytest_gpumem.backends.tracker.recording import Survivor
    from pytest_gpumem.measure.oom_and_leaks import Holding
    from pytest_gpumem.results.gradients import Fingerprint


@dataclass(frozen=True)
class CallRecord(WrittenRecord):
    """One measured call of test `nodeid`, as it ended: what its report writes (`WrittenRecord`: the
    figures, the notes, the explanation and what the test asked to measure) and the evidence it left."""

    call: PhaseResult  # the whole call (the worst rank's run when that peaked higher)
    info: Any = field(default_factory=dict)  # the test's own gpumem.info: a dict unless the test set something else
    survivors: tuple[Survivor, ...] = ()  # what the call left allocated, under a leak check
    holding: Holding | None = None  # who keeps the survivors, where it can be seen
    trace: Mapping[str, Any] | None = None  # the backend's event trace, for evidence files
    gradients: Fingerprint | None = None
    gradient_tolerance: tuple[float | None, float | None] = (None, None)  # (rtol, atol)
