"""Overhead: what measuring costs.

    python benchmarks/overhead.py [--json PATH] [--rounds 15] [--threads N] [--skip-suites] [--cpu-time]
                                  [--against DIR] [--only net|tiny] [--floor] [--steady-heap]
                                  [--instructions [--idle-only] [--environments N] [--jobs N]
                                  [--also-against DIR] [--callgrind-out DIR]]

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

`--floor` also times a dispatch mode that only runs each op (op_cost.py's floor): what any Python dispatch
mode costs the same step. `--steady-heap` runs the script with glibc's malloc keeping what it frees (no
step faults its pages in again): a Net step otherwise takes 2,000-2,800 page faults, a fifth of its CPU time
here, in a number that changes with the heap's layout from one run to the next (the noise of its ratios).

`--instructions` counts instead of timing: each step candidate (and the floor) in a child process under
valgrind's callgrind, one thread, its runs between two marker calls (callgrind zeroes its counters at
`getpgrp()` and dumps them at `getppid()`), after a warm-up run of each; and the idle suite's whole pytest
runs, by phase (start-up: a run of one test; per test: the 2,000 tests' run less that, over 1,999) in
`--environments` environments (hash seed, environment size), with the garbage collector's collections. Step
counts repeat to a few instructions, so a change of 0.1% shows; an idle run's start-up repeats to 0.3 M, its
per-test part moves by about 0.2% with the checkout's path and the environment (benchmarks/README.md).
Kernels run their SSE4.2 code there (valgrind has no AVX-512 and runs AVX2 about 50 times slower), so a
step's own instructions are several times this machine's: "above untracked" (instructions a step) is exact,
the ratio understates time's.

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
from concurrent.futures import ThreadPoolExecutor
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
    rounds: int, against: Path | None = None, only: str | None = None, floor: bool = False
) -> tuple[list[list[str]], dict[str, Any]]:
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    for kind, label, inner in STEPS:
        if only is not None and kind != only:
            continue
        model, x = make_model(kind)
        runs = (counted_candidates if floor else candidates)(model, x, inner)
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
    runs = counted_candidates(*make_model(kind), inner)
    print(f"serving {kind} from {Path(pytest_gpumem.__file__).parent}", file=sys.stderr)
    for line in sys.stdin:
        gc.collect()
        print(repr(runs[line.strip()]()), flush=True)
    return 0


# ------------------------------------------------------------------------------------ instructions

_ZERO, _DUMP = "getpgrp", "getppid"  # C functions nothing else calls: callgrind zeroes and dumps at them
_CALLGRIND_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    # valgrind runs AVX2 code about 50 times slower than SSE (a Net step: 40 s): kernels of SSE4.2
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "ATEN_CPU_CAPABILITY": "default",
}
_STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
"""glibc's malloc keeps what a step frees (blocks up to 32 MiB from the heap, none given back): no step
faults its pages in again, which otherwise costs a Net step 2,000-2,800 page faults, a number that varies
with the heap's layout from run to run (a fifth of its CPU time on this machine)."""
FLOOR = "a mode that does nothing"


def counted_candidates(model: nn.Module, x: torch.Tensor, inner: int) -> dict[str, Callable[[], float]]:
    """The step candidates, and a dispatch mode that only runs each op (op_cost.py's floor): what any
    Python dispatch mode pays on the same step."""
    import op_cost

    clock = _CLOCK[0]

    def floor() -> float:
        start = clock()
        mode: Any = op_cost._Floor()  # type: ignore[no-untyped-call]
        with mode:
            for _ in range(inner):
                step(model, x)
        return (clock() - start) / inner

    runs = candidates(model, x, inner)
    return {"untracked": runs.pop("untracked"), FLOOR: floor, **runs}


def count(kind: str, rounds: int) -> int:
    """`--count KIND` (run under callgrind by `instruction_counts`): each candidate's runs, in rounds,
    each after a full collection and between the two marker calls; the candidates' names in order on stdout."""
    inner = dict((k, n) for k, _, n in STEPS)[kind]
    counted_rounds(counted_candidates(*make_model(kind), inner), rounds)
    return 0


