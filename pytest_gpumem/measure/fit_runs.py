"""One fit under way: the step, how it is measured, the capacity and the runs made so far (samples, and
loops held to the capacity), and the state the runs leave behind that a loop forgets first."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from cuda_allocator_model import format_size
from pytest_gpumem.backends.base import Backend
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.fit import LOOP_STEPS, MAX_BATCH, BatchFit, Check, Measure, Sample
from pytest_gpumem.measure.fit_arguments import check_sample
from pytest_gpumem.measure.fit_growth import SampledGrowth
from pytest_gpumem.measure.host import HOST_SHARE


class Optimizers:
    """The torch optimizers the fit's runs step that had no state when the fit first stepped them: that
    state is the fit's, and a loop forgets it first, to make it again among its own activations."""

    def __init__(self) -> None:
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self.made: weakref.WeakSet[Any] = weakref.WeakSet()

    def stepped(self, optimizer: Any, args: object, kwargs: object) -> None:
        if optimizer not in self.seen:
            self.seen.add(optimizer)
            if not optimizer.state:
                self.made.add(optimizer)

    def forget_state(self) -> None:
        for optimizer in list(self.made):
            optimizer.state = defaultdict(dict)

    def watching(self) -> AbstractContextManager[Any]:
        """`stepped` hooked while the handle is used as a context (torch's handle removes it on exit)."""
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        return register_optimizer_step_pre_hook(self.stepped)


class Gradients:
    """The parameters of the modules the fit's runs call that had no gradient when first called: a loop
    that ran out of memory in backward leaves them gradients a fresh test's loop would not start with."""

    def __init__(self) -> None:
        self.seen: set[int] = set()  # by id: a tensor's == compares its values
        self.bare: list[weakref.ref[Any]] = []

    def called(self, module: Any, args: object) -> None:
        for param in module.parameters(recurse=False):
            if id(param) not in self.seen:
                self.seen.add(id(param))
                if param.grad is None:
                    self.bare.append(weakref.ref(param))

    def forget(self) -> None:
        for ref in self.bare:
            param = ref()
            if param is not None:
                param.grad = None

    def watching(self) -> AbstractContextManager[Any]:
        """`called` hooked while the handle is used as a context (torch's handle removes it on exit)."""
        from torch.nn.modules.module import register_module_forward_pre_hook

        return register_module_forward_pre_hook(self.called)


@dataclass
class Fit:
    """One fit under way: the step, how to measure it, the capacity and the runs made so far."""

    step: Callable[[int], object]
    measure: Measure
    capacity: int
    runs_refused: str | None  # why runs at the sizes the capacity allows cannot be made here; None: they can
    backend: Backend | None = None
    host: int | None = None  # bytes of the host's a run may take beyond what was live (the CPU); None: no limit
    optimizers: Optimizers = field(default_factory=Optimizers)
    gradients: Gradients = field(default_factory=Gradients)
    growth: SampledGrowth | None = None
    warm_up: int = 0  # bytes the first run left allocated
    over: int = MAX_BATCH + 1  # a size whose step alone, held to the capacity, did not fit
    allowed: int = 0  # bytes a size may leave allocated, and a line may miss by
    given: int = 0  # the largest size the caller gave
    sizes: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    known: dict[int, Check] = field(default_factory=dict)  # the loop run at each size, by size
    began: object | None = None  # the allocator's state when the fit began, each loop's start
    warmed: bool = False  # whether the fit began on a warm-up's cache (`fit_search._warmed`)

    def sample(
        self, n: int, limit: int | None = None, steps: int = 1, done: list[int] | None = None, loop: bool = False
    ) -> Sample:
        """A run of `steps` steps of size n: a sample on an allocator with no segment cached by other sizes,
        a `loop` on the allocator as `forget` left it (as the fit began)."""
        __tracebackhide__ = True
        if self.backend is not None and not loop:
            self.backend.empty_cache()
        sample = check_sample(self.measure(bound_step(self.step, n, steps, done), limit), n)
        if sample.out_of_memory and limit is None:
            raise GpuMemError(f"fit: the step ran out of memory at size {n:,}, after {format_size(sample.peak)}")
        return sample

    def fits(self, n: int) -> bool:
        """Whether `LOOP_STEPS` steps of size n in a row run held to the capacity, from the state the fit
        began with: a loop's later steps start on the cache its earlier ones left, and the optimizer state
        its first step makes lies among that step's activations."""
        __tracebackhide__ = True
        known = self.known.get(n)
        if known is not None:
            return known.fits(self.capacity)
        self._host_allows(n)
        self.forget()
        done = [0]
        sample = self.sample(n, self.capacity, LOOP_STEPS, done, loop=True)
        steps = done[0] + sample.out_of_memory
        check = Check(n, sample.peak, sample.out_of_memory, sample.held, sample.place(), steps)
        self.checks.append(check)
        self.known[n] = check
        return check.fits(self.capacity)

    def forget(self) -> None:
        """Free what the fit's first run made and kept (optimizer state, cuBLAS workspaces), for a loop's
        first step to make again among its activations, and serve the loop from the allocator's state when
        the fit began (none of the cache its earlier runs left), as a fresh test that runs the loop there."""
        self.optimizers.forget_state()
        self.gradients.forget()
        if self.backend is not None:
            if self.warm_up:
                self.backend.clear_workspaces()
            self.backend.start_afresh(self.began)

    def _host_allows(self, n: int) -> None:
        __tracebackhide__ = True
        growth = self.growth
        if self.host is None or growth is None:
            return
        asks = growth.asks(n, self.capacity) - self.samples[0].start
        if asks > self.host:
            raise GpuMemError(
                f"fit: a run of size {n:,} would take about {format_size(asks)} of the host's memory (the sampled "
                f"sizes extrapolated), more than the {format_size(self.host)} its runs may take ({HOST_SHARE:.0%} of "
                "what it has available): fit on the meta device, whose runs allocate nothing"
            )

    def result(self, base: BatchFit, answer: int | None, peak: int, **found: object) -> BatchFit:
        return replace(
            base,
            sizes=tuple(self.sizes),
            peaks=tuple(s.peak for s in self.samples),
            left=tuple(s.left for s in self.samples),
            checks=tuple(self.checks),
            largest=answer,
            peak_bytes=peak,
            **found,  # type: ignore[arg-type]
        )


def bound_step(step: Callable[[int], object], n: int, steps: int, done: list[int] | None) -> Callable[[], object]:
    """`step(n)`, `steps` times in a row (each step's value dropped before the next, as in a loop; the
    last one's returned), counting those that returned in `done`."""

    def run() -> object:
        __tracebackhide__ = True
        value: object = None
        for _ in range(steps):
            value = None
            value = step(n)
            if done is not None:
                done[0] += 1
        return value

    return run
