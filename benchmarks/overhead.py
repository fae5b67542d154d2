"""Overhead: what measuring costs.

    python benchmarks/overhead.py [--json PATH] [--rounds 15] [--threads N] [--skip-suites] [--cpu-time]

1. One forward+backward step, untracked vs the tracker (and with the CUDA allocator's model,
   `--gpumem-round=cuda`) vs MemTracker vs the profiler with profile_memory=True, on the Net (Linear
   1024->2048->1024, batch 64) and on a tiny Linear(64) (batch 8). Every round runs each candidate once,
   in turn (interleaved, so drift hits all alike); each candidate enters its tool, runs `inner` steps and
   leaves it (setup and teardown included), after a full garbage collection (untimed: `benchlib.interleaved`);
   the ratio is the median time over the median untracked time. `--cpu-time` times the main thread's CPU
   time instead of wall time (on the CPU, backward runs on the calling thread), and the pytest runs below
   in their CPU time (user and system): a machine shared with other work disturbs it far less.
2. The plugin idle (installed, no flags, no markers) on a generated suite of 2,000 trivial tests vs
   `-p no:gpumem`: median wall time of subprocess pytest runs (-q -p no:cacheprovider), interleaved.
3. The cost per measured test: one trivial test carrying `@pytest.mark.max_memory` vs 1 + N of them, on
   the tracker and (GPU only) on the cuda backend; (many - one) / N, so the one-time costs of a measuring
   run (importing torch and dynamo, about 1.5 s, paid by any run that uses torch) cancel out.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
import torch
from torch import nn

from pytest_gpumem.backends.tracker.backend import TrackerBackend

IDLE_TESTS = 2000
MEASURED_TESTS = 200
_CLOCK: list[Callable[[], float]] = [time.perf_counter]  # --cpu-time: time.thread_time


# ------------------------------------------------------------------------------------ per step


def make_model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "net":
        return benchlib.Net(), torch.randn(benchlib.BATCH, 1024)
    return nn.Linear(64, 64), torch.randn(8, 64)


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)


def candidates(model: nn.Module, x: torch.Tensor, inner: int) -> dict[str, Callable[[], float]]:
    """Seconds per step for each way of running `inner` steps."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile

    clock = _CLOCK[0]

    def untracked() -> float:
        start = clock()
        for _ in range(inner):
            step(model, x)
        return (clock() - start) / inner

    def tracked(rounding: str) -> Callable[[], float]:
        def run() -> float:
            backend = TrackerBackend(rounding)
            start = clock()
            backend.start()
            try:
                for _ in range(inner):
                    step(model, x)
            finally:
                backend.stop()
            return (clock() - start) / inner

        return run

    def memtracker() -> float:
        start = clock()
        with MemTracker() as mt:
            for _ in range(inner):
                step(model, x)
                mt.reset_mod_stats()  # MemTracker refuses a module run twice without it
        return (clock() - start) / inner

    def profiler() -> float:
        start = clock()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            for _ in range(inner):
                step(model, x)
        return (clock() - start) / inner

    return {
        "untracked": untracked,
        "tracker": tracked("none"),
        "tracker + allocator model": tracked("cuda"),  # --gpumem-round=cuda: the CUDA allocator's blocks
        "MemTracker": memtracker,
        "profiler": profiler,
    }


def step_overheads(rounds: int) -> tuple[list[list[str]], dict[str, Any]]:
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    for kind, label, inner in (("net", "Net b64", 3), ("tiny", "Linear(64) b8", 200)):
        model, x = make_model(kind)
        times = benchlib.interleaved(candidates(model, x, inner), rounds, collect=True)
        base = benchlib.median(times["untracked"])
        data[kind] = {name: {"median_s": benchlib.median(t), "min_s": min(t)} for name, t in times.items()}
        for name, t in times.items():
            med = benchlib.median(t)
            rows.append(
                [label, name, f"{med * 1e6:,.0f}", f"{med / base:.3f}", f"{min(t) / min(times['untracked']):.3f}"]
            )
    return rows, data


# ------------------------------------------------------------------------------------ suites


