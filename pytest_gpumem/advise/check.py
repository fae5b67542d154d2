"""What every run of advise starts from and leaves behind, and how its gradients are checked against as-is.

`Saved` holds the state every run starts from (parameters, buffers, gradients, optimizer state and RNG as
they were when advise was called) and puts the very objects back at the end. The copies are made with
every dispatch mode disabled, so no backend counts them. `compare` judges a run's gradients against the
as-is run's, by parameter name, within a tolerance for the dtype the step computes in; `randomness` says
whether the step draws random numbers (dropout), which a strategy that reorders the draws cannot match.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from pytest_gpumem.advise.strategy import Target
from pytest_gpumem.private_torch import dropout_base, no_dispatch_modes, pytree_map

# Largest relative error (the norm of the difference over the norm of the as-is gradient) that counts
# as equal, by the dtype the step computes in. fp32: reordered sums of up to ~1e4 terms move a result by
# ~1e-5 (reference_losses' FP32_RTOL); bf16 keeps 8 bits, so one rounding of every activation moves a
# gradient by up to ~2**-8 per layer.
_GRADIENT_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2.0**-4, torch.float16: 2.0**-7}


def _copy(value: object) -> object:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _names(target: Target) -> dict[int, str]:
    """Each parameter's qualified name in the model (by id), or its place among the optimizer's."""
    names = {id(p): name for name, p in target.model.named_parameters()}
    for index, p in enumerate(target.parameters()):
        names.setdefault(id(p), f"the optimizer's parameter {index}")
    return names


def _rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


class Saved:
    """The state every run starts from, and what advise leaves behind: the very objects it found."""

    def __init__(self, target: Target) -> None:
        self.target = target
        with no_dispatch_modes(), torch.no_grad():
            self.params = [(p, p.detach().clone()) for p in target.parameters()]
            self.buffers = [(b, b.detach().clone()) for b in target.model.buffers()]
        self.names = _names(target)
        self.grads = [(p, p.grad) for p, _ in self.params]
        optimizer = target.optimizer
        self.state = None if optimizer is None else optimizer.state
        self.groups = None if optimizer is None else optimizer.param_groups
        self.rng, self.cuda_rng = _rng()
        self.dirty = False  # a run has changed the values since they were saved

    def _values(self) -> None:
        if self.dirty:
            with no_dispatch_modes(), torch.no_grad():
                for tensor, saved in [*self.params, *self.buffers]:
                    tensor.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def prepare(self) -> None:
        """Before a run: the saved values, fresh copies of gradients and of the optimizer's state."""
        self._values()
        self.dirty = True
        with no_dispatch_modes(), torch.no_grad():
            for p, grad in self.grads:
                p.grad = None if grad is None else grad.detach().clone()
            optimizer = self.target.optimizer
            if optimizer is not None and self.state is not None and self.groups is not None:
                optimizer.state = defaultdict(dict, pytree_map(_copy, dict(self.state)))
                optimizer.param_groups = [dict(group) for group in self.groups]

    def restore(self) -> None:
        self._values()
        for p, grad in self.grads:
            p.grad = grad
        optimizer = self.target.optimizer
        if optimizer is not None and self.state is not None and self.groups is not None:
            optimizer.state = self.state
            optimizer.param_groups = self.groups

    def drew_random(self) -> bool:
        """Whether the run since `prepare` drew from torch's random number generators."""
        rng, cuda = _rng()
        moved = not torch.equal(rng, self.rng)
        if cuda is not None and self.cuda_rng is not None:
            moved = moved or any(not torch.equal(a, b) for a, b in zip(cuda, self.cuda_rng, strict=False))
        return moved

    def outcome(self, stepped: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """By parameter name: the gradients the optimizer stepped with (`stepped`, host copies by id of the
        parameter), or without an optimizer step the gradients the step left, copied to the host."""
        if stepped:
            return {self.names[id(p)]: stepped[id(p)] for p, _ in self.params if id(p) in stepped}
        found: dict[str, torch.Tensor] = {}
        with no_dispatch_modes(), torch.no_grad():
            for p, _ in self.params:
                if p.grad is not None:
                    found[self.names[id(p)]] = p.grad.detach().to("cpu", copy=True)
        return found


def scales(outcome: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """What errors are relative to: each gradient's norm."""
    with no_dispatch_modes(), torch.no_grad():
        return {key: max(float(value.float().norm()), 1e-30) for key, value in outcome.items()}


def compare(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], scale: Mapping[str, float], dtype: torch.dtype
) -> tuple[str, bool | None, str]:
    """'equal (error 3e-02 <= 6e-02)' or 'differ (error 8e-01 > 1e-04 in h.0.attn.weight)', the verdict,
    and the worst error with the parameter it is in."""
    keys = [key for key in got if key in ref]
    if not keys:
        return "not checked: no gradients to compare", None, ""
    rtol = _GRADIENT_RTOL.get(dtype, _GRADIENT_RTOL[torch.float32])
    worst_key, worst = keys[0], 0.0
    with no_dispatch_modes(), torch.no_grad():
        for key in keys:
            error = float(torch.dist(got[key].float(), ref[key].float())) / scale[key]
            if not error <= worst:  # NaN counts as the worst
                worst_key, worst = key, error
    if worst <= rtol:
        return f"equal (error {worst:.0e} <= {rtol:.0e})", True, ""
    where = f"error {worst:.0e} > {rtol:.0e} in {worst_key}"
    return f"differ ({where})", False, where


def randomness(model: nn.Module) -> str:
    """What makes the step draw random numbers, as far as the model shows: '12 dropout modules in training
    mode', else only that torch's generator moved."""
    dropouts = [m for m in model.modules() if isinstance(m, dropout_base()) and m.training and m.p > 0]
    if not dropouts:
        return "the step draws from torch's random number generator"
    return f"{len(dropouts)} dropout module{'s' if len(dropouts) > 1 else ''} in training mode"
