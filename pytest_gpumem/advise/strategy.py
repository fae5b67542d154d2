"""What a memory-saving strategy is, and what it works on: the step's target, one run, and the patch that undoes it.

Each strategy says why it does not apply (or None), and applies itself to one run through `Run.patch`,
which records every attribute set, hook added and handle taken, and undoes them in reverse order. A
strategy may replace the run's `call` (what advise calls: the user's step) with a wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

_MISSING = object()


class Patch:
    """Changes to objects, each undone exactly (an instance attribute that did not exist is deleted)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        old = vars(obj).get(name, _MISSING)
        setattr(obj, name, value)
        self._undo.append(partial(_put_back, obj, name, old))

    def on_undo(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _put_back(obj: Any, name: str, old: object) -> None:
    if old is _MISSING:
        delattr(obj, name)
    else:
        setattr(obj, name, old)


@dataclass(frozen=True)
class Blocks:
    """The repeated blocks: the largest nn.ModuleList or nn.Sequential whose children share one class."""

    path: str
    modules: tuple[nn.Module, ...]

    @property
    def kind(self) -> str:
        return type(self.modules[0]).__name__


def find_blocks(model: nn.Module) -> Blocks | None:
    best: tuple[tuple[int, int], Blocks] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = tuple(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size == 0:
            continue
        key = (len(children), size)
        if best is None or key > best[0]:
            best = (key, Blocks(path or "(the model)", children))
    return None if best is None else best[1]


@dataclass
class Target:
    """What advise works on: the user's step, model and optimizer, and what was found in them."""

    step: Callable[..., object]
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    loss: nn.Module | None = None
    batch_size: int | None = None
    blocks: Blocks | None = None
    optimizer_steps: int | None = None  # the optimizer steps the step took as it is (None: not run yet, or none given)

    def parameters(self) -> list[nn.Parameter]:
        found = {id(p): p for p in self.model.parameters()}
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                found.update({id(p): p for p in group["params"]})
        return list(found.values())

    def param_dtype(self) -> torch.dtype:
        dtypes = {p.dtype for p in self.model.parameters() if p.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32


class OptimizerShim:
    """Stands in for the optimizer's `step` and `zero_grad` during a run: tells the phase splitter when
    the step runs, and lets strategies skip or prepare the user's calls."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._step = optimizer.step
        self._zero_grad = optimizer.zero_grad
        self.in_step = False
        self.step_allowed: Callable[[], bool] = lambda: True
        self.zero_allowed: Callable[[], bool] = lambda: True
        self.before_step: list[Callable[[], None]] = []
        self.calls = 0  # step calls, allowed or not
        self.steps = 0  # steps that ran

    def install(self, patch: Patch) -> None:
        patch.set_attr(self.optimizer, "step", self.step)
        patch.set_attr(self.optimizer, "zero_grad", self.zero_grad)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if not self.step_allowed():
            return None
        self.in_step = True
        try:
            for prepare in self.before_step:
                prepare()
            self.steps += 1
            return self._step(*args, **kwargs)
        finally:
            self.in_step = False

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self.zero_allowed():
            self._zero_grad(*args, **kwargs)


@dataclass
class Run:
    """One measured run of the step with some strategies applied."""

    target: Target
    patch: Patch
    call: Callable[[], object]
    shim: OptimizerShim | None
    dtype: torch.dtype  # what the step computes in, for the gradients' tolerance
    check: bool = False  # keep the gradients the optimizer steps with, to compare with as-is
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # by id of the parameter, on the host

    def keep_grad(self, param: torch.Tensor) -> None:
        """A host copy of `param`'s gradient now, made unseen by any dispatch mode (not measured)."""
        from pytest_gpumem.private_torch import no_dispatch_modes

        if self.check and param.grad is not None:
            with no_dispatch_modes():
                self.grads[id(param)] = param.grad.detach().to("cpu", copy=True)


class Strategy:
    """A way to save memory. `family` names what it changes: two strategies of one family conflict."""

    name = ""
    family = ""
    order = 1  # strategies that replace the call entirely go first (0), wrappers after
    keeps_randomness = True  # the run draws the as-is run's random numbers for the same tensors

    def describe(self, target: Target) -> str:
        raise NotImplementedError

    def skip_reason(self, target: Target) -> str | None:
        raise NotImplementedError

    def apply(self, run: Run) -> None:
        raise NotImplementedError
