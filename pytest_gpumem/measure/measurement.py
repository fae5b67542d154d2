"""One test's measurement, the plugin's side of its `gpumem` object: begins and ends the call on the
backend, keeps its phases, and holds what the plugin asked of it (a leak check, an explanation) and what
the call left as evidence (survivors, a trace, gradients, advice, notes) for the judge, the report and the
ranks. The test author's side is `pytest_gpumem.measure.meter.GpuMem`, made on it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, Protocol

from pytest_gpumem.backends.base import Backend, collect_garbage
from pytest_gpumem.errors import GpuMemError, one_line
from pytest_gpumem.measure.oom_and_leaks import Holding, leak_holding
from pytest_gpumem.measure.record import CallRecord
from pytest_gpumem.measure.regions import RegionStack
from pytest_gpumem.results import PhaseResult, Phases
from pytest_gpumem.results.ranks import World, worst_call
from pytest_gpumem.results.test_result import default_of

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.backends.tracker.recording import Survivor
    from pytest_gpumem.backends.tracker.shadow import Shadow
    from pytest_gpumem.measure.terms import Terms
    from pytest_gpumem.results.explanation import Explanation, RanksExplanation

CALL = "call"
_SURVIVORS_SHOWN = 10
Trace = Mapping[str, Any] | None
Evidence = tuple[tuple["Survivor", ...], Holding | None, Trace]  # survivors, who holds them, the trace


_MADE_AT_END = ("phases", "notes", "info", "explanation", "survivors", "holding", "trace")  # by `end()`
_FOUND: dict[str, Callable[[], Any]] = {
    f.name: default_of(f)
    for f in fields(CallRecord)
    if (f.default is not MISSING or f.default_factory is not MISSING) and f.name not in _MADE_AT_END
}
"""The record's fields that the measuring code may find (`Measurement.add`, `keep`), with their defaults."""


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
        self._begun()

    def _begun(self) -> None:
        """What a call measures, from nothing."""
        self._results: dict[str, PhaseResult] = {}
        self._call: PhaseResult | None = None
        self._found: dict[str, Any] = {}  # the record's fields the measuring code found (`add`, `keep`)
        self._ranks_call: PhaseResult | None = None  # the worst rank's whole run, of gpumem.distributed()
        self._ranks_explained: RanksExplanation | None = None  # their explanations (World.explained)
        self._shadow: Shadow | None = None
        self._notes: list[str] = []
        self._explanation: Explanation | None = None

    def hold_to(self, *, leak_check: bool, explain: bool) -> None:
        """What the next call is held to: a leak check (garbage collected before it ends, survivors kept)
        and an explanation of its peaks."""
        self.leak_check, self.explain = leak_check, explain

    def set_up(self, terms: Terms) -> None:
        """Set up the next call and the backend on `terms` (every measured test: nothing carries over), once
        the card is predicted; a capacity is refused where the backend cannot hold the process to one."""
        backend = self.backend
        if terms.capacity is not None and not backend.caps_the_process:  # a test held to one must not run without
            raise GpuMemError(f"capacity {terms.capacity.written}: the {backend.name} backend cannot set a capacity")
        self.hold_to(leak_check=terms.leak is not None, explain=terms.explain)
        backend.configure(terms.settings())

    def run_worlds_with(self, worlds: WorldRunner) -> None:
        """What runs gpumem.distributed() and gpumem.simulate_rank(), given where the fixture is made."""
        self.worlds = worlds

    def add_notes(self, notes: Iterable[str]) -> None:
        self._notes.extend(notes)

    def add(self, **found: object) -> None:
        """Add what the measuring code found to the record's fields of several (tuples) by their names:
        `add(fits=sentence)`."""
        for name, value in found.items():
            self._found[name] = (*self.found(name), value)

    def keep(self, **found: object) -> None:
        """Set the record's fields by their names to what the measuring code found: `keep(advice=advice)`."""
        unknown = found.keys() - _FOUND.keys()
        if unknown:
            raise TypeError(f"a call's record has no field {min(unknown)!r}")
        self._found.update(found)

    def found(self, name: str) -> Any:
        """The value of the record's field `name` so far (its default until the measuring code found one)."""
        if name not in _FOUND:
            raise TypeError(f"a call's record has no field {name!r}")
        return self._found[name] if name in self._found else _FOUND[name]()

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def explanation(self) -> Explanation | None:
        """What made the peaks of the last call that ended, when it was explained."""
        return self._explanation

    @property
    def phases(self) -> dict[str, PhaseResult]:
        return dict(self._results)

    def peak(self, name: str | None = None) -> int:
        __tracebackhide__ = True
        return self.result(name).peak_bytes

    def result(self, name: str | None = None) -> PhaseResult:
        __tracebackhide__ = True
        if name is None or name == CALL:
            if self._call is not None:
                return self._call
            if self.stack is None or not self.stack.open:
                raise GpuMemError(f"the call of {self.nodeid} is measured only while its test function runs")
            return self.stack.peek(0)  # the call so far
        if name not in self._results:
            opened = ", ".join(self._results) or "none"
            raise GpuMemError(f"gpumem has no phase {name!r} in {self.nodeid} (phases measured: {opened})")
        return self._results[name]

    def record(self, result: PhaseResult) -> None:
        previous = self._results.get(result.name)
        self._results[result.name] = result if previous is None else previous.merged(result)

    def add_world(self, world: World, name: str) -> None:
        """The phases of a world's ranks, its worst rank's whole run (the call's peak when it is the worst)
        and its explanations."""
        for result in world.phases():
            self.record(result)
        worst = world.worst(name)
        self._ranks_call = worst if self._ranks_call is None else self._ranks_call.merged(worst)
        self.add(distributed=world.summary())
        explained = world.explanation
        if explained is not None:
            from pytest_gpumem.explain.composition import of_worlds

            earlier = self._ranks_explained
            self._ranks_explained = explained if earlier is None else of_worlds(earlier, explained)

    def begin(self) -> None:
        """Start measuring the call; a rerun of the test starts from nothing (info set by fixtures stays)."""
        self._begun()
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

            self._shadow = Shadow(self.backend.device)
            found = self._shadow.start()
        return found

    def end(self) -> CallRecord:
        """End the call: close what is open, read the evidence, stop the backend's observation; the call's
        record."""
        stack = self.stack
        if stack is None:
            raise GpuMemError(f"gpumem: the call of {self.nodeid} was never begun")
        evidence: Evidence = ((), None, None)
        try:
            if self.leak_check:
                collect_garbage(True)  # what survives the call is what it leaves behind
            while len(stack.open) > 1:
                self.record(stack.pop())
            self.backend.clear_workspaces()  # the allocator's, kept for the next matmul: not the call's leak
            call = worst_call(stack.pop(), self._ranks_call)
            self._call = call
            evidence = self._evidence(stack, call)
        finally:
            self.stack = None
            self.open_phase = None
            shadow, self._shadow = self._shadow, None
            try:
                if shadow is not None:
                    shadow.stop()
            finally:
                self.backend.stop()
            self._notes = [*self.backend.notes(), *self._notes]  # the backend's, then ours
        return self._record(call, *evidence)

    def _record(
        self, call: PhaseResult, survivors: tuple[Survivor, ...], holding: Holding | None, trace: Trace
    ) -> CallRecord:
        return CallRecord(
            nodeid=self.nodeid,
            backend=self.backend.name,
            device=str(self.device),
            call=call,
            phases=Phases(self._results),
            notes=tuple(self._notes),
            survivors=survivors,
            holding=holding,
            trace=trace,
            explanation=self._explanation,
            info=self.info,
            **self._found,
        )

    def end_if_running(self) -> CallRecord | None:
        """End the call if it is still measured (after an error on the way out): the backend's
        observation must never outlive the test."""
        return None if self.stack is None else self.end()

    def _evidence(self, stack: RegionStack, call: PhaseResult) -> Evidence:
        """Read what the backend can tell about the call before it stops observing it: survivors and who
        holds them (under a leak check, when the call left bytes), its trace, and the explanation."""
        backend = self.backend
        survivors: tuple[Survivor, ...] = ()
        holding = None
        if self.leak_check and call.net_bytes > 0:
            survivors = tuple(backend.survivors(_SURVIVORS_SHOWN))
            holding = leak_holding(backend.live_storages())
        trace = backend.trace()
        if stack.attribution is not None:
            self._explanation = self._explained(stack.attribution, call)
        return survivors, holding, trace

    def _explained(self, attribution: Attributor, call: PhaseResult) -> Explanation | None:
        from pytest_gpumem.explain.composition import explain

        name = self.backend.name if self._shadow is None else f"{self.backend.name} (composition from a shadow tracker)"
        self._notes += [f"the explanation may be incomplete: {problem}" for problem in attribution.problems]
        try:
            explained = explain(attribution, {CALL: call, **self._results}, self.nodeid, name)
            ranks = self._ranks_explained
            if ranks is None:
                return explained
            from pytest_gpumem.explain.composition import with_ranks

            return with_ranks(explained, ranks, ranks_peak=call.rank is not None)
        except Exception as exc:  # an explanation never changes the test's outcome
            self._notes.append(f"the peak could not be explained: {one_line(exc)}")
            return None
