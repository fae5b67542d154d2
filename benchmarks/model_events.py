"""The allocator's model per event, tree against tree: ns (CPU time) or instructions per malloc and free.

    python benchmarks/model_events.py [--tree PATH ...] [--workload linear|card|random] [--rounds 7]
                                      [--instructions] [--snapshot FILE]

Workloads, each served into a fresh `CachingAllocatorModel` with torch's default settings:

- `linear` (the default): the events the tracker's ledger sends the model on 200 steps of `Linear(64)` on a
  batch of 8, forward and backward (op_cost.py's step, `--gpumem-round=cuda` on the CPU: 10 events a
  step, recorded from this checkout's tracker), in batches of 512 as the ledger holds them back. Two rows
  per tree: `each`, the ledger's loop calling `malloc` and `free` once per event; `replay`, the batch
  handed to the model's `replay()`, for a tree whose model has one (main has none: a batch method that
  wrote `malloc` and `free` out a second time saved 0.5 µs of a 170 µs step and was left out).
- `card`: a real card's trace (`--snapshot`, default the 11,300-event training trace of
  `NiuHuangxiaozi__assignment2-systems__train_ctx100_fp32.pickle` in `../shared/snapshots`), each request
  and free served as `malloc(address, size, stream)` and `free(address)`: what replaying a snapshot asks.
- `random`: model_ops.py's 200,000 random requests and frees (sizes under 1 MiB to 64 MiB).

Each tree (a folder holding `cuda_allocator_model`: this checkout by default, another version's from
e.g. `git archive main cuda_allocator_model | tar -x -C /tmp/main`) runs in a fresh process per round, the
trees alternating round by round; a process serves the workload 3 times and reports its best, in the
process's CPU time. `--instructions` counts each tree's instructions per event under valgrind's callgrind
instead (one run, between two marker calls: the same on any machine, however loaded). Each row ends with
the model's peaks (allocated, reserved, inactive split) and the sum of the counted bytes: trees and rows
that serve the workload alike print the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT, ROOT / "benchmarks"):
    if str(entry) not in sys.path:  # run from a checkout where the package is not installed
        sys.path.insert(0, str(entry))

SNAPSHOT = ROOT.parent / "shared" / "snapshots" / "NiuHuangxiaozi__assignment2-systems__train_ctx100_fp32.pickle"
LINEAR_STEPS = 200
BATCH = 512  # the ledger's REPLAY_AT
_ZERO, _DUMP = "getpgrp", "getppid"  # C functions nothing else calls: callgrind zeroes and dumps at them

_CHILD = """
import gc, json, os, sys, time
sys.path.insert(0, sys.argv[1])
from cuda_allocator_model.model import CachingAllocatorModel
from cuda_allocator_model.settings import AllocatorSettings

how, counting, size = sys.argv[3], sys.argv[4] == "count", int(sys.argv[5])
with open(sys.argv[2]) as f:
    raw = json.load(f)


class Held:
    __slots__ = ("key", "requested", "counted", "stream")

    def __init__(self, key, requested, stream):
        self.key, self.requested, self.counted, self.stream = key, requested, 0, stream


def each(model, held):
    malloc, free = model.malloc, model.free
    for event in held:
        if isinstance(event, int):
            free(event)
        else:
            event.counted = malloc(event.key, event.requested, event.stream)


def run():
    model = CachingAllocatorModel(AllocatorSettings())
    # as the ledger holds them: a request is an object the model's answer is set on, a free its key
    events = [key if nbytes < 0 else Held(key, nbytes, stream) for key, nbytes, stream in raw]
    batches = [events[i:i + size] for i in range(0, len(events), size)]
    serve = model.replay if how == "replay" else lambda batch: each(model, batch)
    if counting:
        os.getpgrp()
    started = time.process_time()
    for batch in batches:
        serve(batch)
    seconds = time.process_time() - started
    if counting:
        os.getppid()
    counted = sum(e.counted for e in events if not isinstance(e, int))
    return seconds, (model.peak_allocated, model.peak_reserved, model.peak_inactive_split, counted)


gc.disable()
run()
if counting:
    figures = run()[1]  # callgrind's last dump: this run's loop
else:
    seconds, figures = min(run() for _ in range(3))
    print(seconds)
