"""One test's measurement, the plugin's side of its `gpumem` object: begins and ends the call on the
backend, keeps its phases, and holds what the plugin asked of it (a leak check, an explanation) and what
the call left as evidence (survivors, a trace, gradients, advice, notes) for the judge, the report and the
ranks. The test author's side is `pytest_gpumem.measure.meter.GpuMem`, made on it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pytest_gpumem.backends.base import Backend, collect_garbage
from pytest_gpumem.errors import GpuMemError, one_line
from pytest_gpumem.measure.failures import Holding, leak_holding
from pytest_gpumem.measure.regions import RegionStack
from pytest_gpumem.results import PhaseResult
from pytest_gpumem.results.ranks import World, worst_call

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.backends.tracker.recording import Survivor
    from pytest_gpumem.backends.tracker.shadow import Shadow
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.explanation import Explanation, RanksExplanation
    from pytest_gpumem.results.gradients import Fingerprint

CALL = "call"
SURVIVORS_SHOWN = 10


class WorldRunner(Protocol):
    """What runs the worlds of `gpumem.distributed()` and `gpumem.simulate_rank()` for a measurement
    (given where it is made: `pytest_gpumem.distributed.world.Worlds` in a test, a refusal in a rank)."""

    def run(
        self,
        measured: Measurement,
        fn: Callable[..., object],
        world_size: int,
        *,
        args: Sequence[Any],
        backend: str | None,
        timeout: float | None,
        name: str,
    ) -> World: ...

    def simulate(
        self, meter: object, fn: Callable[..., object], world_size: int, *, rank: int, args: Sequence[Any]
    ) -> Any:
        """Run `fn(rank, world_size, meter, *args)` here, `meter` being the test's gpumem."""


