"""Compiled steps, eager and compiled, as the tracker measures them: on the CPU without rounding (the CPU's
Inductor plan, exact bytes), and where a card is predicted (meta, and the CPU with --gpumem-round=cuda).

    python benchmarks/compiled_steps.py [--only NAME] [--modes cpu,cuda,meta]

Each workload's model and input are made before the measurement; the step is measured twice and the
second is given, after `zero_grad()` (compiled, the optimizer's state made: a training loop's step). Per mode and
kind: forward peak, what the forward leaves held (saved for backward, the loss), backward peak, the
optimizer step's peak where there is one, and the call's peak, in bytes allocated from the start.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cuda_allocator_model.sizes import format_size
from pytest_gpumem.backends.tracker.backend import TrackerBackend


class Mlp(nn.Sequential):
    """The issue's MLP: Linear(1024, 4096), GELU, Linear(4096, 1024)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))


class Stack(nn.Sequential):
    """Eight Linear(1024, 1024) + ReLU."""

    def __init__(self) -> None:
        super().__init__(*(layer for _ in range(8) for layer in (nn.Linear(1024, 1024), nn.ReLU())))


class Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


class Gpt2(nn.Module):
    """GPT-2 small's widths (768, 12 heads, 50,257 tokens, tied head) with `layers` blocks."""

    def __init__(self, layers: int = 2, width: int = 768, vocab: int = 50257, context: int = 1024) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, 12) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


@dataclass(frozen=True)
class Workload:
    make: Callable[[], nn.Module]
    batch: Callable[[torch.device], torch.Tensor]
    loss: Callable[[Callable[..., torch.Tensor], torch.Tensor], torch.Tensor]
    optimizer: bool = False


def _squared(model: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


WORKLOADS = {
    "mlp": Workload(Mlp, lambda d: torch.randn(512, 1024, device=d), _squared),
    "stack8": Workload(Stack, lambda d: torch.randn(512, 1024, device=d), _squared),
    "gpt2": Workload(Gpt2, lambda d: torch.randint(0, 50257, (2, 128), device=d), lambda m, x: m(x), True),
}
MODES = {"cpu": ("cpu", "none"), "cuda": ("cpu", "cuda"), "meta": ("meta", "cuda")}


def measure(workload: Workload, mode: str, compiled: bool) -> dict[str, int] | str:
    device, rounding = MODES[mode]
    torch.manual_seed(0)
    model = workload.make().to(device)
    x = workload.batch(torch.device(device))
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True) if workload.optimizer else None
    try:
        _step(workload, run, x, optimizer, TrackerBackend(rounding, device=device))  # compiled, state made
        model.zero_grad()  # as a training loop does after its step: backward makes the gradients
        return _step(workload, run, x, optimizer, TrackerBackend(rounding, device=device))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[1][:80]}"


def _step(
    workload: Workload,
    run: Callable[..., torch.Tensor],
    x: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
    backend: TrackerBackend,
) -> dict[str, int]:
    backend.start()
    try:
        loss = workload.loss(run, x)
        figures = {"forward": backend.peak().allocated, "held": backend.current().allocated}
        backend.reset_peak()
        loss.backward()  # type: ignore[no-untyped-call]
        figures["backward"] = backend.peak().allocated
        if optimizer is not None:
            backend.reset_peak()
            optimizer.step()
            figures["step"] = backend.peak().allocated
        figures["call"] = max(figures.values())
    finally:
        backend.stop()
    notes = backend.notes()
    if notes and notes[0].startswith("compiled: ran eagerly"):
        figures["ran eagerly (not a bound)"] = 1
    return figures


def _text(figures: dict[str, int] | str) -> str:
    if isinstance(figures, str):
        return figures
    return "  ".join(f"{name} {format_size(size):>10}" if size > 1 else name for name, size in figures.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    parser.add_argument("--modes", default="cpu,cuda,meta")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(WORKLOADS)
    for name in names:
        for mode in args.modes.split(","):
            for compiled in (False, True):
                figures = measure(WORKLOADS[name], mode, compiled)
                kind = "compiled" if compiled else "eager"
                print(f"{name:7} {mode:5} {kind:8} {_text(figures)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
