"""The JSON codec's speed: a baseline file of 2,000 entries read (`baselines.schema.loads`) and written
(`dumps`), an explanation of 20 phases and 400 points read (`Explanation.from_json`) and written, a
`--gpumem-json` report of 2,000 results read (`read_report`), here
and, with `--against DIR`, in another checkout of the package (its `pytest_gpumem` and
`cuda_allocator_model`, e.g. `git archive 8981745 pytest_gpumem cuda_allocator_model | tar -x -C DIR`).

The inputs are built here, with this checkout's types, and both sides read the same text (a stored file
is the same in every version). Each side runs in a worker process of its own; the rounds alternate
between them, one call each (of the explanation, 10 reads or writes), so that the load of a shared
machine falls on both alike. The ratio of a round's two calls, median over the rounds, is the figure.

    python benchmarks/json_codec.py --against /tmp/before [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENTRIES = 2_000
PHASES = 20
POINTS = 400
RESULTS = 2_000
CASES = ("baseline loads", "baseline dumps", "explanation read", "explanation write", "report read")
# the explanation's two x10


# ---------------------------------------------------------------------------------------- the inputs


def baseline_text() -> str:
    """A baseline file: 2,000 tests on one card, each with 3 phases, a composition (3 phases of 6
    categories and 8 parts), every other one a gradient fingerprint of 4 parameters."""
    from pytest_gpumem.baselines.schema import BaselineStore, dumps
    from pytest_gpumem.results.baseline import DeviceIdentity, Entry, Environment
    from pytest_gpumem.results.explanation import Cell, PhaseComposition
    from pytest_gpumem.results.gradients import Fingerprint, GradStats, ParamFingerprint

    card = DeviceIdentity("cuda", "NVIDIA H100 80GB HBM3", "9.0", 85_045_379_072)
    env = Environment("2.13.0", "12.8")
    categories = ("parameters", "gradients", "activations", "optimizer", "temporaries", "other")
    store = BaselineStore(Path("gpumem-baselines.json"))
    for i in range(ENTRIES):
        phases = {"forward": 1_000_000 + i, "backward": 2_000_000 + i, "optimizer": 500_000 + i}
        composition = {
            name: PhaseComposition(
                {c: (k + 1) * 4096 + i for k, c in enumerate(categories)},
                [Cell(categories[k % 6], f"layers.{k}", 1024 * (k + 1)) for k in range(8)],
                {"layers.*": 8},
            )
            for name in phases
        }
        gradients = None
        if i % 2 == 0:
            stats = GradStats(1.5 + i, 3.25, -0.125, 0.875, (0.5, -1.25, 0.75, 2.0, 1.125, -0.375, 0.0, 1.625))
            params = {f"layers.{k}.weight": ParamFingerprint((64, 32), "float32", stats) for k in range(4)}
            gradients = Fingerprint("torch-randn-f32/8/abc", params)
        entry = Entry.measured(card, env, 3_000_000 + i, phases, gradients, composition)
        store.put(f"tests/test_models.py::test_step[case{i:04d}]", entry)
    return dumps(store)


def explanation_json() -> str:
    """An explanation of 20 phases (8 categories, 12 modules, 30 cells and groups, 10 tensors, 4 spans
    each) and a timeline of 400 points."""
    from pytest_gpumem.results.explanation import (
        Cell,
        Explanation,
        PhaseExplanation,
        Point,
        ReservedAtPeak,
        SampledTimeline,
        Tensor,
    )

    categories = [f"category{k}" for k in range(8)]
    modules = [f"blocks.{k}.mlp" for k in range(12)]

    def phase(p: int) -> PhaseExplanation:
        cells = [Cell(categories[k % 8], modules[k % 12], 4096 * (k + 1)) for k in range(30)]
        tensors = [
            Tensor(8192 * (k + 1), "float32", (64, 32 * (k + 1)), "aten::mm", f"model.py:{k}", modules[k], "category0")
            for k in range(10)
        ]
        return PhaseExplanation(
            peak_bytes=10_000_000 + p,
            categories={c: 1000 * (k + 1) for k, c in enumerate(categories)},
            modules={m: 2000 * (k + 1) for k, m in enumerate(modules)},
            cells=cells,
            tensors=tensors,
            start_bytes=4096,
            live={c: 512 * (k + 1) for k, c in enumerate(categories)},
            groups=cells,
            peak_index=100 * p + 50,
            spans=[(100 * p + 10 * s, 100 * p + 10 * s + 5) for s in range(4)],
            entries=4,
            reserved_at_peak=ReservedAtPeak(20_971_520, 1_048_576, 524_288),
        )

    timeline = SampledTimeline(4000, [Point(10 * k, [1000 * k + c for c in range(8)]) for k in range(POINTS)])
    explanation = Explanation(
        nodeid="tests/test_models.py::test_step",
        backend="tracker",
        categories=categories,
        labels={c: c.upper() for c in categories},
        phases={f"phase{p}": phase(p) for p in range(PHASES)},
        timeline=timeline,
        folded={"blocks.*": 12},
    )
    return json.dumps(explanation.to_json())


def report_json() -> str:
    """A report of 2,000 results: each with its call and 2 phases (one a rank's), a budget, notes and
    detail; every other one compared with its baseline (2 peaks) and recorded, every tenth simulated."""
    from pytest_gpumem.results import PhaseResult, Status, TestResult
    from pytest_gpumem.results.baseline import BaselineStatus, DeviceIdentity, Entry, PhaseComparison, Verdict

    card = DeviceIdentity("tracker", "cpu")
    tests = []
    for i in range(RESULTS):
        nodeid = f"tests/test_models.py::test_step[case{i:04d}]"
        call = PhaseResult("call", 3_000_000 + i, 2_990_000 + i, 4_194_304, 512)
        phases = {
            "forward": PhaseResult("forward", 1_000_000 + i, 999_000 + i, None, 4096, count=2),
            "backward@rank1": PhaseResult("backward@rank1", 2_000_000 + i, 1_999_000, None, -4096, rank=1),
        }
        verdict = entry = None
        if i % 2 == 0:
            compared = (
                PhaseComparison(None, 3_000_000, 3_000_000 + i, 3_150_000, i / 30_000, BaselineStatus.OK),
                PhaseComparison("forward", 1_000_000, 1_000_000 + i, 1_050_000, i / 10_000, BaselineStatus.OK),
            )
            verdict = Verdict(nodeid, BaselineStatus.OK, compared, (), ("a note",))
            entry = Entry(card, 3_000_000 + i, {"forward": 1_000_000 + i}, "2.13.0", None)
        result = TestResult.of(
            nodeid,
            "tracker",
            "cpu",
            call,
            phases,
            budget_limits={"call": 4_000_000, "forward": None},
            budget_text="4 MB",
            status=Status.OK,
            detail=("line one", "line two"),
            info={"batch": i, "tags": ["a", "b"]},
            verdict=verdict,
            baseline_entry=entry,
            notes=("tracker: counted",),
            simulated=({"world_size": 8, "rank": i % 8},) if i % 10 == 0 else (),
        )
        tests.append(result.to_json())
    return json.dumps({"version": 1, "backend": "tracker", "device": "cpu", "commit": None, "tests": tests})


# ---------------------------------------------------------------------------------------- a worker


def worker(folder: Path) -> None:
    """Answer each case named on stdin with the seconds one call of it took (the inputs under `folder`)."""
    from pytest_gpumem.baselines.schema import dumps, loads
    from pytest_gpumem.results.explanation import Explanation
    from pytest_gpumem.results.report_file import read_report

    text = (folder / "baselines.json").read_text(encoding="utf-8")
    data = json.loads((folder / "explanation.json").read_text(encoding="utf-8"))
    store, explanation = loads(text, "baselines.json"), Explanation.from_json(data)
    calls: dict[str, Callable[[], Any]] = {
        "baseline loads": lambda: loads(text, "baselines.json"),
        "baseline dumps": lambda: dumps(store),
        "explanation read": lambda: [Explanation.from_json(data) for _ in range(10)],
        "explanation write": lambda: [explanation.to_json() for _ in range(10)],
        "report read": lambda: read_report(folder / "report.json"),
    }
    assert len(read_report(folder / "report.json").tests) == RESULTS, "the report does not read here"
    assert dumps(store) == text and explanation.to_json() == data, "the inputs do not round-trip here"
    for line in sys.stdin:
        call = calls[line.strip()]
        start = time.perf_counter()
        call()
        print(time.perf_counter() - start, flush=True)


class Side:
    """A worker process: this checkout's package, or the one at `root`."""

    def __init__(self, folder: Path, root: Path | None) -> None:
        env = dict(os.environ)
        if root is not None:
            env["PYTHONPATH"] = str(root)
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=folder,
        )

    def time(self, case: str) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(case + "\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", type=Path, default=None, help="a folder holding another pytest_gpumem")
    p.add_argument("--rounds", type=int, default=30, help="calls of each case on each side (default 30)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "baselines.json").write_text(baseline_text(), encoding="utf-8")
        (folder / "explanation.json").write_text(explanation_json(), encoding="utf-8")
        (folder / "report.json").write_text(report_json(), encoding="utf-8")
        sides = {"here": Side(folder, None)}
        if args.against is not None:
            sides["against"] = Side(folder, args.against.resolve())
        times: dict[tuple[str, str], list[float]] = {(s, c): [] for s in sides for c in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                for name, side in sides.items():
                    times[name, case].append(side.time(case))
        for side in sides.values():
            side.close()
    print(f"{'case':<20} " + " ".join(f"{name + ' ms (median, min-max)':>32}" for name in sides) + "   here/against")
    for case in CASES:
        cells = [
            f"{statistics.median(times[n, case]) * 1e3:9.2f} ({min(times[n, case]) * 1e3:.2f}-"
            f"{max(times[n, case]) * 1e3:.2f})"
            for n in sides
        ]
        ratio = ""
        if "against" in sides:  # each round's two calls ran one after the other: their ratio, median of them
            pairs = zip(times["here", case], times["against", case], strict=True)
            ratio = f"{statistics.median(here / against for here, against in pairs):.2f}x"
        print(f"{case:<20} " + " ".join(f"{cell:>32}" for cell in cells) + f"   {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
