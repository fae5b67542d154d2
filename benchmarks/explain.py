"""What explaining a peak costs, and that it explains the measured figure exactly.

    python benchmarks/explain.py [--json PATH] [--rounds 5] [--scale 1]

Each reference_losses strategy (and the core workloads) is run measured on the tracker as a test's call
is, once with the peaks explained and once without, interleaved; the ratio is the median time with over
the median time without. Every explained phase's parts must add up to its measured peak (checked).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import benchlib
import torch

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring
from pytest_gpumem.measure.record import CallRecord


def measured(run: benchlib.Run, explain: bool) -> CallRecord:
    backend = TrackerBackend()
    backend.configure(Settings(None, origins=False, events=False, explain=explain))
    measurement = Measurement(backend, "bench")
    measurement.hold_to(leak_check=False, explain=explain)
    with measuring(measurement) as call:
        run(call.meter)
    return call.record


def exact(record: CallRecord) -> bool:
    assert record.explanation is not None
    phases = record.explanation.phases
    figures = {"call": record.call, **record.phases}
    return all(sum(phases[n].categories.values()) == r.peak_bytes for n, r in figures.items())


def timed(run: benchlib.Run, explain: bool) -> float:
    def once() -> None:
        measured(run, explain)

    return benchlib.per_call(once, 1)


def main() -> None:
    p = benchlib.parser(__doc__ or "")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0)
    args = p.parse_args()
    rows: list[list[Any]] = []
    figures: dict[str, Any] = {}
    for workload in [*benchlib.core_workloads(), *benchlib.strategy_workloads(args.scale)]:
        run = workload.prepare(torch.device("cpu"))
        meter = measured(run, explain=True)
        candidates: dict[str, Callable[[], float]] = {
            "off": functools.partial(timed, run, False),
            "on": functools.partial(timed, run, True),
        }
        times = benchlib.interleaved(candidates, args.rounds)
        off, on = benchlib.median(times["off"]), benchlib.median(times["on"])
        figures[workload.name] = {"off_s": off, "on_s": on, "ratio": on / off, "exact": exact(meter)}
        rows.append([workload.name, f"{off * 1000:.1f}", f"{on * 1000:.1f}", f"{on / off:.2f}", exact(meter)])
    ratios = sorted(f["ratio"] for f in figures.values())
    benchlib.show(
        "explaining the peaks: time of one measured run (ms), median of interleaved rounds",
        ["workload", "explain off", "explain on", "ratio", "parts add up"],
        rows,
        [f"median ratio {benchlib.median(ratios):.2f}, worst {ratios[-1]:.2f}, over {len(ratios)} workloads"],
    )
    benchlib.write_json(args.json, {"explain": figures})


if __name__ == "__main__":
    main()
