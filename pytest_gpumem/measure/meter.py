"""The `gpumem` fixture object: the whole call and named phases measured on one backend (regions that
nest, `pytest_gpumem.measure.regions`), and what a test asks of it: fits, advice, gradients, worlds of
ranks (run by the `WorldRunner` it is given)."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from pytest_gpumem.backends.base import (
    Backend,
    CachesMemory,
    ExplainsItsPeaks,
    FindsSurvivors,
    HasNotes,
    HoldsToCapacity,
    KeepsWorkspaces,
    ListsLiveStorages,
    PredictsACard,
    RecordsTimeline,
    RecordsTrace,
    collect_garbage,
    sees_earlier_allocations,
)
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.failures import Holding, is_out_of_memory, leak_holding, release_memory
from pytest_gpumem.measure.regions import RegionStack, mark_phase, phase_left_by
from pytest_gpumem.results import PhaseResult
from pytest_gpumem.results.ranks import RankResult, World, worst_call

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.backends.tracker.recording import Survivor
    from pytest_gpumem.backends.tracker.shadow import Shadow
    from pytest_gpumem.measure.fit import BatchFit, Measure
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.explanation import Explanation, RanksExplanation
    from pytest_gpumem.results.gradients import Fingerprint

CALL = "call"
SURVIVORS_SHOWN = 10


class WorldRunner(Protocol):
    """What runs the worlds of `gpumem.distributed()` and `gpumem.simulate_rank()` for a meter (given
    where the meter is made: `pytest_gpumem.distributed.world.Worlds` in a test, a refusal in a rank)."""

    def run(
        self,
        meter: GpuMem,
        fn: Callable[..., object],
        world_size: int,
        *,
        args: Sequence[Any],
        backend: str | None,
        timeout: float | None,
        name: str,
    ) -> World: ...

    def simulate(
        self, meter: GpuMem, fn: Callable[..., object], world_size: int, *, rank: int, args: Sequence[Any]
    ) -> Any: ...


def _finite_non_negative(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


class GpuMem:
    """Measures the test call and the phases opened with `phase(name)`; read with `peak` and `result`."""

    def __init__(self, backend: Backend, nodeid: str) -> None:
        self.backend = backend
        self.nodeid = nodeid
        self.info: dict[str, Any] = {}
        self._stack: RegionStack | None = None
        self._phase: str | None = None
        self._advising_now = False  # the step's own gpumem.phase() blocks measure nothing while advise runs
        self._results: dict[str, PhaseResult] = {}
        self._call: PhaseResult | None = None
        self.notes: list[str] = []
        self.leak_check = False  # collect garbage before the call ends, and keep the call's survivors
        self.survivors: list[Survivor] = []
        self.leak_holding: Holding | None = None  # who keeps the survivors allocated, when it can be seen
        self.trace: dict[str, Any] | None = None
        self._fits = 0
        self._ranks_call: PhaseResult | None = None  # the worst rank's whole run, of gpumem.distributed()
        self._ranks_explained: RanksExplanation | None = None  # their explanations (World.explained), when explained
        self.worlds: WorldRunner | None = None  # runs gpumem.distributed(), set where the fixture is made
        self.gradients: Fingerprint | None = None
        self.gradient_tolerance: tuple[float | None, float | None] = (None, None)
        self.explain = False  # explain the peaks of the next call (what was alive, who made it)
        self.explanation: Explanation | None = None
        self._shadow: Shadow | None = None
        self.advice: Advice | None = None  # the last gpumem.advise() of the call

    @property
    def device(self) -> torch.device:
        """Where the test's tensors should go to be measured (e.g. cuda:0, or cpu for the tracker)."""
        return self.backend.device

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def phases(self) -> dict[str, PhaseResult]:
        """The phases measured so far, in the order first opened."""
        return dict(self._results)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase `name`; the same name again keeps the maximum of the two."""
        __tracebackhide__ = True
        if not isinstance(name, str) or not name or name == CALL:
            raise GpuMemError(f"gpumem.phase() needs a non-empty name other than {CALL!r}, got {name!r}")
        if self._stack is None:
            raise GpuMemError(f"gpumem.phase({name!r}) works only while the test function of {self.nodeid} runs")
        if self._advising_now:
            yield
            return
        if self._phase is not None:
            raise GpuMemError(f"gpumem.phase({name!r}) opened inside phase {self._phase!r}: phases cannot nest")
        stack = self._stack
        stack.push(name)
        self._phase = name
        try:
            yield
        except BaseException as exc:
            mark_phase(exc, name)
            raise
        finally:
            if self._stack is stack and self._phase == name:
                self._phase = None
                self._record(stack.pop())

    def fit(
        self,
        step: Callable[[int], object],
        sizes: Iterable[int],
        capacity: int | str,
        *,
        name: str = "fit",
        tolerance: float | None = None,
        slack: int | None = None,
        confirm: bool = True,
    ) -> BatchFit:
        """Run `step(n)` for each n in `sizes`, each in its own phase `name[i]`, and return the largest n
        whose absolute peak fits `capacity`: from each size's timeline where the ops are the same at every
        size, else searched by runs held to it; `confirm` runs the answer and the next size held to it where
        a run is cheap (see `pytest_gpumem.measure.fit`)."""
        __tracebackhide__ = True
        from pytest_gpumem.measure.fit_search import DEFAULT_SLACK, DEFAULT_TOLERANCE, fit_capacity, fit_peaks
        from pytest_gpumem.measure.host import runs_refused

        self._fits += 1
        label = name if self._fits == 1 else f"{name}#{self._fits}"  # each fit's phases are its own
        judged = fit_capacity(capacity)  # a named card's runs are the card's (its cuBLAS workspaces)
        card = judged.card
        predicting = self.backend.predicting(card.name) if card and isinstance(self.backend, PredictsACard) else None
        with predicting or contextlib.nullcontext():
            found = fit_peaks(
                step,
                sizes,
                capacity,
                self._fit_measure(label),
                tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
                slack=DEFAULT_SLACK if slack is None else slack,
                confirm=confirm,
                runs_refused=runs_refused(self.backend, judged.bytes),
            )
        self.info.setdefault("fits", []).append(found.describe())
        return found

    def _fit_measure(self, label: str) -> Measure:
        """Each run of a fit in a phase of its own, with its timeline where the backend records one, held to
        `limit` where given and the backend can hold it (an OutOfMemoryError past it is then the sample's)."""
        from pytest_gpumem.measure.fit import Sample

        counter = itertools.count()

        def measure(fn: Callable[[], object], limit: int | None = None) -> Sample:
            __tracebackhide__ = True
            phase = f"{label}[{next(counter)}]"
            backend = self.backend
            holding = backend.held_to(limit) if limit is not None and isinstance(backend, HoldsToCapacity) else None
            recording = backend.timeline() if isinstance(backend, RecordsTimeline) else None
            start, out_of_memory, timeline = 0, False, None
            if isinstance(backend, CachesMemory):
                backend.empty_cache()  # each size as in a fresh process: no segments cached by other sizes
            try:
                with self.phase(phase):
                    start = self.backend.current().allocated  # the phase's start: what is live before the step
                    with holding or contextlib.nullcontext(), recording or contextlib.nullcontext() as recorded:
                        fn()  # what the step returns is dropped inside the phase: freed before the next size
                    timeline = None if recorded is None else recorded()
            except Exception as exc:
                if limit is None or not is_out_of_memory(exc):
                    raise
                exc.__traceback__, out_of_memory = None, True  # its frames hold the step's tensors
                del exc
            if out_of_memory:
                release_memory()  # outside the handler, where the exception is no longer the one handled
            result = self._results[phase]
            end, reserved = start + result.net_bytes, result.reserved_peak_bytes
            peak = start + result.peak_bytes if reserved is None else reserved  # a card runs out on reserved
            return Sample(start, peak, end, out_of_memory, holding is not None, timeline, reserved is not None)

        return measure

    def advise(
        self,
        step: Callable[..., object],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        capacity: int | str | None = None,
        strategies: Sequence[str] | None = None,
        loss: torch.nn.Module | None = None,
        batch_size: int | None = None,
    ) -> Advice:
        """Measure the training step `step()` as it is and with each memory-saving strategy applied to
        `model` and `optimizer` from outside, leaving both as they were (see `pytest_gpumem.advise.run`).
        The advice's runs are not part of the call's peak; a failing budget names its best strategy."""
        __tracebackhide__ = True
        from pytest_gpumem.advise.run import advise

        with self._advising():
            found = advise(
                step,
                model=model,
                backend=self.backend,
                optimizer=optimizer,
                capacity=capacity,
                strategies=strategies,
                loss=loss,
                batch_size=batch_size,
            )
        self.advice = found  # for the failure line, report and JSON
        self.info["advice"] = found.to_json()
        return found

    @contextmanager
    def _advising(self) -> Iterator[None]:
        """While advise runs inside a test: its runs are not the test's call (the call's peak is folded
        before and reset after), the step's own gpumem.phase() blocks measure nothing, and a capacity set on
        the tracker is lifted (advise judges the capacity itself)."""
        from pytest_gpumem.advise.strategies import Patch

        stack = self._stack
        if stack is None:
            raise GpuMemError(f"gpumem.advise() works only while the test function of {self.nodeid} runs")
        if self._phase is not None:
            raise GpuMemError(f"gpumem.advise() called inside phase {self._phase!r}: call it outside phases")
        patch = Patch()
        backend = self.backend
        lifted = backend.held_to(None) if isinstance(backend, HoldsToCapacity) else contextlib.nullcontext()
        try:
            with stack.unmeasured("gpumem.advise"), lifted:
                try:
                    patch.set_attr(self, "_advising_now", True)
                    yield
                finally:
                    patch.undo()
        finally:  # what advise's runs cached past a lifted capacity must not serve the test's own step
            if isinstance(backend, CachesMemory) and isinstance(backend, HoldsToCapacity):
                backend.empty_cache()

    def distributed(
        self,
        fn: Callable[..., object],
        world_size: int = 2,
        *,
        args: Sequence[Any] = (),
        backend: str | None = None,
        timeout: float | None = None,
        name: str = "ranks",
    ) -> list[RankResult]:
        """Run `fn(rank, world_size, meter, *args)` on `world_size` spawned ranks, each with a meter on its own
        backend, and record their phases as `phase@rankN` and `phase` (the worst rank); see
        `pytest_gpumem.distributed.world`. A failed rank fails the test in one line naming it."""
        __tracebackhide__ = True
        if self._stack is None or self._phase is not None:
            where = "while the test function runs" if self._stack is None else f"outside phase {self._phase!r}"
            raise GpuMemError(f"gpumem.distributed() works only {where} in {self.nodeid}")
        world = self._runner("distributed").run(
            self, fn, world_size, args=args, backend=backend, timeout=timeout, name=name
        )
        for result in world.phases():
            self._record(result)
        worst = world.worst(name)
        self._ranks_call = worst if self._ranks_call is None else self._ranks_call.merged(worst)
        explained = world.explanation
        if explained is not None:
            from pytest_gpumem.explain.replay import of_worlds

            earlier = self._ranks_explained
            self._ranks_explained = explained if earlier is None else of_worlds(earlier, explained)
        self.info.setdefault("distributed", []).append(world.summary())
        return world.ranks

    def simulate_rank(
        self, fn: Callable[..., object], world_size: int, *, rank: int = 0, args: Sequence[Any] = ()
    ) -> Any:
        """Run `fn(rank, world_size, meter, *args)` in this process as rank `rank` of a simulated world
        (torch's fake process group: collectives move no data), `meter` being this one: an estimate of
        that rank's peaks at a world size this machine cannot start (see `pytest_gpumem.distributed.world`)."""
        __tracebackhide__ = True
        if self._stack is None:
            raise GpuMemError(f"gpumem.simulate_rank() works only while the test function of {self.nodeid} runs")
        value = self._runner("simulate_rank").simulate(self, fn, world_size, rank=rank, args=args)
        self.info.setdefault("simulated", []).append({"world_size": world_size, "rank": rank})
        return value

    def _runner(self, method: str) -> WorldRunner:
        if self.worlds is None:
            raise GpuMemError(f"gpumem.{method}() runs ranks only for a meter given its worlds (the gpumem fixture)")
        return self.worlds

    def check_gradients(
        self,
        model_or_named_tensors: torch.nn.Module | Mapping[str, torch.Tensor | None],
        *,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        """Fingerprint the gradients now (a module's `.grad`; a dict's tensors are gradients themselves
        unless they are parameters), to compare with the stored baseline after the call; `rtol`/`atol`
        override the dtype's defaults. The fingerprint's own work is not measured."""
        __tracebackhide__ = True
        from pytest_gpumem.gradients.fingerprint import fingerprint

        if self._stack is None:
            raise GpuMemError(f"gpumem.check_gradients() works only while the test function of {self.nodeid} runs")
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is not None and not _finite_non_negative(value):
                raise GpuMemError(f"gpumem.check_gradients({name}=...) must be a finite number >= 0, got {value!r}")
        with self._stack.unmeasured("gpumem.check_gradients"):
            try:
                self.gradients = fingerprint(model_or_named_tensors)
            except (TypeError, ValueError) as exc:
                raise GpuMemError(f"gpumem.check_gradients(): {exc}") from None
        self.gradient_tolerance = (rtol, atol)

    def peak(self, name: str | None = None) -> int:
        """Peak bytes of phase `name` above its start, or of the whole call (so far) when `name` is None."""
        __tracebackhide__ = True
        return self.result(name).peak_bytes

    def result(self, name: str | None = None) -> PhaseResult:
        __tracebackhide__ = True
        if name is None or name == CALL:
            if self._call is not None:
                return self._call
            if self._stack is None or not self._stack.open:
                raise GpuMemError(f"the call of {self.nodeid} is measured only while its test function runs")
            return self._stack.peek(0)  # the call so far
        if name not in self._results:
            opened = ", ".join(self._results) or "none"
            raise GpuMemError(f"gpumem has no phase {name!r} in {self.nodeid} (phases measured: {opened})")
        return self._results[name]

    @property
    def has_call_result(self) -> bool:
        return self._call is not None

    def begin_call(self) -> None:
        """Start measuring the call; a rerun of the test starts from nothing (info set by fixtures stays)."""
        self._results, self._call, self.notes = {}, None, []
        self.gradients, self.gradient_tolerance = None, (None, None)
        self.survivors, self.trace, self._fits, self.explanation = [], None, 0, None
        self.leak_holding = None
        self.advice = None
        self._ranks_call, self._ranks_explained = None, None
        self.backend.start()
        try:
            attribution = self._attribution()
        except BaseException:
            self.backend.stop()  # the backend's observation never outlives a call that could not begin
            raise
        self._stack = RegionStack(self.backend, attribution)
        self._stack.push(CALL, full_collect=sees_earlier_allocations(self.backend))

    def _attribution(self) -> Attributor | None:
        """The backend's own attributor when it explains; otherwise (cuda, accelerators) a shadow tracker
        on the same device, whose figures the measured ones are compared with ("unattributed")."""
        if not self.explain:
            return None
        found = self.backend.attribution() if isinstance(self.backend, ExplainsItsPeaks) else None
        if found is None:
            from pytest_gpumem.backends.tracker.shadow import Shadow

            self._shadow = Shadow(self.backend.device)
            found = self._shadow.start()
        return found

    def end_call(self) -> PhaseResult:
        stack = self._stack
        if stack is None:
            raise GpuMemError(f"gpumem: the call of {self.nodeid} was never begun")
        try:
            if self.leak_check:
                collect_garbage(True)  # what survives the call is what it leaves behind
            while len(stack.open) > 1:
                self._record(stack.pop())
            if isinstance(self.backend, KeepsWorkspaces):
                self.backend.clear_workspaces()  # the allocator's, kept for the next matmul: not the call's leak
            self._call = stack.pop()
            if self._ranks_call is not None:
                self._call = worst_call(self._call, self._ranks_call)
            self._keep_evidence()
        finally:
            self._stack = None
            self._phase = None
            shadow, self._shadow = self._shadow, None
            try:
                if shadow is not None:
                    shadow.stop()
            finally:
                self.backend.stop()
            own = self.backend.notes() if isinstance(self.backend, HasNotes) else []
            self.notes = [*own, *self.notes]  # the backend's, then ours
        return self._call

    def _keep_evidence(self) -> None:
        """Read what the backend can tell about the call before it stops observing it."""
        backend = self.backend
        leaked = self.leak_check and self._call is not None and self._call.net_bytes > 0
        if leaked and isinstance(backend, FindsSurvivors):
            self.survivors = backend.survivors(SURVIVORS_SHOWN)
            if isinstance(backend, ListsLiveStorages):
                self.leak_holding = leak_holding(backend.live_storages())
        self.trace = backend.trace() if isinstance(backend, RecordsTrace) else None
        stack = self._stack
        if stack is not None and stack.attribution is not None and self._call is not None:
            self.explanation = self._explained(stack.attribution, self._call)

    def _explained(self, attribution: Attributor, call: PhaseResult) -> Explanation | None:
        from pytest_gpumem.explain.replay import explain

        name = self.backend.name if self._shadow is None else f"{self.backend.name} (composition from a shadow tracker)"
        self.notes += [f"the explanation may be incomplete: {problem}" for problem in attribution.problems]
        try:
            explained = explain(attribution, {CALL: call, **self._results}, self.nodeid, name)
            ranks = self._ranks_explained
            if ranks is None:
                return explained
            from pytest_gpumem.explain.replay import with_ranks

            return with_ranks(explained, ranks, ranks_peak=call.rank is not None)
        except Exception as exc:  # an explanation never changes the test's outcome
            self.notes.append(f"the peak could not be explained: {type(exc).__name__}: {exc}")
            return None

    @staticmethod
    def phase_left_by(exc: BaseException) -> str | None:
        """The phase that `exc` propagated out of, if any (marked on the exception itself)."""
        return phase_left_by(exc)

    def end_call_if_running(self) -> None:
        """End the call if it is still measured (after an error on the way out): the backend's
        observation must never outlive the test."""
        if self._stack is not None:
            self.end_call()

    def _record(self, result: PhaseResult) -> None:
        previous = self._results.get(result.name)
        self._results[result.name] = result if previous is None else previous.merged(result)
