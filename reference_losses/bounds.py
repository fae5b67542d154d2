"""The hand-derived bounds of each training strategy (reference_losses.training): what its forward keeps,
each phase's peak and the least any strategy could need, as formulas of the workload's sizes.

Byte formulas: P = fp32 parameter bytes, A = activation bytes plain autograd saves, B = batch rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reference_losses.models import FP32, ModelWorkload, ResidualSizes
from reference_losses.strategy import Expectation

SMALL = 256 * 1024  # scalars, biases, LayerNorm statistics


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
        net = w.net
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


def net_expect(name: str) -> Callable[[ModelWorkload], list[Expectation]]:
    """Net's bounds, from NetBytes of the workload as built (so they follow --gpumem-scale)."""
    derive = _NET_EXPECT[name]

    def expect(w: ModelWorkload) -> list[Expectation]:
        return derive(NetBytes.of(w))

    return expect


# --- deep residual MLP --------------------------------------------------------------------------------


def residual_activation_bytes(w: ModelWorkload) -> int:
    """A: L blocks' saved bytes (ResidualSizes.block_saved_bytes) minus block 0's input, which exists
    before the step. The final output is not saved (the target needs no gradient)."""
    sizes = _sizes(w)
    return sizes.depth * sizes.block_saved_bytes() - FP32 * sizes.batch * sizes.width


def _sizes(w: ModelWorkload) -> ResidualSizes:
    model = w.residual
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


def residual_expect(name: str) -> Callable[[ModelWorkload], list[Expectation]]:
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