def counted_rounds(runs: dict[str, Callable[[], float]], rounds: int) -> None:
    """Each of `runs` once to warm up (first uses: imports, caches), then in `rounds`, each after a full
    collection and between the two marker calls callgrind counts between; its name on stdout after it."""
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            gc.collect()
            os.getpgrp()
            fn()
            os.getppid()
            print(name, flush=True)


def _callgrind(
    command: list[str], where: Path, env: dict[str, str], markers: bool, cwd: Path | None = None
) -> tuple[list[int], str, str]:
    """The instructions callgrind counted in `command` (one thread, torch's threads at 1): one figure per
    region between the marker calls (`markers`), else the whole process's; and the command's stdout and stderr."""
    where.mkdir(parents=True, exist_ok=True)
    for old in where.glob("callgrind.out*"):
        old.unlink()
    triggers = [f"--zero-before={_ZERO}", f"--dump-before={_DUMP}"] if markers else []
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={where}/callgrind.out", *triggers]
    env = {**env, **_CALLGRIND_ENV}
    done = subprocess.run([*valgrind, *command], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} under callgrind failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    dumps = [where / "callgrind.out"]
    if markers:
        dumps = sorted(where.glob("callgrind.out.*"), key=lambda f: int(f.suffix[1:]))
    return [_summary(d) for d in dumps], done.stdout, done.stderr


def _summary(dump: Path) -> int:
    for line in dump.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"{dump}: no summary line")


def step_instructions(
    rounds: int, against: Path | None, only: str | None, out: Path
) -> tuple[list[list[str]], dict[str, Any]]:
    """Instructions per step of each candidate (and the floor), counted by callgrind in a child process
    that runs them in rounds (`--count`); each side's ratios are to its own untracked step."""
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    sides = [("", None)] + ([] if against is None else [(f" @{against}", against)])
    for kind, label, inner in STEPS:
        if only is not None and kind != only:
            continue
        for suffix, checkout in sides:
            env = dict(os.environ) if checkout is None else {**os.environ, "PYTHONPATH": str(checkout.resolve())}
            command = [sys.executable, __file__, "--count", kind, "--rounds", str(rounds), "--threads", "1"]
            counts, stdout, _ = _callgrind(command, out / f"{kind}{'-against' if checkout else ''}", env, markers=True)
            names = stdout.splitlines()
            if len(counts) != len(names):
                raise RuntimeError(f"{len(counts)} callgrind dumps for {len(names)} runs: {_DUMP}() called elsewhere")
            per_step: dict[str, list[float]] = {}
            for name, instructions in zip(names, counts, strict=True):
                per_step.setdefault(name, []).append(instructions / inner)
            base = benchlib.median(per_step["untracked"])
            for name, runs in per_step.items():
                med = benchlib.median(runs)
                spread = (max(runs) - min(runs)) / med
                rows.append(
                    [label, name + suffix, f"{med:,.0f}", f"{med - base:+,.0f}", f"{med / base:.4f}", f"{spread:.3%}"]
                )
            data[kind + suffix] = per_step
    return rows, data


IDLE_ENVIRONMENTS = 3  # 24 pytest runs under callgrind with --against and --also-against
_PYTEST_COUNTING_GC = (
    "import atexit, gc, sys\n"
    "atexit.register(lambda: print('gc', *(s['collections'] for s in gc.get_stats()), file=sys.stderr))\n"
    "import pytest\n"
    "raise SystemExit(pytest.console_main())\n"
)
"""`python -m pytest`, which also writes on stderr how many collections each generation made."""


def _environment(index: int) -> dict[str, str]:
    """The `index`th environment a run is counted in: a hash seed and a padding of its environment's size
    (which moves where the stack and the heap begin), the two things that move a run's count alone."""
    return {"PYTHONHASHSEED": str(index), "GPUMEM_BENCH_PADDING": "x" * (97 * index)}


