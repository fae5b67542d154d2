"""`gpumem.fit` on the steps a line through peaks or a first step answered wrongly: each answer N, and
whether a training loop in a fresh process (a new tracker, the step built anew, warmed up where the
case is, then 3 steps in a row held to the capacity) runs at N and runs out at N + 1.

The cases: a warmed-up Linear(2048, 2048, bias=False) + AdamW step from small and from large sizes
(its small sizes peak in the optimizer step), Linear(256, 256) + AdamW not warmed up, an 8-layer decoder
on meta (width 2048, sequence 1024, AdamW; a batch of 1 takes other ops), a step on the CPU that grows
as n squared, the fit guide's steps (a Linear(1024, 1024) against 80 GiB on meta and on the CPU, whose
host cannot hold 80 GiB; its MLP against 24 GB warmed up and not, and against an L4), a fit under a test
capacity smaller than its own, and a 1B Llama-like decoder (16 layers, width 2048, MLP 8192, vocabulary
128,256, sequence 2048, bf16, AdamW) against an H100-80GB and an A100-40GB, and 4 checkpointed MLP blocks
(Linear(1024, 4096), GELU, Linear(4096, 1024)) against 2 GiB on meta, warmed up. Where the fit gives an
answer with expandable segments, it is run the same way in a fresh process that set
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. A wrong answer is one where N's loop runs out or N + 1's runs.

Run: python benchmarks/fit_cases.py [--json PATH] [--only NAME]
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from benchlib import parser, show, write_json
from meta_7b import Shape
from meta_7b import build as build_decoder

from cuda_allocator_model.cards import parse_capacity
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring

Step = Callable[[int], None]
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def linear_adamw(width: int, device: str, bias: bool = False) -> Step:
    with torch.device(device):
        model = torch.nn.Linear(width, width, bias=bias)
    optimizer = torch.optim.AdamW(model.parameters())

    def step(n: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(n, width, device=device)).sum().backward()
        optimizer.step()

    return step


def decoder(device: str) -> Step:
    with torch.device(device):
        layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True, dropout=0.0)
        model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
    optimizer = torch.optim.AdamW(model.parameters())
    mask = torch.nn.Transformer.generate_square_subsequent_mask(1024, device=torch.device(device))

    def step(n: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(torch.randn(n, 1024, 2048, device=device), mask=mask, is_causal=True)
        out.square().mean().backward()
        optimizer.step()

    return step


def squares(device: str) -> Step:
    def step(n: int) -> None:
        torch.ones(n, n, device=device).sum()

    return step


def guide_mlp(device: str) -> Step:
    """The fit guide's 24 GB step: Linear(4096, 16384), GELU, Linear(16384, 4096) on n x 2048 x 4096 + AdamW."""
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.GELU(), torch.nn.Linear(16384, 4096))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(n: int) -> None:
        model(torch.randn(n, 2048, 4096, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def checkpointed(device: str) -> Step:
    """4 blocks of Linear(1024, 4096), GELU, Linear(4096, 1024), each checkpointed (recomputed in backward)."""
    from torch.utils.checkpoint import checkpoint

    with torch.device(device):
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
            for _ in range(4)
        ]

    def step(n: int) -> None:
        x = torch.randn(n, 1024, device=device)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        x.sum().backward()  # type: ignore[no-untyped-call]
        for block in blocks:
            block.zero_grad(set_to_none=True)

    return step


LLAMA_1B = Shape(layers=16, hidden=2048, heads=32, mlp=8192, vocab=128_256, seq=2048)


def llama_1b(device: str) -> Step:
    model = build_decoder(LLAMA_1B)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    s = LLAMA_1B

    def step(n: int) -> None:
        ids = torch.zeros(n, s.seq, dtype=torch.long, device=device)
        targets = torch.zeros(n * s.seq, dtype=torch.long, device=device)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids).float().view(-1, s.vocab), targets).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return step


def guide(device: str) -> Step:
    model = torch.nn.Linear(1024, 1024).to(device)

    def step(n: int) -> None:
        model(torch.randn(n, 1024, device=device)).sum().backward()
        model.zero_grad(set_to_none=True)

    return step


@dataclass
class Case:
    name: str
    device: str
    build: Callable[[str], Step]
    sizes: list[int]
    capacity: str
    warm: bool = True
    test_capacity: int | None = None


