"""Training-step strategies: the Q&A's Net variants, and activation/gradient savers on a deep residual MLP.

Every step is forward (phase "forward"), backward ("backward") and one SGD step without momentum
("step"; in place, so it allocates nothing). What each should cost, derived by hand, is in
reference_losses.bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import pytest
import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pytest_gpumem import autocast_device_type
from reference_losses.bounds import net_expect, net_minimum, oib_minimum, residual_expect, residual_minimum
from reference_losses.models import ModelWorkload, build_net, build_residual, model_loss
from reference_losses.strategy import Outcome, PhaseMeter, Strategy, amp_dtype

Forward = Callable[[ModelWorkload], torch.Tensor]


def _outcome(w: ModelWorkload, loss: torch.Tensor) -> Outcome:
    tensors = {f"param:{n}": p.detach() for n, p in w.model.named_parameters()}
    tensors |= {f"grad:{n}": p.grad.detach() for n, p in w.model.named_parameters() if p.grad is not None}
    return Outcome(loss.detach().float(), tensors)


def _sgd(w: ModelWorkload) -> torch.optim.SGD:
    return torch.optim.SGD(w.model.parameters(), lr=w.lr)


def _standard_step(forward: Forward, clip: bool = False) -> Callable[[PhaseMeter, ModelWorkload], Outcome]:
    def step(meter: PhaseMeter, w: ModelWorkload) -> Outcome:
        optimizer = _sgd(w)
        with meter.phase("forward"):
            loss = forward(w)
        with meter.phase("backward"):
            torch.autograd.backward(loss)
        with meter.phase("step"):
            if clip:
                # Q&A claim (6). A bound that is not reached keeps the outcome equal to plain's; the
                # memory is the same either way (grads are multiplied in place by the clamped factor).
                torch.nn.utils.clip_grad_norm_(w.model.parameters(), max_norm=1e6)
            optimizer.step()
        return _outcome(w, loss)

    return step


# --- Net (the Q&A's model) ----------------------------------------------------------------------------


def plain(w: ModelWorkload) -> torch.Tensor:
    return model_loss(w.model(w.inputs), w.target)


def checkpoint_layer(w: ModelWorkload) -> torch.Tensor:
    """Q&A claim (3): checkpoint layer2. Its only saved activation is its input h1, which checkpoint
    must keep anyway to recompute it, so nothing is saved (and the output is recomputed in backward)."""
    net = w.net
    out = checkpoint(net.layer2, net.layer1(w.inputs), use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    return model_loss(out, w.target)


def amp_step(meter: PhaseMeter, w: ModelWorkload) -> Outcome:
    """Q&A claim (4): autocast (bf16 on CPU, fp16 + GradScaler on CUDA). Parameters, their gradients
    and the optimizer stay fp32; autocast adds half-precision copies of the weights for the step. Where
    the measurement predicts a GPU (the tracker on meta, or --gpumem-round=cuda), CUDA's autocast rules
    apply (`pytest_gpumem.autocast_device_type`), and the report says so."""
    device = w.inputs.device
    dtype = amp_dtype(device)
    rules = autocast_device_type(device)
    if rules == "meta":
        pytest.skip(f"amp cannot run on the meta device with the CPU's code paths: {AMP_NO_META}")
    info = getattr(meter, "info", None)
    if isinstance(info, dict):
        info[AUTOCAST_KEY] = _rules_text(rules, device)
    scaler = torch.amp.GradScaler(rules) if dtype == torch.float16 else None
    optimizer = _sgd(w)
    with meter.phase("forward"), torch.autocast(rules, dtype=dtype):
        loss = plain(w)
    with meter.phase("backward"):
        torch.autograd.backward(loss if scaler is None else scaler.scale(loss))
    with meter.phase("step"):
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)  # unscales the gradients in place first
            scaler.update()
    return _outcome(w, loss)


AMP_NO_META = (
    "torch.autocast has no meta device type (RuntimeError: unsupported autocast device_type 'meta'), and "
    "CPU autocast leaves meta tensors in fp32 (with a GPU's code paths, the default, CUDA's rules apply)"
)
AUTOCAST_KEY = "autocast"
"""Where amp_step says in `gpumem.info` which device's autocast rules it ran under (the report shows it)."""


def _rules_text(rules: str, device: torch.device) -> str:
    if rules == device.type:
        return f"autocast under {rules.upper()}'s rules"
    return f"autocast under CUDA's rules (torch {torch.__version__}'s CUDA op lists, on {device.type} tensors)"


def optimizer_in_backward_step(meter: PhaseMeter, w: ModelWorkload) -> Outcome:
    """Step each parameter from its post-accumulate-grad hook and drop its gradient at once, so
    gradients never coexist. Source: PyTorch tutorial "How to save memory by fusing the optimizer step
    into the backward pass" (pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial);
    LOMO (Lv et al., 2023, arXiv:2306.09782)."""
    optimizers: dict[torch.Tensor, torch.optim.SGD] = {p: torch.optim.SGD([p], lr=w.lr) for p in w.model.parameters()}

    def hook(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in w.model.parameters()]  # type: ignore[no-untyped-call]
    try:
        with meter.phase("forward"):
            loss = plain(w)
        with meter.phase("backward"):
            torch.autograd.backward(loss)
    finally:
        for handle in handles:
            handle.remove()
    return _outcome(w, loss)


# --- deep residual MLP --------------------------------------------------------------------------------


def residual_plain(w: ModelWorkload, batch: int | None = None) -> torch.Tensor:
    x = w.inputs
    for block in w.residual.blocks:
        x = block(x)
    return model_loss(x, w.target, batch)


