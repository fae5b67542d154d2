"""Scale: the report for 10,000 tests, and a baseline store of 10,000 entries.

    python benchmarks/scale.py [--json PATH] [--tests 10000] [--repeat 3]

Times are the median of `--repeat` runs of each operation, in one process.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib

from pytest_gpumem.report.terminal import table
from pytest_gpumem.results import PhaseResult, TestResult

PHASE_NAMES = ("forward", "backward", "step")


def synthetic_results(count: int) -> list[TestResult]:
    results = []
    for i in range(count):
        phases = {name: PhaseResult(name, (i + 1) * 4096 * (j + 1), (i + 1) * 4000, None, 0) for j, name in
                  enumerate(PHASE_NAMES)}  # fmt: skip
        call = PhaseResult("call", (i + 1) * 16384, (i + 1) * 16000, None, 4)
        nodeid = f"tests/test_module_{i // 100}.py::test_case[{i}]"
        results.append(TestResult.of(nodeid, "tracker", "cpu", call, phases, budget_text="1 GiB"))
    return results


def timed(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return benchlib.median(times)


def report_rows(count: int, repeat: int) -> list[list[str]]:
    results = synthetic_results(count)
    seconds = timed(lambda: table(results), repeat)
    lines = len(table(results).splitlines())
    return [[f"report.table, {count:,} results", f"{seconds * 1e3:,.1f}", f"{lines:,} lines"]]


def baseline_rows(count: int, repeat: int) -> list[list[str]]:
    """load, compare, update and write on a store of `count` entries; their sum is the figure to watch."""
    from pytest_gpumem.baselines import compare as c
    from pytest_gpumem.baselines import file as f
    from pytest_gpumem.baselines import update as u
    from pytest_gpumem.baselines.schema import BaselineStore
    from pytest_gpumem.constants import DEFAULT_FILENAME
    from pytest_gpumem.results.baseline import DeviceIdentity, Entry, Environment

    identity = DeviceIdentity("tracker", "cpu")
    env = Environment("2.13.0", None)

    def entry(i: int, grow: int = 0) -> Any:
        phases = {name: (i + 1) * 4096 * (j + 1) + grow for j, name in enumerate(PHASE_NAMES)}
        return Entry.measured(identity, env, (i + 1) * 16384 + grow, phases)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / DEFAULT_FILENAME
        store = BaselineStore(path)
        u.update(store, {f"tests/test_m{i // 100}.py::test_case[{i}]": entry(i) for i in range(count)})
        current = {nodeid: entry(i, grow=i % 3) for i, nodeid in enumerate(store.entries)}
        write_s = timed(lambda: f.write(store, path), repeat)
        size = path.stat().st_size
        load_s = timed(lambda: f.load(path), repeat)
        loaded = f.load(path)
        compare_s = timed(lambda: [c.compare(n, e, loaded.get(n, identity)) for n, e in current.items()], repeat)
        update_s = timed(lambda: u.update(f.load(path), current), repeat) - load_s

        def merging_write() -> None:
            mine, other = f.load(path), f.load(path)
            u.update(other, {f"tests/test_other.py::test_other[{len(merge_times)}]": entry(0)})
            f.write(other)
            u.update(mine, current)
            start = time.perf_counter()
            f.write(mine)
            merge_times.append(time.perf_counter() - start)

        merge_times: list[float] = []
        timed(merging_write, repeat)
        merge_s = benchlib.median(merge_times)
    total_s = load_s + compare_s + update_s + write_s
    return [
        [f"store.write, {count:,} entries", f"{write_s * 1e3:,.1f}", f"{size / 1e6:.2f} MB file"],
        [f"store.load, {count:,} entries", f"{load_s * 1e3:,.1f}", "parse + validate"],
        [f"compare.compare x {count:,}", f"{compare_s * 1e3:,.1f}", "every test against its entry"],
        [f"store.update, {count:,} entries", f"{update_s * 1e3:,.1f}", "all changed (load time subtracted)"],
        [f"load + compare + update + write, {count:,}", f"{total_s * 1e3:,.1f}", "one --gpumem-update run"],
        [
            f"store.write after another run wrote, {count:,}",
            f"{merge_s * 1e3:,.1f}",
            "re-read and merge under the lock",
        ],
    ]


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("scale of the report and the baseline store")
    p.add_argument("--tests", type=int, default=10_000, help="results / entries (default 10000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per operation, median taken (default 3)")
    args: argparse.Namespace = p.parse_args(argv)
    rows = report_rows(args.tests, args.repeat) + baseline_rows(args.tests, args.repeat)
    benchlib.show(f"scale: {args.tests:,} tests, median of {args.repeat}", ["operation", "ms", "notes"], rows)
    benchlib.write_json(args.json, {"scale": {"tests": args.tests, "rows": rows}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
