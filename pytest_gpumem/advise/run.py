"""`gpumem.advise`: the user's training step measured as it is and with each memory-saving strategy.

Every run starts from the same state, as a process of its own would: parameters, buffers, gradients,
optimizer state and RNG as they were when advise was called; no cuBLAS workspace, and the allocator's
cache emptied, so that only what is live holds segments. A run is split into phases from outside: "step"
while the optimizer's step runs, "backward" while autograd's engine runs an op
(`private_torch.in_backward()`), "forward" otherwise; each phase's peak is taken above its
own start (what a test's gpumem.phase() measures) and above the step's start. One dispatch mode above the
backend's opens those regions and counts FLOPs with torch's flop counter formulas
(`torch.utils.flop_counter.flop_registry`, which work on meta) and the ops that launch kernels
(micro-batches and selective recompute cost calls, not FLOPs).
The copies that make runs repeatable and the gradients' check are in `check.py`; everything is put back
when advise returns: the same parameter, gradient and state objects. Each run is timed: a run costs about
the step's own time, so an advice costs it once per strategy tried and per combination.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from cuda_allocator_model import shorten
from pytest_gpumem.advise.check import Saved, compare, randomness, scales
from pytest_gpumem.advise.strategies import all_strategies, conflict, ordered
from pytest_gpumem.advise.strategy import OptimizerShim, Patch, Run, Strategy, Target, find_blocks
from pytest_gpumem.backends.tracker.storages import cuda_block_size
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.oom_and_leaks import Failed, trial
from pytest_gpumem.measure.regions import RegionStack
from pytest_gpumem.private_torch import TorchDispatchMode, in_backward, pytree_leaves, storage_key
from pytest_gpumem.results.advice import AS_IS, NOT_CHECKED, Advice, PhasePeak, Row, capacity_bytes, held_bytes

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.results import PhaseResult

_PHASE_ORDER = ("forward", "backward", "step")
_MAX_COMBINATIONS = 4


@functools.cache
def _launches(func: Any) -> bool:
    """Whether an op launches a kernel: not a view (metadata only), nor the profiler's record_function
    markers (a per-parameter optimizer's step adds two per call)."""
    return not getattr(func, "is_view", False) and getattr(func, "namespace", "") != "profiler"


class _Splitter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Opens a region per phase on `stack` as the ops run, and counts their FLOPs."""

    def __init__(self, stack: RegionStack, shim: OptimizerShim | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.stack, self.shim = stack, shim
        self.current: str | None = None
        self.phases: dict[str, PhaseResult] = {}
        self.above_start: dict[str, int] = {}  # each phase's highest peak above the step's start
        self.offset = 0  # bytes allocated above the step's start when the current phase began
        self.allocating: set[str] = set()  # phases with an entry that allocated
        self.flops = 0
        self.calls = 0  # ops that launch kernels: a time cost that FLOPs do not show

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        phase = "backward" if in_backward() else "forward"
        if self.shim is not None and self.shim.in_step:
            phase = "step"
        if phase != self.current:
            self.close()
            self.stack.push(phase)
            self.offset = self.stack.open[-1].start.allocated - self.stack.open[0].start.allocated
            self.current = phase
        out = func(*args, **kwargs)
        if _launches(func):
            self.calls += 1
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += _flops(count, args, kwargs, out)
        return out

    def close(self) -> None:
        if self.current is None:
            return
        result = self.stack.pop()
        self.current = None
        earlier = self.phases.get(result.name)
        self.phases[result.name] = result if earlier is None else earlier.merged(result)
        # An entry that allocated nothing (zero_grad's profiler op after the step, a loss.item()) holds
        # what the phase before it left, not a peak of its own: it counts only for a phase without others.
        name, high = result.name, self.offset + result.peak_bytes
        if result.peak_bytes > 0 and name not in self.allocating:
            self.above_start[name] = high
            self.allocating.add(name)
        elif result.peak_bytes > 0 or name not in self.allocating:
            self.above_start[name] = max(self.above_start.get(name, high), high)


@dataclass
class _Measured:
    total: PhaseResult
    phases: dict[str, PhaseResult]
    above_start: dict[str, int]
    flops: int
    calls: int
    outcome: dict[str, torch.Tensor] | None
    dtype: torch.dtype
    steps: int | None  # optimizer steps the run took (None: no optimizer given)
    drew_random: bool
    seconds: float


def _flops(count: Callable[..., Any], args: Any, kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one op by its formula in torch's registry. A formula registered on shapes is called on
    them directly: its own wrapper maps the arguments with pytree, which cost ~80 µs an op, more than the
    op itself on small tensors."""
    formula = getattr(count, "__wrapped__", None)
    if formula is None:  # a formula registered on the raw arguments (get_raw=True)
        return int(count(*args, **kwargs, out_val=out))
    shaped = {key: _shapes(value) for key, value in kwargs.items()}
    return int(formula(*_shapes(args), out_shape=_shapes(out), **shaped))


def _shapes(value: Any) -> Any:
    """`value` with every tensor in it replaced by its shape (what the registry's shape_wrapper passes)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (list, tuple)):
        return type(value)(_shapes(v) for v in value) if type(value) in (list, tuple) else tuple(map(_shapes, value))
    if isinstance(value, dict):
        return {key: _shapes(v) for key, v in value.items()}
    return value


def _measure(backend: Backend, target: Target, saved: Saved, chosen: Sequence[Strategy], check: bool) -> _Measured:
    started = time.perf_counter()
    patch = Patch()
    shim = None if target.optimizer is None else OptimizerShim(target.optimizer)
    run = Run(target, patch, target.step, shim, target.param_dtype(), check=check)
    saved.prepare()
    backend.clear_workspaces()  # every run makes its cuBLAS workspaces, as the test's own step does
    backend.empty_cache()  # nor the segments an earlier run left cached
    try:
        if shim is not None:
            shim.install(patch)
        for strategy in ordered(list(chosen)):
            strategy.apply(run)
        if shim is not None:
            params = target.parameters()

            def keep() -> None:  # after the strategies' own preparations (micro-batching's averaging)
                for p in params:
                    run.keep_grad(p)

            shim.before_step.append(keep)
        stack = RegionStack(backend)
        splitter = _Splitter(stack, shim)
        stack.push("total")
        try:
            with splitter:
                run.call()
        finally:
            splitter.close()
            total = stack.pop()
        drew = saved.drew_random()
        outcome = saved.outcome(run.grads) if check else None
    finally:
        patch.undo()
    steps = None if shim is None else shim.steps
    seconds = time.perf_counter() - started
    return _Measured(
        total,
        splitter.phases,
        splitter.above_start,
        splitter.flops,
        splitter.calls,
        outcome,
        run.dtype,
        steps,
        drew,
        seconds,
    )


def _resident(target: Target) -> dict[int, int]:
    """Bytes of each distinct storage the step starts from (parameters, buffers, gradients, optimizer
    state), by storage key."""
    tensors: list[torch.Tensor] = [*target.parameters(), *target.model.buffers()]
    tensors += [p.grad for p in target.parameters() if p.grad is not None]
    if target.optimizer is not None:
        tensors += [v for v in pytree_leaves(dict(target.optimizer.state)) if isinstance(v, torch.Tensor)]
    sizes = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage_key(storage)] = storage.nbytes()
    return sizes


def _live(backend: Backend, resident: Mapping[int, int]) -> int:
    """What is allocated when the step begins: what the backend counts, plus the model's state that a
    backend counting only what it saw allocated (the tracker) did not see (made before it observed),
    as it would have counted it. Taken before advise makes its own copies."""
    backend.settle()
    counted = backend.current().allocated
    if backend.sees_earlier_allocations:
        return counted
    seen = backend.live_storages()
    rounded = cuda_block_size if backend.rounding == "cuda" else int
    return counted + sum(rounded(size) for key, size in resident.items() if key not in seen)


class _Advisor:
    def __init__(self, backend: Backend, target: Target, capacity: int | None, chosen: list[Strategy]) -> None:
        self.backend, self.target, self.capacity, self.chosen = backend, target, capacity, chosen
        self.check = target.device.type != "meta"
        resident = _resident(target)
        self.resident = sum(resident.values())
        self.live = _live(backend, resident)
        self.saved = Saved(target)
        self.reference: dict[str, torch.Tensor] | None = None
        self.scales: dict[str, float] = {}
        self.base: _Measured | None = None

    def run(self) -> Advice:
        started = time.perf_counter()
        try:
            self.base = _measure(self.backend, self.target, self.saved, [], self.check)
            self.target.optimizer_steps = self.base.steps
            if self.base.outcome is not None:
                self.reference, self.scales = self.base.outcome, scales(self.base.outcome)
            rows = [self._row(AS_IS, "the step as it is", (), self.base, ())]
            applicable: list[Strategy] = []
            for strategy in self.chosen:
                reason = strategy.skip_reason(self.target)
                if reason is None:
                    applicable.append(strategy)
                    rows.append(self._try([strategy]))
                else:
                    rows.append(Row(strategy.name, strategy.describe(self.target), (strategy.name,), skipped=reason))
            conflicts = [
                f"{a.name} and {b.name}: {why}"
                for i, a in enumerate(applicable)
                for b in applicable[i + 1 :]
                if (why := conflict(a, b)) is not None
            ]
            rows += self._combinations(applicable, rows)
        finally:
            self.saved.restore()
        elapsed = time.perf_counter() - started
        return Advice(
            tuple(rows),
            self.capacity,
            self.live,
            self.backend.name,
            str(self.target.device),
            self.resident,
            tuple(conflicts),
            elapsed,
        )

    def _try(self, strategies: list[Strategy]) -> Row:
        name = " + ".join(s.name for s in strategies)
        description = " and ".join(s.describe(self.target) for s in strategies)
        names = tuple(s.name for s in strategies)
        started = time.perf_counter()
        measured = trial(lambda: _measure(self.backend, self.target, self.saved, strategies, self.check), _any_error)
        if not isinstance(measured, Failed):
            return self._row(name, description, names, measured, strategies)
        # a strategy the step does not survive is reported, not raised
        why = "ran out of memory" if measured.out_of_memory else f"the step raised {measured.kind}"
        text = " ".join(measured.text.split())
        seconds = time.perf_counter() - started
        return Row(name, description, names, skipped=f"{why}: {text}" if text else why, seconds=seconds)

    def _gradients(self, measured: _Measured, strategies: Sequence[Strategy]) -> tuple[str, bool | None]:
        if measured.outcome is None or self.reference is None:
            return f"{NOT_CHECKED} (meta: no data)", None
        text, equal, where = compare(measured.outcome, self.reference, self.scales, measured.dtype)
        assert self.base is not None
        reordered = [s.name for s in strategies if not s.keeps_randomness]
        if equal is False and reordered and self.base.drew_random:
            why = randomness(self.target.model)
            return f"{NOT_CHECKED}: the random numbers differ between the runs ({why}; {where})", None
        return text, equal

    def _row(
        self, name: str, description: str, names: tuple[str, ...], measured: _Measured, parts: Sequence[Strategy]
    ) -> Row:
        assert self.base is not None
        phases = sorted(measured.phases.values(), key=lambda r: _PHASE_ORDER.index(r.name))
        peak, reserved = measured.total.peak_bytes, measured.total.reserved_peak_bytes
        gradients, equal = self._gradients(measured, parts)
        lower = measured.dtype if measured.dtype != self.base.dtype else None
        return Row(
            name,
            description,
            names,
            peak_bytes=peak,
            phases=tuple(PhasePeak(r.name, r.peak_bytes, measured.above_start[r.name]) for r in phases),
            saving_bytes=self.base.total.peak_bytes - peak,
            flops=measured.flops,
            extra_flops=measured.flops - self.base.flops,
            calls=measured.calls,
            extra_calls=measured.calls - self.base.calls,
            gradients=gradients,
            gradients_equal=equal,
            fits=None if self.capacity is None else held_bytes(self.live + peak, reserved) <= self.capacity,
            reserved_bytes=reserved,
            precision=None if lower is None else str(lower).removeprefix("torch."),
            seconds=measured.seconds,
        )

    def _combinations(self, applicable: list[Strategy], rows: list[Row]) -> list[Row]:
        """Stack greedily, in `_order` (the step's precision first, best saving per extra FLOP, then per
        extra op call), the strategies that alone lowered a phase with gradients not found to differ. One
        is tried on the stack only when alone it lowered the phase where the stack now peaks, and kept
        there only when it lowers the stack's peak; each time the stack grows, the ones not tried yet are
        looked at again against its new peak phase (a stack that became step-bound tries the fused step,
        which alone saved nothing where as-is peaked)."""
        by_name = {s.name: s for s in applicable}
        base = rows[0]
        pending = [r for r in rows if r.name in by_name and r.measured and r.gradients_equal is not False]
        pending = sorted((r for r in pending if _lowers_any(r, base)), key=_order)
        stack: list[Strategy] = []
        found: list[Row] = []
        best = base
        while len(found) < _MAX_COMBINATIONS:
            row = next((r for r in pending if r.lowers(base, best.peak_phase)), None)
            if row is None:
                break
            pending.remove(row)
            candidate = by_name[row.name]
            if any(conflict(candidate, s) is not None for s in stack):
                continue
            combined = self._try([*stack, candidate]) if stack else row
            if stack:
                found.append(combined)
            lower = combined.measured and (combined.peak_bytes or 0) < (best.peak_bytes or 0)
            if lower and combined.gradients_equal is not False:
                stack.append(candidate)
                best = combined
        return found


def _any_error(exc: Exception) -> bool:
    return True


def _lowers_any(row: Row, base: Row) -> bool:
    """Whether `row` alone lowered the step's peak or the peak of one of the phases against as-is."""
    if (row.peak_bytes or 0) < (base.peak_bytes or 0):
        return True
    return any(row.lowers(base, phase.name) for phase in base.phases)


def _order(row: Row) -> tuple[bool, float, float, int]:
    """The step's own precision first (as `cheapest` ranks), then the best saving per extra FLOP, per extra
    op call, then the largest saving."""
    saving = row.saving_bytes or 0
    return (row.precision is not None, -_per(saving, row.extra_flops), -_per(saving, row.extra_calls), -saving)


def _per(saving: int, extra: int | None) -> float:
    return float("inf") if not extra or extra <= 0 else saving / extra


def _strategies(names: Iterable[str] | None) -> list[Strategy]:
    known = all_strategies()
    if names is None:
        return known
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise GpuMemError(f"gpumem.advise(strategies=...) must be a list of names, got {shorten(names)}")
    listed = list(names)  # a generator is read once
    wrong = [n for n in listed if not isinstance(n, str)]
    if wrong:
        raise GpuMemError(f"gpumem.advise(strategies=...) must be a list of names, got {shorten(wrong[0])} in it")
    by_name = {s.name: s for s in known}
    unknown = [n for n in listed if n not in by_name]
    if unknown:
        raise GpuMemError(f"gpumem.advise: no strategy {shorten(unknown[0])} (known: {', '.join(by_name)})")
    return [by_name[n] for n in dict.fromkeys(listed)]


def _target(
    step: Callable[..., object],
    model: object,
    optimizer: object,
    loss: object,
    batch_size: object,
    device: torch.device,
) -> Target:
    if not callable(step):
        raise GpuMemError(f"gpumem.advise() needs a callable step, got {shorten(step)}")
    if not isinstance(model, nn.Module):
        raise GpuMemError(f"gpumem.advise(model=...) must be a torch.nn.Module, got {shorten(model)}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise GpuMemError(f"gpumem.advise(optimizer=...) must be a torch.optim.Optimizer, got {shorten(optimizer)}")
    if loss is not None and not isinstance(loss, nn.Module):
        raise GpuMemError(f"gpumem.advise(loss=...) must be a torch.nn.Module, got {shorten(loss)}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise GpuMemError(f"gpumem.advise(batch_size=...) must be a positive int, got {shorten(batch_size)}")
    first = next(model.parameters(), None)
    return Target(
        step, model, optimizer, device if first is None else first.device, loss, batch_size, find_blocks(model)
    )


def advise(
    step: Callable[..., object],
    *,
    model: nn.Module,
    backend: Backend,
    optimizer: torch.optim.Optimizer | None = None,
    capacity: int | str | None = None,
    strategies: Iterable[str] | None = None,
    loss: nn.Module | None = None,
    batch_size: int | None = None,
) -> Advice:
    """Measure `step()` as it is and with each strategy on `backend` (already observing), and return the
    Advice. Model, optimizer and RNG are as they were afterwards."""
    limit = None if capacity is None else capacity_bytes(capacity, "gpumem.advise(capacity=...)")
    target = _target(step, model, optimizer, loss, batch_size, backend.device)
    return _Advisor(backend, target, limit, _strategies(strategies)).run()
