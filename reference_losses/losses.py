"""Loss strategies: the Q&A's `sum(x * y)` variants, and cross-entropy over a large vocabulary.

Byte formulas use N = numel of x (product workload), L = B*V*4 bytes of full fp32 logits and
k = number of chunks (LM head workload). SMALL covers scalars (loss, grad seed, reductions).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from pytest_gpumem import chunked_cross_entropy
from reference_losses.models import FP32, LMHeadWorkload, ProductWorkload, build_lm_head, build_product
from reference_losses.strategy import Expectation, Outcome, PhaseMeter, Strategy, detach_grads

SMALL = 64 * 1024

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- sum(x * y) -------------------------------------------------------------------------------------


def naive_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The Q&A's loss. `x * y` is a 4N-byte transient; mul saves x and y, which exist anyway."""
    return torch.sum(x * y)


def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Q&A claim (1): no intermediate product (flatten of a contiguous tensor is a view)."""
    return torch.dot(x.flatten(), y.flatten())


def einsum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Q&A claim (1), einsum form: torch lowers a full contraction of two operands to bmm on views."""
    return torch.einsum("...,...->", x, y)


def checkpoint_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Q&A claim (2): checkpoint the loss. It keeps its inputs (already alive) and recomputes x * y."""
    out = checkpoint(naive_sum, x, y, use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    return out


def manual_cleanup(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Q&A claim (5): `del` the product and empty the CUDA cache. The product dies at the same point
    without `del`; empty_cache only returns cached, unused blocks (reserved memory)."""
    product = x * y
    loss = product.sum()
    del product
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return loss


def _product_step(loss_fn: LossFn) -> Callable[[PhaseMeter, ProductWorkload], Outcome]:
    def step(meter: PhaseMeter, w: ProductWorkload) -> Outcome:
        with meter.phase("forward"):
            loss = loss_fn(w.x, w.y)
        with meter.phase("backward"):
            torch.autograd.backward(loss)
        return Outcome(loss.detach(), detach_grads({"x": w.x, "y": w.y}))

    return step


def product_minimum(w: ProductWorkload) -> int:
    """Both gradients (2 * 4N) exist when backward ends; nothing else must be kept (x, y exist)."""
    return 2 * FP32 * w.numel


def _product_expect(forward_transient: int) -> Callable[[ProductWorkload], list[Expectation]]:
    """Backward of every variant makes exactly the two 4N gradients (dx = g*y, dy = g*x), so backward
    and total peaks are 8N whatever the forward does; only the forward transient differs."""

    def expect(w: ProductWorkload) -> list[Expectation]:
        n4 = FP32 * w.numel
        fwd = forward_transient * n4
        return [
            Expectation("forward", fwd, fwd + SMALL, f"{forward_transient} x 4N product transient"),
            Expectation("backward", 2 * n4, 2 * n4 + SMALL, "the two 4N gradients"),
            Expectation("total", 2 * n4, 2 * n4 + SMALL, "set by the gradients, not the forward"),
        ]

    return expect


def _product_strategy(name: str, loss_fn: LossFn, forward_transient: int) -> Strategy:
    return Strategy(
        name=name,
        workload="product",
        reference="naive_sum",
        build=build_product,
        step=_product_step(loss_fn),
        minimum=product_minimum,
        expect=_product_expect(forward_transient),
    )


# --- cross-entropy over a large vocabulary ------------------------------------------------------------


def full_ce(w: LMHeadWorkload) -> torch.Tensor:
    """Naive: B x V logits (L bytes) and their log-softmax (L bytes, saved for backward) coexist."""
    return F.cross_entropy(w.hidden @ w.weight.T, w.targets)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(hidden @ weight.T, targets, reduction="sum")


def chunked_ce(w: LMHeadWorkload) -> torch.Tensor:
    """Cross-entropy of row chunks summed, so full logits never exist at once. Idea: torchtune's
    `CEWithChunkedOutputLoss` and Liger-Kernel's fused linear cross-entropy. Without checkpointing,
    each chunk's log-softmax is still saved: together they are L bytes again."""
    parts = zip(w.hidden.chunk(w.chunks), w.targets.chunk(w.chunks), strict=True)
    total = sum((_chunk_loss(h, w.weight, t) for h, t in parts), torch.zeros((), device=w.hidden.device))
    return total / w.hidden.shape[0]


def chunked_ce_checkpoint(w: LMHeadWorkload) -> torch.Tensor:
    """chunked_ce with each chunk under torch.utils.checkpoint: the plugin's own
    `pytest_gpumem.chunked_cross_entropy`, which `gpumem.advise`'s `chunked-ce` applies, so this report
    and advise measure one function."""
    return chunked_cross_entropy(w.hidden, w.weight, w.targets, w.chunks)


def _lm_step(loss_fn: Callable[[LMHeadWorkload], torch.Tensor]) -> Callable[[PhaseMeter, LMHeadWorkload], Outcome]:
    def step(meter: PhaseMeter, w: LMHeadWorkload) -> Outcome:
        with meter.phase("forward"):
            loss = loss_fn(w)
        with meter.phase("backward"):
            torch.autograd.backward(loss)
        return Outcome(loss.detach(), detach_grads({"hidden": w.hidden, "weight": w.weight}))

    return step