def _checkpointed(w: ModelWorkload, context_fn: Callable[[], Any] | None = None) -> torch.Tensor:
    x = w.inputs
    kwargs: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    for block in w.residual.blocks:
        x = checkpoint(block, x, use_reentrant=False, **kwargs)
    return model_loss(x, w.target)


def checkpoint_blocks(w: ModelWorkload) -> torch.Tensor:
    """Checkpoint every block: keep only block inputs, recompute one block at a time in backward.
    Source: Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016, arXiv:1604.06174);
    torch.utils.checkpoint."""
    return _checkpointed(w)


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(w: ModelWorkload) -> torch.Tensor:
    """Checkpoint blocks but keep matmul outputs (expensive to recompute), recomputing LayerNorm and
    GELU. Source: torch.utils.checkpoint.create_selective_checkpoint_contexts docs; Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models" (2022, arXiv:2205.05198)."""
    return _checkpointed(w, partial(create_selective_checkpoint_contexts, _save_matmuls))


def grad_accumulation_step(meter: PhaseMeter, w: ModelWorkload, micro_batches: int = 4) -> Outcome:
    """k micro-batches, each loss divided by the full batch size (not the micro-batch's), so the
    accumulated gradient equals the full-batch one; activations shrink k-fold. Source: PyTorch docs
    (`torch.autograd.backward(loss)` accumulates into .grad); Hugging Face Accelerate's gradient accumulation guide."""
    optimizer = _sgd(w)
    total = torch.zeros((), device=w.inputs.device)
    parts = zip(w.inputs.chunk(micro_batches), w.target.chunk(micro_batches), strict=True)
    for inputs, target in parts:
        with meter.phase("forward"):
            loss = residual_plain(ModelWorkload(w.model, inputs, target), batch=w.batch)
        with meter.phase("backward"):
            torch.autograd.backward(loss)
        total += loss.detach()
    with meter.phase("step"):
        optimizer.step()
    return _outcome(w, total)


def _storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage, shared by its views: torch keeps one Python object per live storage.
    Not `data_ptr()`: on the meta device every storage's data pointer is 0."""
    return id(t.untyped_storage())


def _protected(w: ModelWorkload) -> set[int]:
    """Storages that exist before the step: copying them would add memory, not save it."""
    tensors: Iterator[torch.Tensor] = iter([*w.model.parameters(), w.inputs, w.target])
    return {_storage_id(t) for t in tensors}


def compress_activations(w: ModelWorkload) -> torch.Tensor:
    """Store saved fp32 activations as bf16 through saved-tensor hooks; backward gets fp32 copies.
    Source: PyTorch tutorial "Hooks for autograd saved tensors"
    (pytorch.org/tutorials/intermediate/autograd_saved_tensors_hooks_tutorial); ActNN (Chen et al.,
    2021, arXiv:2104.14129) for compressed activations in general."""
    keep = _protected(w)

    def pack(t: torch.Tensor) -> Any:
        if t.dtype != torch.float32 or _storage_id(t) in keep:
            return t
        return (t.to(torch.bfloat16),)

    def unpack(packed: Any) -> torch.Tensor:
        return packed[0].float() if isinstance(packed, tuple) else packed  # type: ignore[no-any-return]

    with saved_tensors_hooks(pack, unpack):
        return residual_plain(w)


def offload_activations(w: ModelWorkload) -> torch.Tensor:
    """Move saved tensors to pinned host memory during forward, back in backward. CUDA only.
    Source: torch.autograd.graph.save_on_cpu docs. Note it also copies saved *parameters* (each Linear
    saves its weight), so backward brings weight copies back to the device."""
    if w.inputs.device.type != "cuda":
        pytest.skip("offload_activations needs a CUDA device (pinned host memory)")
    context: AbstractContextManager[Any] = save_on_cpu(pin_memory=True)
    with context:
        return residual_plain(w)


def _training(
    name: str,
    workload: str,
    step: Callable[[PhaseMeter, ModelWorkload], Outcome],
    precision: Callable[[torch.device], torch.dtype | None] = lambda device: None,
    needs_cuda: bool = False,
    no_meta: str | None = None,
) -> Strategy:
    net = workload == "net"
    return Strategy(
        name=name,
        workload=workload,
        reference="plain" if net else "residual_plain",
        build=build_net if net else build_residual,
        step=step,
        minimum=(oib_minimum if name == "optimizer_in_backward" else net_minimum) if net else residual_minimum,
        expect=net_expect(name) if net else residual_expect(name),
        precision=precision,
        needs_cuda=needs_cuda,
        no_meta=no_meta,
    )


TRAINING_STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        _training("plain", "net", _standard_step(plain)),
        _training("checkpoint_layer", "net", _standard_step(checkpoint_layer)),
        _training("amp", "net", amp_step, precision=amp_dtype),
        _training("clip_grad", "net", _standard_step(plain, clip=True)),
        _training("optimizer_in_backward", "net", optimizer_in_backward_step),
        _training("residual_plain", "residual", _standard_step(residual_plain)),
        _training("checkpoint_blocks", "residual", _standard_step(checkpoint_blocks)),
        _training("selective_checkpoint", "residual", _standard_step(selective_checkpoint)),
        _training("grad_accumulation", "residual", grad_accumulation_step),
        _training(
            "compress_activations",
            "residual",
            _standard_step(compress_activations),
            precision=lambda device: torch.bfloat16,
        ),
        _training("offload_activations", "residual", _standard_step(offload_activations), needs_cuda=True),
    )
}
