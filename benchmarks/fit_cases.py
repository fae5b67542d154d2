"""`gpumem.fit` on the steps a line through peaks answered wrongly: each answer N, and whether N and
N + 10% run within the capacity (each run held to it on the tracker: OutOfMemoryError past it).

The cases: a warmed-up Linear(2048, 2048, bias=False) + AdamW step from small and from large sizes
(its small sizes peak in the optimizer step), Linear(256, 256) + AdamW not warmed up, an 8-layer decoder
on meta (width 2048, sequence 1024, AdamW; a batch of 1 takes other ops), the fit guide's step against
80 GiB on meta and on the CPU (whose host cannot hold 80 GiB), and a fit under a test capacity smaller
than its own. A wrong answer is one where N does not fit or N + 10% does.

Run: python benchmarks/fit_cases.py [--json PATH]
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from benchlib import parser, show, write_json

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.meter import GpuMem
from pytest_gpumem.sizes import parse_size

Step = Callable[[int], None]


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
    Case("Linear 2048 + AdamW, small sizes", "cpu", lambda d: linear_adamw(2048, d), [8, 16, 32], "200 MiB"),
    Case("Linear 2048 + AdamW, large sizes", "cpu", lambda d: linear_adamw(2048, d), [1000, 3000, 6000], "200 MiB"),
    Case("Linear 256 + AdamW, not warmed up", "cpu", lambda d: linear_adamw(256, d, True), [1, 2, 4], "1 GiB", False),
    Case("8-layer decoder, width 2048, seq 1024", "meta", decoder, [1, 2, 3], "24 GiB"),
    Case("the fit guide's step, 80 GiB", "meta", guide, [8, 16, 32], "80 GiB", False),
    Case("the fit guide's step, 80 GiB, on the CPU", "cpu", guide, [8, 16, 32], "80 GiB", False),
    Case("under a 128 MiB test capacity", "meta", lambda d: linear_adamw(2048, d), [8, 16, 32], "200 MiB", True, 2**27),
]


def held_run(meter: GpuMem, step: Step, n: int, capacity: int) -> str:
    """Run `step(n)` held to `capacity`, from an empty cache as a fresh process: 'fits' or 'out of memory'."""
    backend = meter.backend
    assert isinstance(backend, TrackerBackend)
    gc.collect()  # as a measured phase does: cycles the fit's runs left are no longer held
    backend.empty_cache()
    try:
        with backend.held_to(capacity):
            step(n)
    except torch.OutOfMemoryError as exc:
        exc.__traceback__ = None
        ran_out = True
    else:
        ran_out = False
    gc.collect()
    return "out of memory" if ran_out else "fits"


def run(case: Case) -> dict[str, object]:
    backend = TrackerBackend(device=case.device)
    backend.configure(Settings(case.test_capacity, origins=False, events=False))
    measured = Measurement(backend, case.name)
    meter = GpuMem(measured)
    measured.begin()
    try:
        step = case.build(case.device)
        began = time.perf_counter()
        if case.warm:
            step(case.sizes[0])
        one_step = time.perf_counter() - began
        began = time.perf_counter()
        fit = meter.fit(step, case.sizes, case.capacity)
        seconds = time.perf_counter() - began
        limit = parse_size(case.capacity)
        answer = fit.largest
        on_meta = case.device == "meta" or limit < 8 * 2**30
        at_n = held_run(meter, step, answer, limit) if answer and on_meta else "not run"
        above = math.ceil(answer * 1.1) if answer else None
        at_above = held_run(meter, step, above, limit) if above and on_meta else "not run"
    finally:
        measured.end()
    wrong = at_n == "out of memory" or at_above == "fits"
    return {
        "case": case.name,
        "answer": answer,
        "how": fit.found.value + (", exact" if fit.exact else "") + (", confirmed" if fit.confirmed else ""),
        "N": at_n,
        "N + 10%": at_above,
        "wrong": wrong,
        "runs": len(fit.sizes) + len(fit.checks),
        "seconds": round(seconds, 2),
        "x step": round(seconds / one_step, 1) if case.warm and one_step else None,
        "describe": fit.describe(),
    }


def main() -> None:
    options = parser("gpumem.fit on the cases a line through peaks got wrong").parse_args()
    results = [run(case) for case in CASES]
    headers = ["case", "answer", "how", "N", "N + 10%", "wrong", "runs", "seconds", "x step"]
    show("gpumem.fit: each answer, run within its capacity", headers, [[r[h] for h in headers] for r in results])
    for r in results:
        print(f"  * {r['case']}: {r['describe']}")
    write_json(options.json, {"cases": results})


if __name__ == "__main__":
    main()
