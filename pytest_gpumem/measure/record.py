"""What one measured call leaves behind (`CallRecord`): made once, by `Measurement.end()`, and only read
after. The judge, the test's result and the writers read it; nothing writes it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gpumem.backends.tracker.recording import Survivor
    from pytest_gpumem.measure.fit import BatchFit
    from pytest_gpumem.measure.oom_and_leaks import Holding
    from pytest_gpumem.results import PhaseResult
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.explanation import Explanation
    from pytest_gpumem.results.gradients import Fingerprint
    from pytest_gpumem.results.ranks import World


@dataclass(frozen=True)
class SimulatedRank:
    """One `gpumem.simulate_rank()`: the size of the simulated world and the rank this process played."""

    world_size: int
    rank: int


@dataclass(frozen=True)
class CallRecord:
    """One measured call of test `nodeid`, as it ended: its figures and the evidence it left."""

    nodeid: str
    backend: str
    device: str
    call: PhaseResult  # the whole call (the worst rank's run when that peaked higher)
    phases: Mapping[str, PhaseResult]  # in the order first entered, read-only
    notes: tuple[str, ...] = ()  # the backend's, then the measurement's
    survivors: tuple[Survivor, ...] = ()  # what the call left allocated, under a leak check
    holding: Holding | None = None  # who keeps the survivors, where it can be seen
    trace: Mapping[str, Any] | None = None  # the backend's event trace, for evidence files
    explanation: Explanation | None = None
    gradients: Fingerprint | None = None
    gradient_tolerance: tuple[float | None, float | None] = (None, None)  # (rtol, atol)
    fits: tuple[BatchFit, ...] = ()
    advice: Advice | None = None  # the last gpumem.advise()
    worlds: tuple[World, ...] = ()  # each gpumem.distributed() world
    simulated: tuple[SimulatedRank, ...] = ()
    info: Any = None  # the test's own gpumem.info: a dict unless the test set something else