def write_suite(folder: Path, tests: int, marked: bool, needs_torch: bool) -> Path:
    lines = ["import pytest"]
    if needs_torch:
        lines.append("import torch")
    mark = '@pytest.mark.max_memory("1 GiB")\n' if marked else ""
    body = "    torch.ones(4)" if needs_torch else "    assert True"
    lines += [f"{mark}def test_{i}():\n{body}\n" for i in range(tests)]
    path = folder / f"test_{'marked' if marked else 'plain'}_{tests}.py"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    return path


def pytest_seconds(folder: Path, target: Path, extra: list[str]) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target), *extra]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cpu = _CLOCK[0] is not time.perf_counter
    start = _children_cpu() if cpu else time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, check=False)
    elapsed = (_children_cpu() if cpu else time.perf_counter()) - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed


def _children_cpu() -> float:
    """CPU seconds (user and system) of the finished child processes (`--cpu-time`)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def idle_overhead(runs: int) -> tuple[list[list[str]], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        suite = write_suite(folder, IDLE_TESTS, marked=False, needs_torch=False)
        times = benchlib.interleaved(
            {
                "-p no:gpumem": lambda: pytest_seconds(folder, suite, ["-p", "no:gpumem"]),
                "plugin idle": lambda: pytest_seconds(folder, suite, []),
            },
            runs,
            warmup=1,
        )
    base = benchlib.median(times["-p no:gpumem"])
    rows = [
        [f"{IDLE_TESTS} trivial tests", name, f"{benchlib.median(t):.3f}", f"{benchlib.median(t) / base:.3f}"]
        for name, t in times.items()
    ]
    return rows, {"tests": IDLE_TESTS, "seconds": times}


def measured_cost(runs: int, backend: str) -> tuple[list[str], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # one marked test against many: the difference is the cost of each further measured test, without
        # the one-time costs of a measuring run (importing torch, the backend's first use)
        one = write_suite(folder, 1, marked=True, needs_torch=True)
        many = write_suite(folder, MEASURED_TESTS + 1, marked=True, needs_torch=True)
        flags = [f"--gpumem-backend={backend}"]
        times = benchlib.interleaved(
            {
                "one": lambda: pytest_seconds(folder, one, flags),
                "many": lambda: pytest_seconds(folder, many, flags),
            },
            runs,
            warmup=1,
        )
    per_test = (benchlib.median(times["many"]) - benchlib.median(times["one"])) / MEASURED_TESTS
    row = [
        backend,
        str(MEASURED_TESTS),
        f"{benchlib.median(times['one']):.3f}",
        f"{benchlib.median(times['many']):.3f}",
    ]
    return [*row, f"{per_test * 1e3:.2f}"], {"tests": MEASURED_TESTS, "seconds": times, "per_test_s": per_test}


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("overhead of the tracker, MemTracker, the profiler and the idle plugin")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per step candidate (default 15)")
    p.add_argument("--runs", type=int, default=5, help="pytest runs per suite (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--skip-suites", action="store_true", help="only the per-step comparison")
    p.add_argument("--cpu-time", action="store_true", help="steps timed in the thread's CPU time, not wall time")
    args: argparse.Namespace = p.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            p.error("--cpu-time times the main thread only: give --threads 1")
        _CLOCK[0] = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    data: dict[str, Any] = {}
    rows, data["step"] = step_overheads(args.rounds)
    benchlib.show(
        f"forward+backward step, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds, "
        + ("CPU time" if args.cpu_time else "wall time"),
        ["model", "tool", "median µs/step", "ratio (medians)", "ratio (minima)"],
        rows,
    )
    if not args.skip_suites:
        rows, data["idle"] = idle_overhead(args.runs)
        benchlib.show("plugin idle vs disabled (subprocess pytest)", ["suite", "run", "median s", "ratio"], rows)
        cost_rows, data["measured"] = [], {}
        for backend in ("tracker", "cuda"):
            if backend == "cuda" and not torch.cuda.is_available():
                cost_rows.append(["cuda", "-", "-", "-", "skipped: no CUDA device here"])
                continue
            row, data["measured"][backend] = measured_cost(args.runs, backend)
            cost_rows.append(row)
        benchlib.show(
            "cost of one measured test (max_memory marker on a trivial test)",
            ["backend", "further tests", "1 marked test s", "1 + further s", "ms per further measured test"],
            cost_rows,
            ["one-time costs of a measuring run (torch, the backend's first use) are in both runs, so cancel out"],
        )
    benchlib.write_json(args.json, {"overhead": data})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
