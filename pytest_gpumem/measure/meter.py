"""The `gpumem` fixture object, what a test author uses: named phases of the call, fits, advice,
gradients and worlds of ranks. What it measures lives in its `Measurement`
(`pytest_gpumem.measure.measurement`), the plugin's side, which begins and ends the call."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, final

from pytest_gpumem.backends.base import Backend
from pytest_gpumem.errors import GpuMemError, from_the_model
from pytest_gpumem.measure.oom_and_leaks import Failed, is_out_of_memory, trial
from pytest_gpumem.measure.regions import RegionStack, mark_phase
from pytest_gpumem.results import PhaseResult

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from pytest_gpumem.measure.fit import BatchFit, Measure
    from pytest_gpumem.measure.measurement import Measurement, WorldRunner
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.ranks import RankResult

CALL = "call"


def _finite_non_negative(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


@final
class MeasurementOff:
    """A measurement that is off (the plugin's, under --gpumem-disable): a `GpuMem` on it runs the test as
    without the plugin. Its phases measure nothing, `check_gradients()` checks nothing, and what reads or
    makes a measurement (`peak()`, `result()`, `fit()`, `advise()`, `distributed()`, `simulate_rank()`)
    calls `refuse` with its name instead (the plugin skips the test, saying why)."""

    def __init__(self, nodeid: str, backend: Callable[[], Backend], refuse: Callable[[str], NoReturn]) -> None:
        self.nodeid = nodeid
        self.info: Any = {}  # kept for the test's own reading; no result carries it
        self.refuse = refuse
        self._backend = backend

    @property
    def backend(self) -> Backend:
        """The backend the test would be measured on, made when first read."""
        __tracebackhide__ = True
        return self._backend()

    @property
    def phases(self) -> dict[str, PhaseResult]:
        return {}


@final
class GpuMem:
    """The `gpumem` fixture: measures the test's call and the phases opened with `phase(name)`; read them
    with `peak()`, `result()` and `phases`. Made by the plugin for each test, not by tests."""

    def __init__(self, measured: Measurement | MeasurementOff, advisor: Callable[..., Advice] | None = None) -> None:
        """Made by the plugin for each test on its `Measurement` (a `MeasurementOff` under --gpumem-disable),
        not by tests; `advisor` runs `advise()` (`pytest_gpumem.advise.run.advise`, given where the fixture
        is made: advise sits above measuring)."""
        self._measured = measured
        self._advisor = advisor

    def _on(self, call: str) -> Measurement:
        """The measurement, or, where it is off, its refusal of `gpumem.<call>`."""
        __tracebackhide__ = True
        measured = self._measured
        if isinstance(measured, MeasurementOff):
            measured.refuse(call)
        return measured

    @property
    def info(self) -> dict[str, Any]:
        """Your own JSON values for this test (str, numbers, lists, dicts): they travel into its result,
        the JSON report, the hooks and from xdist workers. pytest-gpumem writes nothing here: what it
        measures on request (fits, advice, worlds) has fields of its own on the `TestResult`."""
        info: dict[str, Any] = self._measured.info
        return info

    @info.setter
    def info(self, value: dict[str, Any]) -> None:
        self._measured.info = value

    @property
    def device(self) -> torch.device:
        """Where the test's tensors should go to be measured (e.g. cuda:0, or cpu for the tracker)."""
        __tracebackhide__ = True
        return self._measured.backend.device

    @property
    def backend(self) -> Backend:
        """The backend measuring this test (its `name`: tracker, cuda, or a plugin's)."""
        __tracebackhide__ = True
        return self._measured.backend

    @property
    def phases(self) -> dict[str, PhaseResult]:
        """The phases measured so far, in the order first opened (a copy)."""
        return self._measured.phases

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the `with` block as a phase of the call.

        Args:
            name: the phase's name, not empty and not "call"; the same name again keeps the larger peak
                of the two and the last net bytes. Phases do not nest.
        """
        __tracebackhide__ = True
        if not isinstance(name, str) or not name or name == CALL:
            raise GpuMemError(f"gpumem.phase() needs a non-empty name other than {CALL!r}, got {name!r}")
        measured = self._measured
        if isinstance(measured, MeasurementOff):  # the block runs, measured by nothing
            yield
            return
        stack = self._running(f"phase({name!r})")
        if measured.advising:
            yield
            return
        if measured.open_phase is not None:
            raise GpuMemError(f"gpumem.phase({name!r}) opened inside phase {measured.open_phase!r}: phases cannot nest")
        stack.push(name)
        measured.open_phase = name
        try:
            yield
        except BaseException as exc:
            mark_phase(exc, name)
            raise
        finally:
            if measured.stack is stack and measured.open_phase == name:
                measured.open_phase = None
                measured.record(stack.pop())

    def _running(self, call: str) -> RegionStack:
        """The call's open regions, or the one-line refusal of `gpumem.<call>` outside the test function."""
        __tracebackhide__ = True
        measured = self._on(call)
        if measured.stack is None:
            raise GpuMemError(f"gpumem.{call} works only while the test function of {measured.nodeid} runs")
        return measured.stack

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
        """Find the largest batch size whose absolute peak fits a capacity (see the fit guide).

        The answer comes from each size's timeline where the ops are the same at every size, else it is
        searched by runs held to the capacity; its sentence is also in the result's `fits`.

        Args:
            step: runs one step at batch size n; each run is its own phase `name[i]`.
            sizes: the batch sizes measured first (at least 2 distinct, 3 to check the lines).
            capacity: bytes or a size ("24 GB") or a card's name ("H100-80GB", its usable memory).
            name: the prefix of the runs' phases (a second fit in the test adds "#2").
            tolerance: how far a size's bytes may lie from its line, as a fraction of the largest peak
                (default 0.01) before the answer is searched instead.
            slack: bytes always accepted off the line (default 4096).
            confirm: run the answer and the next size held to the capacity where a run is cheap.

        Returns:
            The `BatchFit`: `largest` (None when no batch fits), its peak, how it was found.
        """
        __tracebackhide__ = True
        from cuda_allocator_model import parse_capacity
        from pytest_gpumem.measure.fit_search import DEFAULT_SLACK, DEFAULT_TOLERANCE, FIT_CAPACITY, fit_peaks
        from pytest_gpumem.measure.host import runs_refused

        measured = self._on("fit()")
        count = len(measured.found("fits")) + 1  # each fit's phases are its own: the second's are "fit#2[i]"
        label = name if count == 1 else f"{name}#{count}"
        with from_the_model():  # a named card's runs are the card's (its cuBLAS workspaces)
            judged = parse_capacity(capacity, FIT_CAPACITY)
        card = judged.card
        predicting = self.backend.predicting(card.name) if card else None
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
                backend=self.backend,
            )
        measured.add(fits=found.describe())
        return found

    def _fit_measure(self, label: str) -> Measure:
        """Each run of a fit in a phase of its own, with its timeline where the backend records one, held to
        `limit` where given and the backend can hold it (an OutOfMemoryError past it is then the sample's)."""
        from pytest_gpumem.measure.fit import Sample

        counter = itertools.count()
        measured = self._on("fit()")

        def measure(fn: Callable[[], object], limit: int | None = None) -> Sample:
            __tracebackhide__ = True
            phase = f"{label}[{next(counter)}]"
            backend = self.backend
            holding = backend.held_to(limit) if limit is not None and backend.caps_a_block else None
            recording = backend.timeline()
            start, timeline = 0, None

            def run() -> None:
                __tracebackhide__ = True
                nonlocal start, timeline
                with self.phase(phase):
                    start = backend.current().allocated  # the phase's start: what is live before the step
                    with holding or contextlib.nullcontext(), recording or contextlib.nullcontext() as recorded:
                        fn()  # what the step returns is dropped inside the phase: freed before the next size
                    timeline = None if recorded is None else recorded()

            ran = trial(run, lambda exc: limit is not None and is_out_of_memory(exc))
            out_of_memory = isinstance(ran, Failed)  # the only error caught
            result = measured.result(phase)
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
        """Measure a training step as it is and with each memory-saving strategy (see the advise guide).

        The strategies are applied to `model` and `optimizer` from outside and undone: both are as they
        were afterwards. Advise's runs are not part of the call's peak; a test over its budget names the
        cheapest strategy that keeps it in its failure line.

        Args:
            step: one training step, called with no argument (micro-batching calls it with `batch=`).
            model: the module the strategies change (checkpointing, autocast, ...).
            optimizer: its optimizer, for `fused-step`, `foreach-off` and micro-batching.
            capacity: bytes, a size or a card's name; each row then says whether it fits.
            strategies: the names to try (any iterable); None tries them all and stacks those that save.
            loss: the loss module, for `chunked-ce`: `forward(hidden, targets)`.
            batch_size: the step's batch size, for micro-batching.

        Returns:
            The `Advice`: one row per strategy, `best()`, and the strategies skipped with their reasons.
        """
        __tracebackhide__ = True
        measured = self._on("advise()")
        if self._advisor is None:
            raise GpuMemError("gpumem.advise() runs strategies only for a meter given its advisor (the gpumem fixture)")
        with self._advising():
            found = self._advisor(
                step,
                model=model,
                backend=self.backend,
                optimizer=optimizer,
                capacity=capacity,
                strategies=strategies,
                loss=loss,
                batch_size=batch_size,
            )
        measured.keep(advice=found)  # for the failure line, report and JSON
        return found

    @contextmanager
    def _advising(self) -> Iterator[None]:
        """While advise runs inside a test: its runs are not the test's call (the call's peak is folded
        before and reset after), the step's own gpumem.phase() blocks measure nothing, and a capacity set on
        the tracker is lifted (advise judges the capacity itself)."""
        stack = self._running("advise()")
        measured = self._on("advise()")
        if (phase := measured.open_phase) is not None:
            raise GpuMemError(f"gpumem.advise() called inside phase {phase!r}: call it outside phases")
        backend = self.backend
        lifted = backend.held_to(None) if backend.caps_a_block else contextlib.nullcontext()
        try:
            with stack.unmeasured("gpumem.advise"), lifted:
                advising, measured.advising = measured.advising, True
                try:
                    yield
                finally:
                    measured.advising = advising
        finally:  # what advise's runs cached past a lifted capacity must not serve the test's own step
            if backend.caps_a_block:
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
        """Run a function on spawned ranks, each measured on its own backend (see the distributed guide).

        Each rank's phases are recorded as `phase@rankN` and `phase` (the worst rank); the worst rank's
        whole run is phase `name` and counts in the call's peak. A failed rank fails the test in one line
        naming it.

        Args:
            fn: called as `fn(rank, world_size, meter, *args)` in each rank, `meter` the rank's own.
            world_size: how many ranks to start (at most 64).
            args: more arguments for `fn`, pickled to each rank.
            backend: the process group's backend (default gloo on the tracker, NCCL on CUDA).
            timeout: seconds the ranks may take (default: --gpumem-dist-timeout).
            name: the phase of each rank's whole run.

        Returns:
            One `RankResult` per rank: its call, phases, `fn`'s value, info and notes.
        """
        __tracebackhide__ = True
        measured = self._on("distributed()")
        if measured.stack is None or measured.open_phase is not None:
            where = (
                "while the test function runs" if measured.stack is None else f"outside phase {measured.open_phase!r}"
            )
            raise GpuMemError(f"gpumem.distributed() works only {where} in {measured.nodeid}")
        world = self._runner("distributed").run(
            measured, fn, world_size, args=args, backend=backend, timeout=timeout, name=name
        )
        measured.add_world(world, name)
        return world.ranks

    def simulate_rank(
        self, fn: Callable[..., object], world_size: int, *, rank: int = 0, args: Sequence[Any] = ()
    ) -> Any:
        """Run a function here as one rank of a simulated world (torch's fake process group).

        Collectives move no data, so the phases it opens estimate that rank's peaks at a world size this
        machine cannot start.

        Args:
            fn: called as `fn(rank, world_size, meter, *args)`, `meter` being this one.
            world_size: the size of the simulated world.
            rank: the rank this process plays, in 0..world_size - 1.
            args: more arguments for `fn`.

        Returns:
            What `fn` returns.
        """
        __tracebackhide__ = True
        self._running("simulate_rank()")
        value = self._runner("simulate_rank").simulate(self, fn, world_size, rank=rank, args=args)
        self._on("simulate_rank()").add(simulated={"world_size": world_size, "rank": rank})
        return value

    def _runner(self, method: str) -> WorldRunner:
        __tracebackhide__ = True
        worlds = self._on(f"{method}()").worlds
        if worlds is None:
            raise GpuMemError(f"gpumem.{method}() runs ranks only for a meter given its worlds (the gpumem fixture)")
        return worlds

    def check_gradients(
        self,
        model_or_named_tensors: torch.nn.Module | Mapping[str, torch.Tensor | None],
        *,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        """Fingerprint the gradients now, to compare with the stored baseline after the call.

        The fingerprint's own work is not measured.

        Args:
            model_or_named_tensors: a module (its parameters' `.grad`) or a dict of names to tensors
                (gradients themselves, unless they are parameters: then their `.grad`).
            rtol: relative tolerance, instead of the dtype's default.
            atol: absolute tolerance, instead of the dtype's default.
        """
        __tracebackhide__ = True
        if isinstance(self._measured, MeasurementOff):  # nothing to compare them with: no baseline is judged
            return
        from pytest_gpumem.gradients.fingerprint import fingerprint

        stack = self._running("check_gradients()")
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is not None and not _finite_non_negative(value):
                raise GpuMemError(f"gpumem.check_gradients({name}=...) must be a finite number >= 0, got {value!r}")
        with stack.unmeasured("gpumem.check_gradients"):
            try:
                found = fingerprint(model_or_named_tensors)
            except (TypeError, ValueError) as exc:
                raise GpuMemError(f"gpumem.check_gradients(): {exc}") from None
        self._on("check_gradients()").keep(gradients=found, gradient_tolerance=(rtol, atol))

    def peak(self, name: str | None = None) -> int:
        """Peak bytes above the start of a phase, or of the whole call (so far, while the test runs).

        Args:
            name: the phase; None or "call" for the call. A name never opened fails in one line listing
                the phases measured.
        """
        __tracebackhide__ = True
        return self._on("peak()").peak(name)

    def result(self, name: str | None = None) -> PhaseResult:
        """What a phase measured, or the whole call (so far, while the test runs).

        Args:
            name: the phase; None or "call" for the call. A name never opened fails in one line listing
                the phases measured.

        Returns:
            The `PhaseResult`: peak, net and start bytes, and the reserved peak where the backend caches.
        """
        __tracebackhide__ = True
        return self._on("result()").result(name)
