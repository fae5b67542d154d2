"""A cross-entropy over `hidden @ weight.T` whose full logits never exist at once: the `chunked-ce` strategy
of `gpumem.advise`, and the reference suite's `chunked_ce_checkpoint` (both use this one function, so the
reference report and advise cannot disagree)."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy"]


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(hidden @ weight.T, targets, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int = 8
) -> torch.Tensor:
    """The mean cross-entropy of `hidden @ weight.T` (rows x vocabulary) against `targets`, computed in
    `chunks` row chunks, each under torch.utils.checkpoint: only the chunk's inputs (views of `hidden`, the
    weight) are kept and its logits are recomputed in backward, one chunk at a time.

    Idea: "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al., 2024, arXiv:2411.09009)
    never materializes logits; this is its plain-PyTorch approximation."""
    total = torch.zeros((), device=hidden.device)
    for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True):
        part = checkpoint(_chunk_loss, h, weight, t, use_reentrant=False)
        assert isinstance(part, torch.Tensor)
        total = total + part
    return total / hidden.shape[0]
