"""gpumem.advise on real-sized models: a GPT-2-style model on the tracker (cpu), an 8-block MLP and a 7B
decoder on meta.

transformers is not a dependency: a GPT-2-style model (learned positions, pre-LayerNorm blocks with
fused qkv, GELU MLP, tied head) is defined here, whether it is installed or not. The 7B case is
benchmarks/meta_7b.py's decoder at sequence 4096, judged against capacity="80 GiB": which strategies
make it fit. Reported: rows, time, host max RSS.

Each row also says how long its run took, against the as-is run's (the step's own time under the
tracker, with advise's copies and gradient check).

The 8-block MLP (width 256, vocabulary 8192, 2048 tokens, AdamW, meta with the allocator's model) is
issue 39's: each row's allocated and reserved peak (every run starts from the cache that only what is
live holds), the stacks advise measured under strategies=None and with checkpointing, chunked
cross-entropy and the fused step, and best() at several capacities.

Run: python benchmarks/advise.py [--json PATH] [--skip-gpt2] [--skip-mlp] [--skip-7b]
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import torch
import torch.nn.functional as F
from benchlib import parser, show, write_json
from meta_7b import Shape, build
from torch import nn

from cuda_allocator_model.sizes import format_size
from pytest_gpumem.advise.run import advise
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.results.advice import Advice


class GPT2Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.c_proj(attn)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))  # type: ignore[no-any-return]


class Head(nn.Module):
    """The tied LM head as a loss module: cross-entropy of hidden @ wte.T (what advise's loss= swaps)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((hidden @ self.weight.T).view(-1, self.weight.shape[0]), targets.view(-1))


class GPT2(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int, positions: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        self.h = nn.ModuleList(GPT2Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = Head(self.wte)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x), targets)  # type: ignore[no-any-return]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


HEADERS = ["strategy", "peak", "above start", "in", "compute", "gradients", "fits", "time"]
MLP_HEADERS = ["strategy", "allocated", "reserved", "in", "compute"]


def _time(advice: Advice, seconds: float | None) -> str:
    """The run's time and its multiple of the as-is run's."""
    base = advice.as_is.seconds
    if seconds is None:
        return ""
    return f"{seconds:.2f} s" + (f" ({seconds / base:.1f}x)" if base else "")


def rows_of(advice: Advice) -> list[list[str]]:
    """Absolute peaks (what was live when the step began + the step's peak above that), the phase of the
    peak, the extra compute, the gradients' check, whether the absolute peak is within the capacity, and
    the run's time against the as-is run's."""
    found = []
    for row in advice.rows:
        if not row.measured:
            found.append([row.name, "skipped", row.skipped or "", "", "", "", "", _time(advice, row.seconds)])
            continue
        assert row.peak_bytes is not None
        fits = "" if row.fits is None else ("yes" if row.fits else "no")
        peak, above = format_size(advice.absolute(row)), format_size(row.peak_bytes)
        gradients = row.gradients.split(" (")[0]
        found.append(
            [
                row.name,
                peak,
                above,
                row.peak_phase or "",
                advice.compute(row),
                gradients,
                fits,
                _time(advice, row.seconds),
            ]
        )
    return found


def gpt2(batch: int, seq: int) -> tuple[Advice, float, float]:
    torch.manual_seed(0)
    model = GPT2(layers=4, width=256, heads=4, vocab=8192, positions=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (batch, seq))
    targets = torch.randint(0, 8192, (batch, seq))

    def step(batch: slice = slice(None)) -> None:
        model(ids[batch], targets[batch]).backward()
        opt.step()
        opt.zero_grad()

    backend = TrackerBackend()
    backend.start()
    started = time.perf_counter()
    try:
        found = advise(step, model=model, optimizer=opt, backend=backend, loss=model.head, batch_size=batch)
    finally:
        backend.stop()
    return found, time.perf_counter() - started, rss_mib()


class MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))  # type: ignore[no-any-return]


class LossHead(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, width))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(hidden @ self.weight.T, targets)


class Mlp(nn.Module):
    def __init__(self, blocks: int, width: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(MlpBlock(width) for _ in range(blocks)))
        self.head = LossHead(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)), targets)  # type: ignore[no-any-return]


