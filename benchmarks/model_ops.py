"""The allocator's model's malloc and free, tree against tree: CPU seconds for a fixed workload.

    python benchmarks/model_ops.py [--tree PATH ...] [--rounds 7] [--conf CONF] [--workload repeated] [--count]

200,000 requests and frees of the default pool served by `CachingAllocatorModel`, best of 3 in a fresh
process per tree and round, the trees alternating round by round (a shared machine's drift hits all
alike). `--workload random` (the default): sizes under 1 MiB, 1-64 MiB, 4 KiB and 8 MiB, about half of the
requests freed again, in random order; `repeated`: a training loop's, the same 8 sizes (2 KiB to 24 MiB)
requested and freed in turn, step after step. `--count` adds the Python bytecodes each tree's model runs
per call (one traced run: the same on any machine, however loaded). A tree
is a folder holding a `cuda_allocator_model` package: this checkout (the default), or another version's,
e.g. `git archive main cuda_allocator_model | tar -x -C /tmp/main`. Times are the process's CPU time
(`time.process_time`), which other work on the machine disturbs far less than wall time. Each tree's peak
reserved bytes are printed beside its times: trees that serve the workload alike print the same.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ONE_TREE = """
import gc, random, sys, time
sys.path.insert(0, sys.argv[1])
from cuda_allocator_model.model import CachingAllocatorModel
from cuda_allocator_model.settings import AllocatorSettings

rng = random.Random(7)
ops, live = [], []
if sys.argv[3] == "repeated":
    sizes = [2048, 16388, 65636, 200_000, 700_000, 3 << 20 | 5, 9 << 20, 24 << 20]
    step = [(True, key, size) for key, size in enumerate(sizes)] + [(False, key, 0) for key in (1, 0, 3, 2, 5, 4, 7, 6)]
    ops = step * (200_000 // len(step))
for key in range(200_000 - len(ops)):
    if live and rng.random() < 0.48:
        ops.append((False, live.pop(rng.randrange(len(live))), 0))
    else:
        size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 64 << 20), 4096, 8 << 20])
        ops.append((True, key, size))
        live.append(key)

def run():
    model = CachingAllocatorModel(AllocatorSettings.parse(sys.argv[2] or None))
    malloc, free = model.malloc, model.free
    started = time.process_time()
    for alloc, key, size in ops:
        if alloc:
            malloc(key, size)
        else:
            free(key)
    return time.process_time() - started, model.peak_reserved

gc.disable()
run()
if sys.argv[4]:
    counted = [0]

    def opcode(frame, event, arg):
        counted[0] += event == "opcode"
        return opcode

    def call(frame, event, arg):
        if "cuda_allocator_model" not in frame.f_code.co_filename:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return opcode

    sys.settrace(call)
    run()
    sys.settrace(None)
    print(counted[0] / len(ops))
else:
    seconds, peak = min(run() for _ in range(3))
    print(seconds, peak)
"""


def one(tree: Path, conf: str, workload: str) -> tuple[float, int]:
    done = subprocess.run(
        [sys.executable, "-S", "-c", _ONE_TREE, str(tree), conf, workload, ""],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, peak = done.stdout.split()
    return float(seconds), int(peak)


def bytecodes(tree: Path, conf: str, workload: str) -> float:
    """Python bytecodes the tree's model runs per malloc or free, on average over the workload."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", _ONE_TREE, str(tree), conf, workload, "count"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the allocator's model's malloc and free, tree against tree")
    p.add_argument("--tree", action="append", type=Path, default=[], help="a folder holding cuda_allocator_model")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    p.add_argument("--conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the model (default: torch's defaults)")
    p.add_argument("--workload", choices=("random", "repeated"), default="random", help="(default random)")
    p.add_argument("--count", action="store_true", help="also the bytecodes each tree's model runs per call")
    args = p.parse_args(argv)
    trees: list[Path] = args.tree or [ROOT]
    times: dict[Path, list[float]] = {tree: [] for tree in trees}
    peaks: dict[Path, set[int]] = {tree: set() for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            seconds, peak = one(tree, args.conf, args.workload)
            times[tree].append(seconds)
            peaks[tree].add(peak)
    print(
        f"malloc/free of 200,000 requests and frees ({args.workload}), CPU s, best of 3 per process, "
        f"{args.rounds} rounds"
    )
    for tree in trees:
        spread = sorted(times[tree])
        count = f"  bytecodes a call {bytecodes(tree, args.conf, args.workload):.1f}" if args.count else ""
        print(
            f"{tree!s:<40} median {statistics.median(spread):.4f}  min {spread[0]:.4f}  max {spread[-1]:.4f}"
            f"  peak reserved {', '.join(map(str, sorted(peaks[tree])))}{count}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
