"""What a strategy is, what it returns, and how its numbers are checked."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks

PHASES = ("forward", "backward", "step", "total")

# Relative error allowed between an fp32 strategy and the fp32 naive implementation. fp32 unit
# roundoff is 2**-24 ~ 6e-8 and a reordered sum of n terms moves a result by about sqrt(n) of those:
# the longest reduction here (16384 classes, 2048 hidden units) gives ~1e-5, so 1e-4 leaves 10x room
# while any real mistake (a wrong scale, a missing micro-batch) shows up as an error of order 1.
FP32_RTOL = 1e-4

# Reduced precision: error against the fp64 ground truth may exceed the naive implementation's error
# in the same dtype by at most the dtype's unit roundoff (one extra rounding of each value, e.g. the
# bf16 copy of a saved activation, adds at most that much relative error).
REDUCED_MARGIN = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


class PhaseMeter(Protocol):
    """The part of the `gpumem` fixture a strategy uses."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...


class NullMeter:
    """Runs a strategy without measuring (references, warm-up, and phases inside a 'total' phase)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


@dataclass
class Outcome:
    """Detached results: the loss, gradients under 'grad:<name>', parameters after the optimizer step
    under 'param:<name>'. `scale` holds, per key, the norm that errors are relative to (set on
    reference outcomes: the norm of a gradient, or of a parameter's update)."""

    loss: torch.Tensor
    tensors: dict[str, torch.Tensor]
    scale: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Expectation:
    """Bounds, in bytes derived by hand from the workload's sizes, on one measured phase: its peak, or
    with `net=True` what it leaves allocated (for a forward: the tensors saved for backward)."""

    phase: str
    low: int
    high: int
    why: str
    net: bool = False


Workload = Any  # one of the workload classes in models.py; each strategy knows its own


@dataclass(frozen=True)
class Strategy:
    """One way to compute the loss (and train step) of a workload.

    `step(meter, workload)` runs forward in phase "forward", backward in "backward" and any optimizer
    work in "step", and returns the Outcome. `reference` names the naive strategy on the same workload.
    `minimum(workload)` is the hand-derived least memory autograd needs (see each function's docstring).
    `expect(workload)` returns the bounds the shipped suite asserts. `precision(device)` is the reduced
    dtype the strategy computes in (None for fp32). `no_meta`, when set, says which op keeps the strategy
    from running on the meta device (tensors without data); it is skipped there with that reason.
    """

    name: str
    workload: str
    reference: str
    build: Callable[[float, torch.device], Workload]
    step: Callable[[PhaseMeter, Workload], Outcome]
    minimum: Callable[[Workload], int]
    expect: Callable[[Workload], list[Expectation]]
    precision: Callable[[torch.device], torch.dtype | None] = lambda device: None
    needs_cuda: bool = False
    no_meta: str | None = None

    def run(self, gpumem: PhaseMeter, workload: Workload) -> Outcome:
        return self.step(gpumem, workload)

    def minimum_bytes(self, workload: Workload) -> int:
        return self.minimum(workload)


def _row_major(saved: torch.Tensor) -> torch.Tensor:
    return saved.contiguous() if saved.dim() == 2 and not saved.is_contiguous() else saved


def fast_reduced_matmuls(device: torch.device, dtype: torch.dtype) -> AbstractContextManager[Any]:
    """For an unmeasured run in bf16 or fp16 on CPU: backward gets its saved matrices row-major (a Linear
    saves its weight transposed), so its input gradient multiplies by a transposed operand. Without a
    reduced-precision BLAS (CPUs without AVX512-BF16), torch's CPU kernel is ~20x slower when both
    operands are row-major; both kernels accumulate in fp32, so the values agree within rounding."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return nullcontext()
    return saved_tensors_hooks(lambda saved: saved, _row_major)


def amp_dtype(device: torch.device) -> torch.dtype:
    """What autocast computes in: bf16 on CPU (its autocast default), fp16 on CUDA."""
    return torch.bfloat16 if device.type == "cpu" else torch.float16


def detach_grads(named: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    items = named.items() if isinstance(named, dict) else named
    return {f"grad:{name}": t.grad.detach() for name, t in items if t.grad is not None}


def with_scales(outcome: Outcome, before: dict[str, torch.Tensor]) -> Outcome:
    """Attach the norms errors are measured against: |grad|, or |param after - param before|."""
    scale: dict[str, float] = {}
    for key, value in outcome.tensors.items():
        base = before.get(key.removeprefix("param:")) if key.startswith("param:") else None
        ref = value.double() if base is None else value.double() - base.double()
        scale[key] = max(float(ref.norm()), 1e-30)
    scale["loss"] = max(abs(float(outcome.loss)), 1e-30)
    return Outcome(outcome.loss, outcome.tensors, scale)


def relative_errors(got: Outcome, truth: Outcome) -> dict[str, float]:
    """Per key, |got - truth| / truth.scale[key], over the keys the strategy returns (and 'loss')."""
    missing = set(got.tensors) - set(truth.tensors)
    if missing or not got.tensors:
        raise AssertionError(f"outcome keys {sorted(got.tensors)} do not match the reference's {sorted(truth.tensors)}")
    errors = {"loss": abs(float(got.loss) - float(truth.loss)) / truth.scale["loss"]}
    for key, value in got.tensors.items():
        diff = value.double().cpu() - truth.tensors[key].double().cpu()
        errors[key] = float(diff.norm()) / truth.scale[key]
    return errors


def worst(errors: dict[str, float]) -> tuple[str, float]:
    key = max(errors, key=lambda k: errors[k] if math.isfinite(errors[k]) else math.inf)
    return key, errors[key]