MLP_STACK = ["checkpoint-blocks", "chunked-ce", "fused-step"]
MLP_CAPACITIES = ("400 MiB", "300 MiB", "250 MiB", "200 MiB", "150 MiB")


def mlp(strategies: list[str] | None, tokens: int = 2048) -> tuple[Advice, float]:
    model = Mlp(blocks=8, width=256, vocab=8192).to("meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.zeros(tokens, dtype=torch.long, device="meta")

    def step(batch: slice = slice(None)) -> None:
        model(ids[batch], ids[batch]).backward()
        opt.step()
        opt.zero_grad()

    backend = TrackerBackend(device="meta")
    backend.start()
    started = time.perf_counter()
    try:
        found = advise(
            step, model=model, optimizer=opt, backend=backend, loss=model.head, batch_size=tokens, strategies=strategies
        )
    finally:
        backend.stop()
    return found, time.perf_counter() - started


def mlp_rows(advice: Advice) -> list[list[str]]:
    """Each measured row's absolute allocated peak, reserved peak, phase of the peak and compute."""
    found = []
    for row in advice.rows:
        if row.measured:
            reserved = "" if row.reserved_bytes is None else format_size(row.reserved_bytes)
            found.append(
                [row.name, format_size(advice.absolute(row)), reserved, row.peak_phase or "", advice.compute(row)]
            )
    return found


def mlp_best(advice: Advice) -> list[str]:
    chosen = {capacity: advice.best(capacity) for capacity in MLP_CAPACITIES}
    return [f"best({capacity}): {row.name if row else 'none fits'}" for capacity, row in chosen.items()]


def llama_7b(seq: int, capacity: str) -> tuple[Advice, float, float]:
    shape = dataclasses.replace(Shape(), seq=seq)
    model, ids, targets = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        logits = model(ids)
        F.cross_entropy(logits.float().view(-1, shape.vocab), targets).backward()  # type: ignore[no-untyped-call]
        opt.step()

    backend = TrackerBackend(device="meta")  # a GPU's paths: flash attention, foreach AdamW
    backend.start()
    started = time.perf_counter()
    try:
        found = advise(step, model=model, optimizer=opt, backend=backend, capacity=capacity)
    finally:
        backend.stop()
    return found, time.perf_counter() - started, rss_mib()


def main() -> None:
    cli = parser(__doc__ or "")
    cli.add_argument("--skip-gpt2", action="store_true")
    cli.add_argument("--skip-mlp", action="store_true")
    cli.add_argument("--skip-7b", action="store_true")
    args = cli.parse_args()
    results: dict[str, Any] = {}
    if not args.skip_gpt2:
        advice, seconds, rss = gpt2(batch=8, seq=128)
        title = f"GPT-2-style, 4 x 256, seq 128, batch 8, tracker: {seconds:.1f} s, max RSS {rss:.0f} MiB"
        show(title, HEADERS, rows_of(advice), advice.conflicts)
        results["gpt2"] = {"seconds": seconds, "max_rss_mib": rss, "advice": advice.to_json()}
    if not args.skip_mlp:
        for label, strategies in (("every strategy", None), ("the stack", MLP_STACK)):
            advice, seconds = mlp(strategies)
            title = f"8-block MLP, 256 wide, 2048 tokens, meta, {label}: {seconds:.1f} s"
            show(title, MLP_HEADERS, mlp_rows(advice), mlp_best(advice))
            results[f"mlp {label}"] = {"seconds": seconds, "advice": advice.to_json()}
    if not args.skip_7b:
        advice, seconds, rss = llama_7b(seq=4096, capacity="80 GiB")
        best = advice.best()
        live = format_size(advice.live_bytes)
        title = f"7B decoder, seq 4096, meta, capacity 80 GiB, {live} live at the step's start (the parameters)"
        notes = [f"best: {best.name if best else 'none fits'}", *advice.conflicts]
        show(f"{title}: {seconds:.1f} s, max RSS {rss:.0f} MiB", HEADERS, rows_of(advice), notes)
        results["llama_7b"] = {"seconds": seconds, "max_rss_mib": rss, "advice": advice.to_json()}
    write_json(args.json, results)


if __name__ == "__main__":
    main()
