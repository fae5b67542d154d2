"""The memory-saving strategies advise tries, each applied to one run from outside and undone by its patch:
checkpointing the blocks (all, every other, selective), autocast, a fused optimizer step, single-tensor
optimizers, saved tensors on the CPU, micro-batches and chunked cross-entropy; and which ones combine.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pytest_gpumem.advise.chunked import chunked_cross_entropy
from pytest_gpumem.advise.strategy import Patch, Run, Strategy, Target

_BATCH_ARGUMENT = "batch"  # the optional parameter of a step that can run on a slice of its batch
_MICRO_BATCHES = (2, 4)
_EVERY = 2  # checkpoint every _EVERY-th block
_CE_CHUNKS = 8

# Optimizers whose step updates each parameter from its own gradient and state only, so that one
# optimizer per parameter, stepped as its gradient is ready, computes the same update.
_PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)

# Outputs selective checkpointing keeps: matrix products and attention (expensive to recompute).
_SAVED_OPS = frozenset(
    op
    for op in (
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.convolution.default,
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    )
    if op is not None
)


def _ordinal(n: int) -> str:
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n if n < 20 else n % 10, 'th') }"


def _never_steps(target: Target) -> bool:
    """Whether the step as it is ran without calling optimizer.step() (it accumulates gradients)."""
    return target.optimizer is not None and target.optimizer_steps == 0


_NO_STEP = "the step as it is never calls optimizer.step() (it accumulates gradients)"


def _kept_caches(target: Target) -> list[Any]:
    """The configs (Hugging Face's `model.config`) of a model in training whose `use_cache` is on: the KV
    cache that HF's own gradient checkpointing turns off, and advise's checkpointing too."""
    if not target.model.training:
        return []
    configs = {id(config): config for m in target.model.modules() if (config := getattr(m, "config", None)) is not None}
    return [config for config in configs.values() if getattr(config, "use_cache", None) is True]


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any] | None) -> Callable[..., Any]:
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _CheckpointBlocks(Strategy):
    """torch.utils.checkpoint (non-reentrant) around every `every`-th repeated block's forward; with
    `selective`, matmul and attention outputs are kept and only the cheap ops recomputed."""

    family = "checkpoint"

    def __init__(self, every: int = 1, selective: bool = False) -> None:
        self.every, self.selective = every, selective
        self.name = (
            "selective-checkpoint" if selective else "checkpoint-blocks" if every == 1 else f"checkpoint-every-{every}"
        )

    def describe(self, target: Target) -> str:
        blocks = target.blocks
        what = "the blocks" if blocks is None else f"the {len(blocks.modules)} `{blocks.kind}`s"
        cache = ", use_cache off as Hugging Face's checkpointing sets it" if _kept_caches(target) else ""
        if self.selective:
            return f"checkpointing {what}, keeping matmul outputs{cache}"
        every = "" if self.every == 1 else f"every {_ordinal(self.every)} of "
        return f"checkpointing {every}{what}{cache}"

    def skip_reason(self, target: Target) -> str | None:
        if target.blocks is None:
            return "no repeated blocks: no nn.ModuleList or nn.Sequential of two or more modules of one class"
        if len(target.blocks.modules) < 2 * self.every:
            return f"{len(target.blocks.modules)} blocks: too few to checkpoint every {_ordinal(self.every)}"
        return None

    def apply(self, run: Run) -> None:
        assert run.target.blocks is not None
        context = partial(create_selective_checkpoint_contexts, _save_matmuls) if self.selective else None
        for config in _kept_caches(run.target):
            run.patch.set_attr(config, "use_cache", False)
        for index, block in enumerate(run.target.blocks.modules):
            if index % self.every == 0:
                run.patch.set_attr(block, "forward", _checkpointed(block.forward, context))


def _wrapped(call: Callable[[], object], context: Callable[[], AbstractContextManager[Any]]) -> Callable[[], object]:
    def run() -> object:
        with context():
            return call()

    return run


def _autocast_device(target: Target) -> str:
    """The device type whose autocast the step runs under: CUDA's where the tracker predicts a GPU and
    emulates CUDA's autocast on its meta or CPU tensors (`backends/tracker/autocast.py`), else the
    parameters' own."""
    from pytest_gpumem.backends.tracker.autocast import emulating

    return "cuda" if emulating() else target.device.type


class Autocast(Strategy):
    """The step under torch.autocast in bfloat16 but for its backward (torch.autograd.backward and grad
    are wrapped to leave autocast while they run); parameters, gradients and optimizer keep their dtype.
    Where the tracker predicts a GPU (meta, or CUDA's rounding), CUDA's autocast rules."""

    name = "bf16-autocast"
    family = "precision"

    def describe(self, target: Target) -> str:
        rules = " (CUDA's autocast rules)" if _autocast_device(target) != target.device.type else ""
        return f"bf16 autocast of the model's forward{rules}"

    def skip_reason(self, target: Target) -> str | None:
        kind = _autocast_device(target)
        if kind == "meta":
            return "torch.autocast has no meta device type (CUDA's autocast is emulated where a GPU is predicted)"
        if target.param_dtype() in (torch.bfloat16, torch.float16):
            return f"the parameters are already {target.param_dtype()}"
        if kind == "cuda" and kind == target.device.type and not torch.cuda.is_bf16_supported():
            return "this CUDA device does not support bfloat16"
        if kind == target.device.type and not torch.amp.is_autocast_available(kind):
            return f"torch.autocast does not support device type {kind!r}"
        return None

    def apply(self, run: Run) -> None:
        kind = _autocast_device(run.target)
        run.call = _wrapped(run.call, partial(torch.autocast, kind, dtype=torch.bfloat16))
        for name in ("backward", "grad"):  # backward outside autocast, as torch.amp's docs advise
            run.patch.set_attr(torch.autograd, name, _without_autocast(getattr(torch.autograd, name), kind))
        run.dtype = torch.bfloat16


def _without_autocast(function: Callable[..., Any], kind: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        torch.clear_autocast_cache()  # its weight copies die where the forward's autocast would end
        with torch.autocast(kind, enabled=False):
            return function(*args, **kwargs)

    return run


class _FusedStep(Strategy):
    """One optimizer per parameter, stepped from its post-accumulate-grad hook, the gradient freed at
    once (PyTorch tutorial "How to save memory by fusing the optimizer step into the backward pass")."""

    name = "fused-step"
    family = "step"

    def describe(self, target: Target) -> str:
        return "the optimizer step fused into backward"

    def skip_reason(self, target: Target) -> str | None:
        optimizer = target.optimizer
        if optimizer is None:
            return "no optimizer given (optimizer=)"
        if type(optimizer) not in _PER_PARAMETER_OPTIMIZERS:
            kind = type(optimizer).__name__
            return f"{kind} is not one of torch's per-parameter optimizers: its step may couple parameters"
        if _never_steps(target):
            return f"{_NO_STEP}: fused, the optimizer would step in every backward and free the gradients"
        return None

    def apply(self, run: Run) -> None:
        optimizer, shim = run.target.optimizer, run.shim
        assert optimizer is not None and shim is not None
        shim.step_allowed = lambda: False
        singles: dict[int, torch.optim.Optimizer] = {}
        accepted = inspect.signature(type(optimizer).__init__).parameters
        for group in optimizer.param_groups:
            settings = {k: group[k] for k in optimizer.defaults if k in group and k in accepted}
            for p in group["params"]:
                single = type(optimizer)([p], **settings)
                single.state[p] = optimizer.state[p]  # the run's copy of the user's state
                singles[id(p)] = single

        def step_now(param: torch.Tensor) -> None:
            run.keep_grad(param)
            singles[id(param)].step()
            param.grad = None

        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    _post_accumulate_hook(run.patch, p, step_now)


def _post_accumulate_hook(patch: Patch, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    before = param._post_accumulate_grad_hooks
    handle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    def remove() -> None:
        handle.remove()
        if before is None:
            param._post_accumulate_grad_hooks = None

    patch.on_undo(remove)


def _foreach_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The parameter groups that take the foreach (multi-tensor) implementation."""
    from pytest_gpumem.private_torch import takes_foreach

    found = []
    for group in optimizer.param_groups:
        chosen = group.get("foreach")
        if chosen is None and not group.get("fused"):
            chosen = takes_foreach(group["params"])
        if chosen:
            found.append(group)
    return found


class _ForeachOff(Strategy):
    """`foreach=False`: the optimizer's per-tensor loop, whose temporaries are one parameter's size
    instead of all parameters' (see FACTS: optimizers pick their implementation by device)."""

    name = "foreach-off"
    family = "step"

    def describe(self, target: Target) -> str:
        return "the optimizer's per-tensor loop (foreach off)"

    def skip_reason(self, target: Target) -> str | None:
        optimizer = target.optimizer
        if optimizer is None:
            return "no optimizer given (optimizer=)"
        if "foreach" not in optimizer.defaults:
            return f"{type(optimizer).__name__} has no foreach option"
        if not _foreach_groups(optimizer):
            return f"{type(optimizer).__name__} already takes the per-tensor loop on {target.device.type}"
        if _never_steps(target):
            return f"{_NO_STEP}: there is no optimizer step to change"
        return None

    def apply(self, run: Run) -> None:
        assert run.target.optimizer is not None
        for group in _foreach_groups(run.target.optimizer):
            group["foreach"] = False  # the run's copy of the group


class _SaveOnCpu(Strategy):
    """torch.autograd.graph.save_on_cpu: saved activations in pinned host memory until backward."""

    name = "save-on-cpu"
    family = "offload"

    def describe(self, target: Target) -> str:
        return "saved activations kept in host memory (save_on_cpu)"

    def skip_reason(self, target: Target) -> str | None:
        kind = target.device.type
        if kind == "cpu":
            return "on cpu the saved activations are in host memory already"
        if kind == "meta":
            return "meta tensors have no data to copy to host memory"
        return None

    def apply(self, run: Run) -> None:
        pin = torch.cuda.is_available() and run.target.device.type == "cuda"
        run.call = _wrapped(run.call, partial(torch.autograd.graph.save_on_cpu, pin_memory=pin))


def _takes_batch(step: Callable[..., object]) -> bool:
    try:
        parameter = inspect.signature(step).parameters.get(_BATCH_ARGUMENT)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is not inspect.Parameter.empty


class _MicroBatches(Strategy):
    """`k` calls of the step, each on a slice of the batch (`step(batch=slice(...))`), gradients
    accumulated and divided by k before the one real optimizer step: equal to the full batch's for a
    loss that is the mean over the rows it gets."""

    family = "batch"
    order = 0
    keeps_randomness = False  # dropout draws each micro-batch's masks apart

    def __init__(self, count: int) -> None:
        self.count = count
        self.name = f"micro-batch-{count}"

    def describe(self, target: Target) -> str:
        return f"{self.count} micro-batches with gradient accumulation"

    def skip_reason(self, target: Target) -> str | None:
        if not _takes_batch(target.step):
            return f"the step has no optional `{_BATCH_ARGUMENT}` parameter (a slice of the batch rows)"
        if target.batch_size is None:
            return "no batch_size= given (the rows the step's batch has)"
        if target.batch_size % self.count:
            return f"batch_size {target.batch_size} is not a multiple of {self.count}"
        if target.optimizer is None:
            return "no optimizer given (optimizer=): the accumulated gradients need one step"
        if _never_steps(target):
            return f"{_NO_STEP}: micro-batching averages the accumulated gradients in that step"
        return None

    def apply(self, run: Run) -> None:
        shim, size, step = run.shim, run.target.batch_size, run.target.step
        assert shim is not None and size is not None
        count, rows = self.count, size // self.count
        current = [0]

        def last() -> bool:
            return current[0] == count - 1

        shim.step_allowed = last
        shim.zero_allowed = lambda: (current[0] == 0 and shim.calls == 0) or (last() and shim.steps > 0)
        params = run.target.parameters()

        def average() -> None:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(count)

        shim.before_step.append(average)

        def micro() -> object:
            result: object = None
            for index in range(count):
                current[0] = index
                shim.calls = 0
                result = step(**{_BATCH_ARGUMENT: slice(index * rows, (index + 1) * rows)})
            return result

        run.call = micro


class _ChunkedCrossEntropy(Strategy):
    """The `loss=` module's forward(hidden, targets) replaced by a chunked, checkpointed cross-entropy over
    `hidden @ loss.weight.T` (`advise/chunked.py`): full logits never exist at once."""

    name = "chunked-ce"
    family = "loss"

    def describe(self, target: Target) -> str:
        return f"a chunked cross-entropy ({_CE_CHUNKS} chunks)"

    def skip_reason(self, target: Target) -> str | None:
        loss = target.loss
        if loss is None:
            return "no loss= given (a module computing cross-entropy of hidden @ weight.T from (hidden, targets))"
        weight = getattr(loss, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return f"the loss module {type(loss).__name__} has no 2-d weight (vocabulary x width)"
        if getattr(loss, "bias", None) is not None:
            return f"the loss module {type(loss).__name__} has a bias, which the chunked cross-entropy leaves out"
        return None

    def apply(self, run: Run) -> None:
        loss = run.target.loss
        assert loss is not None

        def chunked(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            rows = hidden.reshape(-1, hidden.shape[-1])
            weight = loss.weight
            assert isinstance(weight, torch.Tensor)
            return chunked_cross_entropy(rows, weight, targets.reshape(-1), _CE_CHUNKS)

        run.patch.set_attr(loss, "forward", chunked)


def all_strategies() -> list[Strategy]:
    return [
        _CheckpointBlocks(),
        _CheckpointBlocks(every=_EVERY),
        _CheckpointBlocks(selective=True),
        Autocast(),
        _FusedStep(),
        _ForeachOff(),
        _SaveOnCpu(),
        *(_MicroBatches(k) for k in _MICRO_BATCHES),
        _ChunkedCrossEntropy(),
    ]


_FAMILY_CONFLICTS = {
    "checkpoint": "both wrap the blocks' forward",
    "batch": "both split the batch",
    "step": "both change the optimizer step",
}


def conflict(a: Strategy, b: Strategy) -> str | None:
    """Why `a` and `b` cannot be combined, or None."""
    if a.family == b.family:
        return _FAMILY_CONFLICTS.get(a.family, "both change the same thing")
    if _FusedStep.name in (a.name, b.name) and {a.family, b.family} == {"step", "batch"}:
        return "accumulating micro-batch gradients needs the gradients a fused step frees"
    return None


def ordered(strategies: Iterator[Strategy] | list[Strategy]) -> list[Strategy]:
    return sorted(strategies, key=lambda s: s.order)