print(*figures)
"""


def linear_events() -> list[tuple[int, int, int]]:
    """(key, requested bytes or -1 for a free, stream) of each event the ledger sends the model on
    `LINEAR_STEPS` steps of Linear(64) b8 (recorded by wrapping the model's malloc and free)."""
    import op_cost

    from cuda_allocator_model.model import CachingAllocatorModel
    from pytest_gpumem.backends.base import Settings
    from pytest_gpumem.backends.tracker.backend import TrackerBackend

    events: list[tuple[int, int, int]] = []
    malloc, free = CachingAllocatorModel.malloc, CachingAllocatorModel.free

    def recorded_malloc(model: CachingAllocatorModel, key: int, nbytes: int, stream: int = 0) -> int:
        events.append((key, nbytes, stream))
        return malloc(model, key, nbytes, stream)

    def recorded_free(model: CachingAllocatorModel, key: int) -> None:
        events.append((key, -1, 0))
        free(model, key)

    step, _ = op_cost.tiny_step()
    backend = TrackerBackend("cuda", paths="cpu")
    backend.configure(Settings(None))
    with (
        mock.patch.object(CachingAllocatorModel, "malloc", recorded_malloc),
        mock.patch.object(CachingAllocatorModel, "free", recorded_free),
    ):
        backend.start()
        for _ in range(LINEAR_STEPS):
            step()
        backend.peak()  # the events held back are served
        backend.stop()
    return events


def card_events(path: Path) -> list[tuple[int, int, int]]:
    """(address, requested bytes or -1 for a free, stream) of each request and free in a card's trace."""
    from cuda_allocator_model.snapshots.read import read_snapshot

    snapshot = read_snapshot(path)
    out: list[tuple[int, int, int]] = []
    for trace in snapshot.traces:
        for event in trace:
            if event.action == "alloc":
                out.append((event.addr, event.size, event.stream))
            elif event.action == "free_completed":
                out.append((event.addr, -1, event.stream))
    return out


def random_events() -> list[tuple[int, int, int]]:
    """model_ops.py's random workload: 200,000 requests and frees, about half of the requests freed."""
    import random

    rng = random.Random(7)
    out: list[tuple[int, int, int]] = []
    live: list[int] = []
    for key in range(200_000):
        if live and rng.random() < 0.48:
            out.append((live.pop(rng.randrange(len(live))), -1, 0))
        else:
            size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 64 << 20), 4096, 8 << 20])
            out.append((key, size, 0))
            live.append(key)
    return out


def has_replay(tree: Path) -> bool:
    return "def replay(" in (tree / "cuda_allocator_model" / "model.py").read_text(encoding="utf-8")


def one(tree: Path, events: Path, how: str) -> tuple[float, str]:
    done = subprocess.run(
        [sys.executable, "-S", "-c", _CHILD, str(tree), str(events), how, "", str(BATCH)],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, figures = done.stdout.splitlines()
    return float(seconds), figures


def instructions(tree: Path, events: Path, how: str, where: Path) -> tuple[int, str]:
    """Instructions callgrind counts in one run of the workload between the marker calls."""
    where.mkdir(parents=True, exist_ok=True)
    for old in where.glob("callgrind.out*"):
        old.unlink()
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={where}/callgrind.out",
        f"--zero-before={_ZERO}",
        f"--dump-before={_DUMP}",
    ]
    command = [sys.executable, "-S", "-c", _CHILD, str(tree), str(events), how, "count", str(BATCH)]
    done = subprocess.run([*valgrind, *command], capture_output=True, text=True, check=True)
    dumps = sorted(where.glob("callgrind.out.*"), key=lambda f: int(f.suffix[1:]))
    for line in dumps[-1].read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]), done.stdout.strip()
    raise RuntimeError(f"{dumps[-1]}: no summary line")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the allocator's model per event, tree against tree")
    p.add_argument("--tree", action="append", type=Path, default=[], help="a folder holding cuda_allocator_model")
    p.add_argument("--workload", choices=("linear", "card", "random"), default="linear", help="(default linear)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    p.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    p.add_argument("--snapshot", type=Path, default=SNAPSHOT, help="the card's trace of --workload card")
    args = p.parse_args(argv)
    trees: list[Path] = args.tree or [ROOT]
    if args.workload == "card" and not args.snapshot.is_file():
        print(f"model_events.py: no snapshot at {args.snapshot}: nothing to replay")
        return 0
    make: dict[str, Callable[[], list[tuple[int, int, int]]]] = {
        "linear": linear_events,
        "random": random_events,
        "card": lambda: card_events(args.snapshot),
    }
    events = make[args.workload]()
    one_stream = all(stream == 0 for _, _, stream in events)  # replay() serves stream 0, as the ledger asks
    rows = [
        (tree, how)
        for tree in trees
        for how in ("each", "replay")
        if how == "each" or (one_stream and has_replay(tree))
    ]
    with tempfile.TemporaryDirectory(prefix="model-events-") as folder:
        path = Path(folder) / "events.json"
        path.write_text(json.dumps(events), encoding="utf-8")
        unit = "instructions" if args.instructions else "ns (CPU time, best of 3 per process)"
        rounds = "one callgrind run" if args.instructions else f"{args.rounds} rounds, median [min]"
        print(f"{len(events):,} events ({args.workload}), {unit} per event, {rounds}")
        print(f"{'tree':<40} {'how':<7} {'per event':>16}  peaks allocated, reserved, inactive split; counted")
        if args.instructions:
            for n, (tree, how) in enumerate(rows):
                count, served = instructions(tree, path, how, Path(folder) / str(n))
                print(f"{tree!s:<40} {how:<7} {count / len(events):>16,.0f}  {served}")
            return 0
        times: dict[tuple[Path, str], list[float]] = {row: [] for row in rows}
        figures: dict[tuple[Path, str], set[str]] = {row: set() for row in rows}
        for _ in range(args.rounds):
            for tree, how in rows:
                seconds, figure = one(tree, path, how)
                times[tree, how].append(seconds / len(events) * 1e9)
                figures[tree, how].add(figure)
        for (tree, how), spread in times.items():
            cell = f"{statistics.median(spread):.0f} [{min(spread):.0f}]"
            print(f"{tree!s:<40} {how:<7} {cell:>16}  {'; '.join(sorted(figures[tree, how]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