class Measurement:
    """The call of test `nodeid` measured on `backend`; `GpuMem(measurement)` is the test's `gpumem`."""

    def __init__(self, backend: Backend, nodeid: str, worlds: WorldRunner | None = None) -> None:
        self.backend = backend
        self.nodeid = nodeid
        self.info: Any = {}  # the test's own gpumem.info: a dict unless the test set something else
        self.worlds = worlds  # runs gpumem.distributed(), given where the fixture is made
        self.leak_check = False  # collect garbage before the call ends, and keep the call's survivors
        self.explain = False  # explain the peaks of the next call (what was alive, who made it)
        self.stack: RegionStack | None = None  # open while the call is measured
        self.open_phase: str | None = None
        self.advising = False  # the step's own gpumem.phase() blocks measure nothing while advise runs
        self.results: dict[str, PhaseResult] = {}
        self.call: PhaseResult | None = None
        self.fit_count = 0  # each fit's phases are its own: the second's are "fit#2[i]"
        self.ranks_call: PhaseResult | None = None  # the worst rank's whole run, of gpumem.distributed()
        self.ranks_explained: RanksExplanation | None = None  # their explanations (World.explained)
        self.shadow: Shadow | None = None
        self.notes: list[str] = []
        self.survivors: list[Survivor] = []
        self.leak_holding: Holding | None = None  # who keeps the survivors allocated, when it can be seen
        self.trace: dict[str, Any] | None = None
        self.gradients: Fingerprint | None = None
        self.gradient_tolerance: tuple[float | None, float | None] = (None, None)
        self.explanation: Explanation | None = None
        self.advice: Advice | None = None  # the last gpumem.advise() of the call
        self.fits: list[str] = []  # each gpumem.fit()'s sentence
        self.distributed: list[dict[str, Any]] = []  # each gpumem.distributed() world's summary
        self.simulated: list[dict[str, int]] = []  # each gpumem.simulate_rank()'s world size and rank

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def phases(self) -> dict[str, PhaseResult]:
        return dict(self.results)

    @property
    def has_call_result(self) -> bool:
        return self.call is not None

    def peak(self, name: str | None = None) -> int:
        __tracebackhide__ = True
        return self.result(name).peak_bytes

    def result(self, name: str | None = None) -> PhaseResult:
        __tracebackhide__ = True
        if name is None or name == CALL:
            if self.call is not None:
                return self.call
            if self.stack is None or not self.stack.open:
                raise GpuMemError(f"the call of {self.nodeid} is measured only while its test function runs")
            return self.stack.peek(0)  # the call so far
        if name not in self.results:
            opened = ", ".join(self.results) or "none"
            raise GpuMemError(f"gpumem has no phase {name!r} in {self.nodeid} (phases measured: {opened})")
        return self.results[name]

    def record(self, result: PhaseResult) -> None:
        previous = self.results.get(result.name)
        self.results[result.name] = result if previous is None else previous.merged(result)

    def add_world(self, world: World, name: str) -> None:
        """The phases of a world's ranks, its worst rank's whole run (the call's peak when it is the worst)
        and its explanations."""
        for result in world.phases():
            self.record(result)
        worst = world.worst(name)
        self.ranks_call = worst if self.ranks_call is None else self.ranks_call.merged(worst)
        explained = world.explanation
        if explained is not None:
            from pytest_gpumem.explain.replay import of_worlds

            earlier = self.ranks_explained
            self.ranks_explained = explained if earlier is None else of_worlds(earlier, explained)

    def begin(self) -> None:
        """Start measuring the call; a rerun of the test starts from nothing (info set by fixtures stays)."""
        self.results, self.call, self.notes = {}, None, []
        self.gradients, self.gradient_tolerance = None, (None, None)
        self.survivors, self.trace, self.fit_count, self.explanation = [], None, 0, None
        self.fits, self.distributed, self.simulated = [], [], []
        self.leak_holding = None
        self.advice = None
        self.ranks_call, self.ranks_explained = None, None
        self.backend.start()
        try:
            attribution = self._attribution()
        except BaseException:
            self.backend.stop()  # the backend's observation never outlives a call that could not begin
            raise
        self.stack = RegionStack(self.backend, attribution)
        self.stack.push(CALL, full_collect=self.backend.sees_earlier_allocations)

    def _attribution(self) -> Attributor | None:
        """The backend's own attributor when it explains; otherwise (cuda, accelerators) a shadow tracker
        on the same device, whose figures the measured ones are compared with ("unattributed")."""
        if not self.explain:
            return None
        found = self.backend.attribution()
        if found is None:
            from pytest_gpumem.backends.tracker.shadow import Shadow

            self.shadow = Shadow(self.backend.device)
            found = self.shadow.start()
        return found

    def end(self) -> PhaseResult:
        """End the call: close what is open, read the evidence, stop the backend's observation."""
        stack = self.stack
        if stack is None:
            raise GpuMemError(f"gpumem: the call of {self.nodeid} was never begun")
        try:
            if self.leak_check:
                collect_garbage(True)  # what survives the call is what it leaves behind
            while len(stack.open) > 1:
                self.record(stack.pop())
            self.backend.clear_workspaces()  # the allocator's, kept for the next matmul: not the call's leak
            self.call = stack.pop()
            if self.ranks_call is not None:
                self.call = worst_call(self.call, self.ranks_call)
            self._keep_evidence()
        finally:
            self.stack = None
            self.open_phase = None
            shadow, self.shadow = self.shadow, None
            try:
                if shadow is not None:
                    shadow.stop()
            finally:
                self.backend.stop()
            own = self.backend.notes()
            self.notes = [*own, *self.notes]  # the backend's, then ours
        return self.call

    def end_if_running(self) -> None:
        """End the call if it is still measured (after an error on the way out): the backend's
        observation must never outlive the test."""
        if self.stack is not None:
            self.end()

    def _keep_evidence(self) -> None:
        """Read what the backend can tell about the call before it stops observing it."""
        backend = self.backend
        leaked = self.leak_check and self.call is not None and self.call.net_bytes > 0
        if leaked:
            self.survivors = backend.survivors(SURVIVORS_SHOWN)
            self.leak_holding = leak_holding(backend.live_storages())
        self.trace = backend.trace()
        stack = self.stack
        if stack is not None and stack.attribution is not None and self.call is not None:
            self.explanation = self._explained(stack.attribution, self.call)

    def _explained(self, attribution: Attributor, call: PhaseResult) -> Explanation | None:
        from pytest_gpumem.explain.replay import explain

        name = self.backend.name if self.shadow is None else f"{self.backend.name} (composition from a shadow tracker)"
        self.notes += [f"the explanation may be incomplete: {problem}" for problem in attribution.problems]
        try:
            explained = explain(attribution, {CALL: call, **self.results}, self.nodeid, name)
            ranks = self.ranks_explained
            if ranks is None:
                return explained
            from pytest_gpumem.explain.replay import with_ranks

            return with_ranks(explained, ranks, ranks_peak=call.rank is not None)
        except Exception as exc:  # an explanation never changes the test's outcome
            self.notes.append(f"the peak could not be explained: {one_line(exc)}")
            return None