def idle_instructions(
    against: list[Path], out: Path, environments: int = IDLE_ENVIRONMENTS, jobs: int = 1
) -> tuple[list[list[str]], dict[str, Any]]:
    """Instructions of whole pytest runs of the trivial suite, the plugin idle vs `-p no:gpumem`, in
    `environments` environments (each side counted in each, the ratio taken within one): start-up (a run of
    one test) and per test ((the 2,000 tests' run - the one's) / 1,999), with the collections the garbage
    collector made; each run after two (not counted) in the same environment that wrote the bytecode it reads;
    `jobs` runs at a time (callgrind's counts do not depend on what else runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        suites = {1: write_suite(folder, 1, marked=False, needs_torch=False)}
        suites[IDLE_TESTS] = write_suite(folder, IDLE_TESTS, marked=False, needs_torch=False)
        sides: dict[str, tuple[list[str], Path | None]] = {"-p no:gpumem": (["-p", "no:gpumem"], None)}
        sides["plugin idle"] = ([], None)
        sides |= {f"plugin idle @{checkout}": ([], checkout) for checkout in against}
        runs = [(name, tests, index) for index in range(environments) for name in sides for tests in sorted(suites)]

        def counted(run: tuple[str, int, int]) -> tuple[int, str]:
            name, tests, index = run
            extra, checkout = sides[name]
            return _count_pytest(folder, suites[tests], extra, checkout, index, out / f"idle-{runs.index(run)}")

        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(counted, runs))
    counts: dict[str, dict[int, list[int]]] = {name: {n: [] for n in suites} for name in sides}
    collections: dict[str, list[str]] = {name: [] for name in sides}
    for (name, tests, _), (instructions, gc_line) in zip(runs, results, strict=True):
        counts[name][tests].append(instructions)
        if tests == IDLE_TESTS:
            collections[name].append(gc_line)
    return _idle_rows(counts, collections), {"tests": IDLE_TESTS, "instructions": counts, "gc": collections}


def _count_pytest(
    folder: Path, suite: Path, extra: list[str], checkout: Path | None, index: int, where: Path
) -> tuple[int, str]:
    """Callgrind's count of one pytest run of `suite`, and the garbage collector's collections in it."""
    command = [sys.executable, "-c", _PYTEST_COUNTING_GC, "-q", "-p", "no:cacheprovider", str(suite), *extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | _CALLGRIND_ENV
    env |= _environment(index)
    env["PYTHONPYCACHEPREFIX"] = str(folder / "bytecode")
    # each side found on sys.path, as an installed package is (pytest then rewrites its asserts)
    env["PYTHONPATH"] = str((checkout or Path(__file__).resolve().parent.parent).resolve())
    for _ in range(2):  # the bytecode (and pytest's rewritten modules) written, then read
        subprocess.run(command, cwd=folder, env=env, capture_output=True, check=True)
    # run where the suite is, as the uncounted runs: a checkout as the working directory is on sys.path
    counted = _callgrind(command, where, env, markers=False, cwd=folder)
    gc_line = next((line for line in counted[2].splitlines() if line.startswith("gc ")), "gc ?")
    return counted[0][0], gc_line[3:]


def _idle_rows(counts: dict[str, dict[int, list[int]]], collections: dict[str, list[str]]) -> list[list[str]]:
    """Per side: start-up and per test (medians over the environments), and the whole run's ratio to
    `-p no:gpumem` counted in the same environment: its median and its spread (max - min)."""
    base = counts["-p no:gpumem"]
    rows = []
    for name, by_size in counts.items():
        start_up = benchlib.median(by_size[1])
        whole, one = by_size[IDLE_TESTS], by_size[1]
        per_test = benchlib.median([(m - o) / (IDLE_TESTS - 1) for m, o in zip(whole, one, strict=True)])
        ratios = [mine / theirs for mine, theirs in zip(by_size[IDLE_TESTS], base[IDLE_TESTS], strict=True)]
        rows.append(
            [
                name,
                f"{start_up / 1e6:,.1f} M",
                f"{(start_up - benchlib.median(base[1])) / 1e6:+,.1f} M",
                f"{per_test:,.0f}",
                f"{benchlib.median(by_size[IDLE_TESTS]) / 1e6:,.1f} M",
                f"{benchlib.median(ratios):.4f}",
                f"{max(ratios) - min(ratios):.4f}",
                " / ".join(collections[name]),
            ]
        )
    return rows


def show_instructions(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """`--instructions`: the step candidates and the idle plugin, in callgrind's instruction counts."""
    out = args.callgrind_out or Path(tempfile.mkdtemp(prefix="overhead-callgrind-"))
    if not args.idle_only:
        show_step_instructions(args, data, out)
    if args.idle_only or (not args.skip_suites and args.only is None):
        against = ([] if args.against is None else [args.against]) + args.also_against
        rows, data["idle_instructions"] = idle_instructions(against, out, args.environments, args.jobs)
        benchlib.show(
            f"plugin idle vs disabled, instructions of whole pytest runs (callgrind), {args.environments} environments",
            [
                "run",
                "start-up (1 test)",
                "above disabled",
                "per test",
                f"{IDLE_TESTS} tests",
                "ratio (median)",
                "ratio's spread",
                "gc collections (gen 0 1 2) per environment",
            ],
            rows,
            [
                "each environment: PYTHONHASHSEED and the environment's size differ; both sides counted in each",
                f"per test: (the {IDLE_TESTS:,} tests' run - the 1 test's) / {IDLE_TESTS - 1:,}, median over the "
                "environments; ratio: the whole run's to -p no:gpumem's in the same environment",
            ],
        )