def lm_minimum(w: LMHeadWorkload) -> int:
    """The gradients of hidden (B*D*4) and weight (V*D*4), plus one chunk's logits gradient (L/k):
    the weight gradient is a sum over rows of (dlogits row) x (hidden row), so some block of dlogits
    must exist; with k chunks the smallest block considered here is L/k."""
    return w.grad_bytes() + w.chunk_logits_bytes


def full_ce_total(w: LMHeadWorkload) -> int:
    """full_ce's peak over the whole step. Backward first makes dlogprobs and dlogits (L each) while the
    log-softmax (L) is kept: 3L. It then frees the log-softmax and dlogprobs, and the matmul's backward
    makes the gradients of hidden and weight from dlogits: L + grads. The logits scale with the batch,
    the weight gradient (V*D*4, 16 MiB) does not: 3L is the peak at scale 1 (96 MiB vs 48.5 MiB),
    L + grads at scale 0.25 (24.1 MiB vs 24 MiB)."""
    big = w.logits_bytes
    return max(3 * big, big + w.grad_bytes())


def chunked_checkpoint_total(w: LMHeadWorkload) -> int:
    """chunked_ce_checkpoint's peak over the whole step, the larger of two moments of its backward:
    autograd's first sum of two chunks' weight gradients, out of place (the first + the second + their
    sum), while two chunks' hidden gradients exist: 3 * V*D*4 + 2/k * B*D*4 (the later sums add in place
    into it, as torch does without a dispatch mode); or recomputing one chunk, whose backward holds its
    log-softmax, dlogprobs and dlogits (L/k each) while the other k-1 chunks' hidden gradients (kept for
    the chunk op's backward) and the running weight gradient exist: 3L/k + (k-1)/k * B*D*4 + V*D*4. The
    weight gradients dominate at scales up to 2, the chunk's logits from scale 4 on (at 256 the second
    is 3.1 GiB, the first 80 MiB)."""
    weight = FP32 * w.weight.numel()
    hidden = FP32 * w.hidden.numel()
    return max(3 * weight + 2 * hidden // w.chunks, 3 * w.chunk_logits_bytes + hidden - hidden // w.chunks + weight)


def _lm_expect(name: str) -> Callable[[LMHeadWorkload], list[Expectation]]:
    """full_ce: forward L (logits) + L (log-softmax, kept); backward adds dlogprobs and dlogits (L
        each) while the log-softmax is kept: total 3L. chunked_ce: forward keeps k chunk log-softmaxes (L),
        peaking with the last chunk's logits; its backward then sums weight gradients as below, so its total
    is below full_ce's only while L dominates V*D*4 (true at scale 1, false at 0.5). chunked_ce_checkpoint
    keeps nothing;
        its backward recomputes one chunk at a time, and autograd's first sum of two chunks' weight
        gradients is out of place (3 weight-sized buffers; the later sums add in place), so the total is
        3 * V*D*4 + 2/k of grad(hidden) at scale 1: the weight gradient, not the logits, becomes the
        peak; from scale 4 on one recomputed chunk's 3L/k is (see chunked_checkpoint_total)."""

    def expect(w: LMHeadWorkload) -> list[Expectation]:
        big, part, grads = w.logits_bytes, w.chunk_logits_bytes, w.grad_bytes()
        weight = FP32 * w.weight.numel()
        full_total = full_ce_total(w)
        found = {
            "full_ce": [
                Expectation("forward", 2 * big, 2 * big + SMALL, "logits + log-softmax, L each"),
                Expectation("total", full_total, full_total + SMALL, "max(3L, L + grads): see full_ce_total"),
            ],
            "chunked_ce": [
                Expectation("forward", big + part, big + part + SMALL, "k chunk log-softmaxes + last logits"),
                Expectation("forward", big, big + SMALL, "k chunk log-softmaxes: L again", net=True),
                Expectation(
                    "total", big, big + grads + 2 * weight + 2 * part + SMALL, "kept L + chunk_checkpoint's total"
                ),
            ],
            "chunked_ce_checkpoint": [
                Expectation("forward", 2 * part, 2 * part + SMALL, "one chunk's logits + log-softmax"),
                Expectation("forward", 0, SMALL, "keeps nothing but scalars", net=True),
                Expectation(
                    "total",
                    chunked_checkpoint_total(w),
                    chunked_checkpoint_total(w) + SMALL,
                    "max(3 weight-gradient buffers, one chunk's 3L/k): see chunked_checkpoint_total",
                ),
            ],
        }
        return found[name]

    return expect


def _lm_strategy(name: str, loss_fn: Callable[[LMHeadWorkload], torch.Tensor]) -> Strategy:
    return Strategy(
        name=name,
        workload="lm_head",
        reference="full_ce",
        build=build_lm_head,
        step=_lm_step(loss_fn),
        minimum=lm_minimum,
        expect=_lm_expect(name),
    )


LOSS_STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        _product_strategy("naive_sum", naive_sum, 1),
        _product_strategy("dot", dot, 0),
        _product_strategy("einsum", einsum, 0),
        _product_strategy("checkpoint_loss", checkpoint_loss, 1),
        _product_strategy("manual_cleanup", manual_cleanup, 1),
        _lm_strategy("full_ce", full_ce),
        _lm_strategy("chunked_ce", chunked_ce),
        _lm_strategy("chunked_ce_checkpoint", chunked_ce_checkpoint),
    )
}