CASES = [
    Case("the fit guide's MLP, 24 GB, warmed up", "meta", guide_mlp, [1, 2, 3], "24 GB"),
    Case("the fit guide's MLP, 24 GB, not warmed up", "meta", guide_mlp, [1, 2, 3], "24 GB", False),
    Case("the fit guide's MLP, L4, not warmed up", "meta", guide_mlp, [1, 2, 3], "L4", False),
    Case("1B Llama-like decoder, H100-80GB", "meta", llama_1b, [1, 2, 3], "H100-80GB", False),
    Case("1B Llama-like decoder, A100-40GB", "meta", llama_1b, [1, 2, 3], "A100-40GB", False),
    Case("n x n floats on the CPU, 64 MiB", "cpu", squares, [8, 16, 32], "64 MiB", False),
    Case("Linear 2048 + AdamW, small sizes", "cpu", lambda d: linear_adamw(2048, d), [8, 16, 32], "200 MiB"),
    Case("Linear 2048 + AdamW, large sizes", "cpu", lambda d: linear_adamw(2048, d), [1000, 3000, 6000], "200 MiB"),
    Case("Linear 256 + AdamW, not warmed up", "cpu", lambda d: linear_adamw(256, d, True), [1, 2, 4], "1 GiB", False),
    Case("8-layer decoder, width 2048, seq 1024", "meta", decoder, [1, 2, 3], "24 GiB"),
    Case("the fit guide's step, 80 GiB", "meta", guide, [8, 16, 32], "80 GiB", False),
    Case("the fit guide's step, 80 GiB, on the CPU", "cpu", guide, [8, 16, 32], "80 GiB", False),
    Case("4 checkpointed MLP blocks, 2 GiB", "meta", checkpointed, [8, 16, 32], "2 GiB"),
    Case("under a 128 MiB test capacity", "meta", lambda d: linear_adamw(2048, d), [8, 16, 32], "200 MiB", True, 2**27),
]


@contextlib.contextmanager
def expandable() -> Iterator[None]:
    """Within the block, a new tracker's allocator model has expandable segments (a process that set it)."""
    before = os.environ.get(ALLOC_CONF)
    os.environ[ALLOC_CONF] = "expandable_segments:True"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ALLOC_CONF]
        else:
            os.environ[ALLOC_CONF] = before


def loop(case: Case, n: int, steps: int = 3) -> str:
    """A fresh process's training loop: a new tracker, the case's step built on it (warmed up with its first
    size where the case is), then `steps` steps of n held to the capacity ('3 steps' or 'out of memory in
    step k')."""
    judged = parse_capacity(case.capacity, "capacity")
    backend = TrackerBackend(device=case.device)
    backend.configure(Settings(None, origins=False, events=False))
    backend.start()
    try:
        step = case.build(case.device)
        with backend.predicting(judged.card.name) if judged.card else contextlib.nullcontext():
            if case.warm:
                step(case.sizes[0])
            with backend.held_to(judged.bytes):
                for k in range(1, steps + 1):
                    try:
                        step(n)
                    except torch.OutOfMemoryError as exc:
                        exc.__traceback__ = None
                        return f"out of memory in step {k}"
        return f"{steps} steps"
    finally:
        backend.stop()


def run(case: Case) -> dict[str, object]:
    backend = TrackerBackend(device=case.device)
    backend.configure(Settings(case.test_capacity, origins=False, events=False))
    with measuring(Measurement(backend, case.name)) as call:
        step = case.build(case.device)
        if case.warm:
            step(case.sizes[0])
        began = time.perf_counter()
        fit = call.meter.fit(step, case.sizes, case.capacity)
        seconds = time.perf_counter() - began
    answer = fit.largest
    runnable = fit.confirmed and answer is not None
    at_n = loop(case, answer) if runnable and answer else "not run"
    above = loop(case, answer + 1) if runnable and answer else "not run"
    wrong = at_n.startswith("out of memory") or above.endswith("steps")
    grown = fit.expandable
    with expandable():
        grown_at_n = loop(case, grown) if runnable and grown else "not run"
        grown_above = loop(case, grown + 1) if runnable and grown else "not run"
    wrong = wrong or grown_at_n.startswith("out of memory") or grown_above.endswith("steps")
    return {
        "case": case.name,
        "answer": answer,
        "how": fit.found.value + (", exact" if fit.exact else "") + (", confirmed" if fit.confirmed else ""),
        "N": at_n,
        "N + 1": above,
        "expandable": grown,
        "expandable N": grown_at_n,
        "expandable N + 1": grown_above,
        "wrong": wrong,
        "runs": len(fit.sizes) + len(fit.checks) + len(fit.expandable_checks),
        "seconds": round(seconds, 2),
        "describe": fit.describe(),
    }


def main() -> None:
    args = parser("gpumem.fit on the cases a line through peaks or a first step got wrong")
    args.add_argument("--only", default="", help="run the cases whose name contains this")
    options = args.parse_args()
    results = [run(case) for case in CASES if options.only in case.name]
    expandable_runs = ["expandable", "expandable N", "expandable N + 1"]
    headers = ["case", "answer", "how", "N", "N + 1", *expandable_runs, "wrong", "runs", "seconds"]
    show("gpumem.fit: each answer, run within its capacity", headers, [[r[h] for h in headers] for r in results])
    for r in results:
        print(f"  * {r['case']}: {r['describe']}")
    write_json(options.json, {"cases": results})


if __name__ == "__main__":
    main()