def show_step_instructions(args: argparse.Namespace, data: dict[str, Any], out: Path) -> None:
    rows, data["step_instructions"] = step_instructions(args.rounds, args.against, args.only, out)
    benchlib.show(
        f"forward+backward step, 1 thread, instructions counted by callgrind, {args.rounds} rounds",
        ["model", "tool", "instructions/step (median)", "above untracked", "ratio", "spread of rounds"],
        rows,
        [
            "kernels run as SSE4.2 (valgrind has no AVX-512 and runs AVX2 50 times slower): they take several "
            "times the instructions they take here, so the ratio understates the time's; 'above untracked' is exact",
            f"{FLOOR}: a dispatch mode that only runs each op (op_cost.py's floor)",
            f"callgrind's dumps (one per run, in order) kept in {out}",
        ],
    )


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
    p.add_argument("--instructions", action="store_true", help="count instructions under callgrind, 1 thread")
    p.add_argument("--idle-only", action="store_true", help="with --instructions: only the idle suite")
    p.add_argument(
        "--environments",
        type=int,
        default=IDLE_ENVIRONMENTS,
        help=f"with --instructions: environments the idle suite is counted in (default {IDLE_ENVIRONMENTS})",
    )
    p.add_argument("--jobs", type=int, default=1, help="with --instructions: idle runs counted at a time (default 1)")
    p.add_argument(
        "--also-against",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="with --instructions --idle-only: also count the idle plugin of checkout DIR (repeatable)",
    )
    p.add_argument("--callgrind-out", type=Path, default=None, metavar="DIR", help="keep callgrind's dumps in DIR")
    p.add_argument("--floor", action="store_true", help=f"also time {FLOOR} (op_cost.py's floor)")
    p.add_argument("--steady-heap", action="store_true", help="malloc keeps freed memory: steps fault no pages")
    p.add_argument("--count", choices=[kind for kind, _, _ in STEPS], help=argparse.SUPPRESS)
    args: argparse.Namespace = p.parse_args(argv)
    if args.against is not None and not (args.against / "pytest_gpumem" / "__init__.py").is_file():
        p.error(f"--against {args.against}: no pytest_gpumem package there")
    for other in args.also_against:
        if not (other / "pytest_gpumem" / "__init__.py").is_file():
            p.error(f"--also-against {other}: no pytest_gpumem package there")
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give at least 1")
    if args.environments < 1:
        p.error(f"--environments {args.environments}: give at least 1")
    if args.instructions and args.threads not in (None, 1):
        p.error("--instructions counts one thread: leave --threads out or give 1")
    if args.cpu_time:
        if args.threads != 1:
            p.error("--cpu-time times the main thread only: give --threads 1")
        _CLOCK[0] = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steady_heap and any(os.environ.get(k) != v for k, v in _STEADY_HEAP.items()):
        again = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, __file__, *again], {**os.environ, **_STEADY_HEAP})
    if args.serve:
        return serve(args.serve)
    if args.count:
        return count(args.count, args.rounds)
    data: dict[str, Any] = {}
    if args.instructions:
        show_instructions(args, data)
        benchlib.write_json(args.json, {"overhead": data})
        return 0
    rows, data["step"] = step_overheads(args.rounds, args.against, args.only, args.floor)
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
