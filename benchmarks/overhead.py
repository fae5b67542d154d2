"""Overhead: what measuring costs.

    python benchmarks/overhead.py [--json PATH] [--rounds 15] [--threads N] [--skip-suites] [--cpu-time]
                                  [--against DIR] [--only net|tiny]

1. One forward+backward step, untracked vs the tracker (and with the CUDA allocator's model,
   `--gpumem-round=cuda`) vs MemTracker vs the profiler with profile_memory=True, on the Net (Linear
   1024->2048->1024, batch 64) and on a tiny Linear(64) (batch 8). Every round runs each candidate once,
   in turn (interleaved, so drift hits all alike); each candidate enters its tool, runs `inner` steps and
   leaves it (setup and teardown included), after a full garbage collection (untimed: `benchlib.interleaved`);
   the ratio is the median time over the median untracked time, and the median of each round's ratio
   (a run over the untracked run of its round: steadier where the machine's load drifts between rounds).
   `--cpu-time` times the main thread's CPU time instead of wall time (on the CPU, backward runs on the
   calling thread), and the pytest runs below in their CPU time (user and system): a machine shared with
   other work disturbs it far less. `--only net` runs the Net alone (more rounds in the same time).
2. The plugin idle (installed, no flags, no markers) on a generated suite of 2,000 trivial tests vs
   `-p no:gpumem`: median wall time of subprocess pytest runs (-q -p no:cacheprovider), interleaved. Every
   run reads its modules' bytecode from one temporary cache (`PYTHONPYCACHEPREFIX`) that the warm-up run
   wrote, as an installed package's are read: a run that compiled the plugin's sources (a checkout under
   PYTHONDONTWRITEBYTECODE) would time the compiler.
3. The cost per measured test: one trivial test carrying `@pytest.mark.max_memory` vs 1 + N of them, on
   the tracker and (GPU only) on the cuda backend; (many - one) / N, so the one-time costs of a measuring
   run (importing torch and dynamo, about 1.5 s, paid by any run that uses torch) cancel out.

`--against DIR` (a checkout of another commit, say `git worktree add --detach /tmp/before main`) times
that commit's package in the same rounds: its step candidates in a child process that imports it
(PYTHONPATH=DIR), asked for one run at a time in turn with this one's, and its idle plugin beside this
one's; each side's ratios are to its own untracked step.
"""

from __future__ import annotations

import argparse
import gc
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
                backend.peak()  # as a measured test reads it: what the ledger held back is served
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


STEPS = (("net", "Net b64", 3), ("tiny", "Linear(64) b8", 200))


def step_overheads(
    rounds: int, against: Path | None = None, only: str | None = None
) -> tuple[list[list[str]], dict[str, Any]]:
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    for kind, label, inner in STEPS:
        if only is not None and kind != only:
            continue
        model, x = make_model(kind)
        runs = candidates(model, x, inner)
        served = None if against is None else _Served(against, kind)
        if served is not None:
            runs |= {f"{name} @{against}": served.runner(name) for name in list(runs)}
        try:
            times = benchlib.interleaved(runs, rounds, collect=True)
        finally:
            if served is not None:
                served.close()
        data[kind] = {name: {"median_s": benchlib.median(t), "min_s": min(t)} for name, t in times.items()}
        for name, t in times.items():
            base = times["untracked" if against is None or "@" not in name else f"untracked @{against}"]
            med = benchlib.median(t)
            ratio, ratio_min = med / benchlib.median(base), min(t) / min(base)
            paired = benchlib.median([mine / theirs for mine, theirs in zip(t, base, strict=True)])
            rows.append([label, name, f"{med * 1e6:,.0f}", f"{ratio:.3f}", f"{ratio_min:.3f}", f"{paired:.3f}"])
    return rows, data


class _Served:
    """The step candidates of the package in `checkout`, run one at a time by a child process that imports
    it (`--serve KIND`): a line with the candidate's name in, a line with its seconds per step out."""

    def __init__(self, checkout: Path, kind: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
        clock = ["--cpu-time"] if _CLOCK[0] is not time.perf_counter else []
        command = [sys.executable, __file__, "--serve", kind, "--threads", str(torch.get_num_threads()), *clock]
        self.child = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def runner(self, name: str) -> Callable[[], float]:
        def run() -> float:
            assert self.child.stdin is not None and self.child.stdout is not None
            self.child.stdin.write(name + "\n")
            self.child.stdin.flush()
            answer = self.child.stdout.readline()
            if not answer:
                raise RuntimeError(f"the child serving {name!r} ended (exit {self.child.wait()})")
            return float(answer)

        return run

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        self.child.wait()


def serve(kind: str) -> int:
    """`--serve KIND`: run the step candidates named on stdin, each after a full collection (as
    `benchlib.interleaved` with `collect` runs them), and write their seconds per step."""
    import pytest_gpumem

    inner = dict((k, n) for k, _, n in STEPS)[kind]
    runs = candidates(*make_model(kind), inner)
    print(f"serving {kind} from {Path(pytest_gpumem.__file__).parent}", file=sys.stderr)
    for line in sys.stdin:
        gc.collect()
        print(repr(runs[line.strip()]()), flush=True)
    return 0


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


def pytest_seconds(folder: Path, target: Path, extra: list[str], checkout: Path | None = None) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target), *extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(folder / "bytecode")  # written by the warm-up run, read by the rest
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout.resolve())
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


def idle_overhead(runs: int, against: Path | None = None) -> tuple[list[list[str]], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        suite = write_suite(folder, IDLE_TESTS, marked=False, needs_torch=False)
        tried = {
            "-p no:gpumem": lambda: pytest_seconds(folder, suite, ["-p", "no:gpumem"]),
            "plugin idle": lambda: pytest_seconds(folder, suite, []),
        }
        if against is not None:
            tried[f"plugin idle @{against}"] = lambda: pytest_seconds(folder, suite, [], against)
        times = benchlib.interleaved(tried, runs, warmup=1)
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
    p.add_argument("--against", type=Path, default=None, metavar="DIR", help="also time the package of checkout DIR")
    p.add_argument("--only", choices=[kind for kind, _, _ in STEPS], help="only this step (implies --skip-suites)")
    p.add_argument("--serve", choices=[kind for kind, _, _ in STEPS], help=argparse.SUPPRESS)
    args: argparse.Namespace = p.parse_args(argv)
    if args.against is not None and not (args.against / "pytest_gpumem" / "__init__.py").is_file():
        p.error(f"--against {args.against}: no pytest_gpumem package there")
    if args.cpu_time:
        if args.threads != 1:
            p.error("--cpu-time times the main thread only: give --threads 1")
        _CLOCK[0] = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        return serve(args.serve)
    data: dict[str, Any] = {}
    rows, data["step"] = step_overheads(args.rounds, args.against, args.only)
    benchlib.show(
        f"forward+backward step, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds, "
        + ("CPU time" if args.cpu_time else "wall time"),
        ["model", "tool", "median µs/step", "ratio (medians)", "ratio (minima)", "ratio (median of each round's)"],
        rows,
        ["each round's ratio: a run over the untracked run of the same round (drift between rounds cancels)"],
    )
    if not args.skip_suites and args.only is None:
        rows, data["idle"] = idle_overhead(args.runs, args.against)
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
