"""Training-step strategies: the Q&A's Net variants, and activation/gradient savers on a deep residual MLP.

Every step is forward (phase "forward"), backward ("backward") and one SGD step without momentum
("step"; in place, so it allocates nothing). Byte formulas: P = fp32 parameter bytes, A = activation
bytes plain autograd saves, B = batch rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from reference_losses.models import (
    FP32,
    ModelWorkload,
    Net,
    ResidualMLP,
    ResidualSizes,
    build_net,
    build_residual,
    model_loss,
)
from reference_losses.strategy import Expectation, Outcome, PhaseMeter, Strategy, amp_dtype

SMALL = 256 * 1024  # scalars, biases, LayerNorm statistics
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


def _net(w: ModelWorkload) -> Net:
    assert isinstance(w.model, Net)
    return w.model


def plain(w: ModelWorkload) -> torch.Tensor:
    return model_loss(w.model(w.inputs), w.target)


def checkpoint_layer(w: ModelWorkload) -> torch.Tensor:
    """Q&A claim (3): checkpoint layer2. Its only saved activation is its input h1, which checkpoint
    must keep anyway to recompute it, so nothing is saved (and the output is recomputed in backward)."""
    net = _net(w)
    out = checkpoint(net.layer2, net.layer1(w.inputs), use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    return model_loss(out, w.target)


def amp_step(meter: PhaseMeter, w: ModelWorkload) -> Outcome:
    """Q&A claim (4): autocast (bf16 on CPU, fp16 + GradScaler on CUDA). Parameters, their gradients
    and the optimizer stay fp32; autocast adds half-precision copies of the weights for the step."""
    device = w.inputs.device
    dtype = amp_dtype(device)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    optimizer = _sgd(w)
    with meter.phase("forward"), torch.autocast(device.type, dtype=dtype):
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
    "CPU autocast leaves meta tensors in fp32"
)


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


def net_activation_bytes(w: ModelWorkload) -> int:
    """A: what plain autograd saves in Net is h1 (B*2048*4, input of layer2). x and the target exist
    before the step; out is not saved, because mul saves `out` only when the target needs a gradient."""
    return FP32 * w.batch * 2048


def net_minimum(w: ModelWorkload) -> int:
    """All parameter gradients (P) exist when backward ends; h1 could be recomputed, so it is not part
    of the minimum."""
    return w.param_bytes()


def oib_minimum(w: ModelWorkload) -> int:
    """With the step inside backward, only one gradient must exist at a time: the largest."""
    return w.largest_param_bytes()


@dataclass(frozen=True)
class NetBytes:
    """The byte sizes the Net derivations use. Activations scale with the batch B: A (h1, B*2048*4),
    out (B*1024*4) and x_half (the bf16/fp16 input copy under autocast, B*1024*2). Parameters and their
    gradients do not: P (all parameters) and W2 (layer2's weight, the size of dW2)."""

    acts: int
    out: int
    x_half: int
    params: int
    w1: int
    w2: int

    @classmethod
    def of(cls, w: ModelWorkload) -> NetBytes:
        net = _net(w)
        return cls(
            acts=net_activation_bytes(w),
            out=FP32 * w.batch * net.layer2.out_features,
            x_half=2 * w.inputs.numel(),
            params=w.param_bytes(),
            w1=FP32 * net.layer1.weight.numel(),
            w2=FP32 * net.layer2.weight.numel(),
        )


def net_backward_peak(b: NetBytes) -> int:
    """Plain backward, above what the forward kept (h1). Layer2's backward makes dout (out), dW2 and
    dh1 (A) while h1 is still saved: out + W2 + A. It then frees dout and h1, and layer1's backward
    adds dW1: dW2 + dh1 + dW1 - h1 = P. Which one is the peak depends on the batch: P at scale 1
    (16 MiB vs 14 MiB), out + W2 + A from scale 2 on (20 MiB vs 16 MiB)."""
    return max(b.params, b.out + b.w2 + b.acts)


def amp_forward_peak(b: NetBytes) -> int:
    """autocast caches a half copy of each weight (P/2 in all) for the whole forward and casts x;
    h1 and out are half precision; out * target promotes to fp32 (out)."""
    return b.params // 2 + b.x_half + b.acts // 2 + b.out // 2 + b.out


def amp_kept(b: NetBytes) -> int:
    """Saved for backward: half x (layer1's dW1), half h1 and half W2 (layer2's dW2 and dh1); layer1
    keeps no weight, because x needs no gradient."""
    return b.x_half + b.acts // 2 + b.w2 // 2


def amp_backward_peak(b: NetBytes) -> int:
    """Backward, counted from before the forward (so it includes what the forward kept). Three
    candidates, the largest is the peak: mul's backward makes dout in fp32 and casts it to half
    (kept + 1.5 out); layer2's backward makes half dW2 and dh1 next to half dout (kept + out/2 +
    W2/2 + A/2); the last cast of a half weight gradient to fp32 happens when all other fp32
    weight gradients exist (W1 + W2 + W1/2; the bias gradients, a few KiB, are left to SMALL, as they
    may still be half then). The last dominates at small batches, the second at large ones."""
    kept = amp_kept(b)
    return max(kept + b.out + b.out // 2, kept + b.out // 2 + b.w2 // 2 + b.acts // 2, b.w1 + b.w2 + b.w1 // 2)


def _plain_net_expect(b: NetBytes) -> list[Expectation]:
    backward = net_backward_peak(b)
    fwd = b.acts + 2 * b.out
    return [
        Expectation("forward", fwd, fwd + SMALL, "h1 + out + out * target"),
        Expectation("forward", b.acts, b.acts + SMALL, "keeps h1 only (also when layer2 is checkpointed)", net=True),
        Expectation("backward", backward, backward + SMALL, "max(P, out + W2 + A): see net_backward_peak"),
        Expectation("step", 0, SMALL, "SGD (and clipping) work in place"),
        Expectation("total", b.acts + backward, b.acts + backward + SMALL, "A + the backward peak"),
    ]


def _amp_expect(b: NetBytes) -> list[Expectation]:
    fwd, kept, peak = amp_forward_peak(b), amp_kept(b), amp_backward_peak(b)
    total = max(fwd, peak)
    return [
        Expectation("forward", fwd, fwd + SMALL, "P/2 weight copies + half x, h1, out + fp32 product"),
        Expectation("forward", kept, kept + SMALL, "half x, h1 and W2", net=True),
        Expectation("backward", peak - kept, peak - kept + SMALL, "see amp_backward_peak"),
        Expectation("total", total, total + SMALL, "the larger of the forward and backward peaks"),
    ]


def _oib_expect(b: NetBytes) -> list[Expectation]:
    # layer2's backward makes dout, dW2 and dh1 before its hook can step and free dW2.
    peak = b.out + b.w2 + b.acts
    return [
        Expectation("backward", peak, peak + SMALL, "dout + dW2 + dh1: never two weight gradients"),
        Expectation("total", b.acts + peak, b.acts + peak + SMALL, "A + the backward peak"),
    ]


_NET_EXPECT: dict[str, Callable[[NetBytes], list[Expectation]]] = {
    "plain": _plain_net_expect,
    "checkpoint_layer": _plain_net_expect,
    "clip_grad": _plain_net_expect,
    "amp": _amp_expect,
    "optimizer_in_backward": _oib_expect,
}


def _net_expect(name: str) -> Callable[[ModelWorkload], list[Expectation]]:
    """Net's bounds, from NetBytes of the workload as built (so they follow --gpumem-scale)."""
    derive = _NET_EXPECT[name]

    def expect(w: ModelWorkload) -> list[Expectation]:
        return derive(NetBytes.of(w))

    return expect


# --- deep residual MLP --------------------------------------------------------------------------------


def _blocks(w: ModelWorkload) -> ResidualMLP:
    assert isinstance(w.model, ResidualMLP)
    return w.model


def residual_plain(w: ModelWorkload, batch: int | None = None) -> torch.Tensor:
    x = w.inputs
    for block in _blocks(w).blocks:
        x = block(x)
    return model_loss(x, w.target, batch)


def _checkpointed(w: ModelWorkload, context_fn: Callable[[], Any] | None = None) -> torch.Tensor:
    x = w.inputs
    kwargs: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    for block in _blocks(w).blocks:
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
    """Identity of a tensor's storage, shared by its views. Not `data_ptr()`: on the meta device every
    storage's data pointer is 0."""
    return int(t.untyped_storage()._cdata)


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


def residual_activation_bytes(w: ModelWorkload) -> int:
    """A: L blocks' saved bytes (ResidualSizes.block_saved_bytes) minus block 0's input, which exists
    before the step. The final output is not saved (the target needs no gradient)."""
    sizes = _sizes(w)
    return sizes.depth * sizes.block_saved_bytes() - FP32 * sizes.batch * sizes.width


def _sizes(w: ModelWorkload) -> ResidualSizes:
    model = _blocks(w)
    return ResidualSizes(batch=w.batch, depth=len(model.blocks), width=model.width, hidden=model.hidden)


def residual_minimum(w: ModelWorkload) -> int:
    """All parameter gradients (P) exist when backward ends; activations can always be recomputed."""
    return w.param_bytes()


def _residual_saved(name: str, w: ModelWorkload) -> tuple[int, str]:
    s = _sizes(w)
    row, hid = FP32 * s.batch * s.width, FP32 * s.batch * s.hidden
    acts = residual_activation_bytes(w)
    return {
        "residual_plain": (acts, "A"),
        "checkpoint_blocks": ((s.depth - 1) * row, "block inputs only: (L-1)*B*D*4"),
        "selective_checkpoint": (s.depth * (2 * row + hid) - row, "block input + fc1 and fc2 outputs"),
        "grad_accumulation": (acts // 4, "A/k, k = 4 micro-batches"),
        "compress_activations": (acts // 2, "A/2: bf16 copies"),
        "offload_activations": (0, "everything saved went to host memory"),
    }[name]


def _residual_expect(name: str) -> Callable[[ModelWorkload], list[Expectation]]:
    """What the forward keeps is exact; the total is bounded by what it keeps, plus P of gradients, plus
    one block's saved bytes (recomputed, or the fp32 copies unpacked, for the block being processed),
    plus the gradient of one hidden activation (B*H*4: fc2's backward makes d(gelu output) while that
    block's saved tensors are alive). The last term is hidden under P at scale 1 (not all of P exists
    then) and is what exceeds "kept + P + one block" from scale 16 on (checkpoint_blocks; 64 for
    compress_activations, whose excess is about B*D*4), as a meta run at --gpumem-scale=256 shows."""

    def expect(w: ModelWorkload) -> list[Expectation]:
        kept, why = _residual_saved(name, w)
        sizes = _sizes(w)
        slack = SMALL if name != "offload_activations" else sizes.depth * SMALL
        hidden_grad = FP32 * sizes.batch * sizes.hidden
        high = kept + w.param_bytes() + sizes.block_saved_bytes() + hidden_grad + SMALL
        found = [Expectation("forward", kept, kept + slack, why, net=True)]
        if name != "residual_plain":
            found.append(Expectation("total", w.param_bytes(), high, "kept + P + one block + one B*H gradient"))
        return found

    return expect


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
        expect=_net_expect(name) if net else _residual_expect(name),
        precision=precision,
        needs_cuda=needs_cuda,
        no_meta=no_meta,
    )


TRAINING_STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        _training("plain", "net", _standard_step(plain)),
        _training("checkpoint_layer", "net", _standard_step(checkpoint_layer)),
        _training("amp", "net", amp_step, precision=amp_dtype, no_meta=AMP_NO_META),
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
