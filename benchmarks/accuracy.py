"""Accuracy: the tracker's forward and backward peaks against the hand-derived bytes, MemTracker and the
CPU profiler's memory events, all in one run.

    python benchmarks/accuracy.py [--json PATH] [--scale 0.25] [--no-strategies]

What each tool counts (the reasons behind every difference in the table):
- hand: the tensors the math needs (float32 = 4 bytes), in the order autograd makes and frees them;
  for reference_losses strategies, the bounds their `expect()` derives (a range when low != high).
- tracker: every storage an ATen op creates below autograd, from creation to the death of its last
  reference; nothing else. Equal to "hand" whenever the derivation is right.
- MemTracker (torch.distributed._tools.mem_tracker): also a TorchDispatchMode counting storages, so on
  plain tensors it agrees with the tracker byte for byte. With modules it also counts their parameters
  (and buffers) from the first forward pre-hook unless they were passed to `track_external` first: the
  Net's forward then reads + 16,789,504 B, exactly its parameters, which existed before the phase.
- profiler (profile_memory=True): every call of the CPU allocator, also buffers that no ATen op returns:
  the 0-dim tensors C++ wraps Python scalars in (`x * 2`: +8 B, +4 B in backward), the RNG state that
  non-reentrant checkpoint saves with `torch.get_rng_state()` (5,056 B + 8), and kernel scratch (the bf16
  matrix-vector product on CPU converts to fp32 buffers: +132 KB forward, +68 KB backward). So it reads
  >= the tracker, and the difference is exactly what never becomes an op's output. Where such a buffer
  made before a phase (scalars and RNG state saved in forward) is freed in it, the profiler's running sum
  drops and a backward can read a little below the tracker (-8 B, -5,064 B).
- MemTracker refuses a module run twice in one tracking context (grad_accumulation): shown as failed.
"""

from __future__ import annotations

import argparse
from typing import Any

import benchlib
import torch
from benchlib import PHASES, Workload


def measure(workload: Workload) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Peaks per tool and phase, each tool on a freshly prepared copy; and the tools that could not run."""
    cpu = torch.device("cpu")
    tools = {
        "tracker": benchlib.tracker_peaks,
        "memtracker": benchlib.memtracker_peaks,
        "profiler": benchlib.profiler_peaks,
    }
    peaks: dict[str, dict[str, int]] = {}
    failed: dict[str, str] = {}
    for name, tool in tools.items():
        torch.manual_seed(0)
        try:
            peaks[name] = tool(workload.prepare(cpu))
        except Exception as exc:  # a tool's limitation is a result of the comparison
            peaks[name] = {}
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return peaks, failed


def _diff(value: int | None, reference: int | None) -> str:
    if value is None or reference is None:
        return "n/a"
    return f"{value - reference:+d}"


def _range(hand: int | tuple[int, int] | None) -> tuple[int, int] | None:
    return (hand, hand) if isinstance(hand, int) else hand


def _text(hand: int | tuple[int, int] | None) -> str:
    bounds = _range(hand)
    if bounds is None:
        return ""
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}..{bounds[1]}"


def explain(hand: int | tuple[int, int] | None, tracker: int, memtracker: int | None, profiler: int | None) -> str:
    """One note for the row: which differences there are and what they mean."""
    notes = []
    bounds = _range(hand)
    if bounds is not None and not bounds[0] <= tracker <= bounds[1]:
        notes.append(
            f"tracker outside hand bounds by {tracker - (bounds[0] if tracker < bounds[0] else bounds[1]):+d} B"
        )
    if memtracker is not None and memtracker != tracker:
        notes.append(f"MemTracker {memtracker - tracker:+d} B (module parameters counted from the first forward)")
    if profiler is not None and profiler != tracker:
        why = "buffers no op returns" if profiler > tracker else "frees of such buffers made earlier"
        notes.append(f"profiler {profiler - tracker:+d} B ({why})")
    return "; ".join(notes) or "all agree"


def rows_for(workload: Workload, peaks: dict[str, dict[str, int]], failed: dict[str, str]) -> list[list[Any]]:
    rows = []
    phases = [p for p in PHASES if p in peaks["tracker"]] + [p for p in peaks["tracker"] if p not in PHASES]
    for phase in phases:
        hand = workload.expected.get(phase)
        tracker = peaks["tracker"][phase]
        memtracker = peaks["memtracker"].get(phase)
        profiler = peaks["profiler"].get(phase)
        rows.append(
            [
                workload.name,
                phase,
                _text(hand),
                str(tracker),
                "" if memtracker is None else str(memtracker),
                "" if profiler is None else str(profiler),
                "; ".join(
                    [
                        explain(hand, tracker, memtracker, profiler),
                        *(f"{k} failed: {v[:60]}" for k, v in failed.items()),
                    ]
                ),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser(__doc__.splitlines()[0] if __doc__ else "accuracy")
    p.add_argument("--scale", type=float, default=0.25, help="reference_losses batch scale (default 0.25)")
    p.add_argument("--no-strategies", action="store_true", help="only the core workloads")
    args: argparse.Namespace = p.parse_args(argv)
    workloads = benchlib.core_workloads()
    strategies = [] if args.no_strategies else benchlib.strategy_workloads(args.scale)
    if not strategies and not args.no_strategies:
        print("reference_losses does not import here: core workloads only")
    rows: list[list[Any]] = []
    data: dict[str, Any] = {}
    for workload in [*workloads, *strategies]:
        peaks, failed = measure(workload)
        rows.extend(rows_for(workload, peaks, failed))
        data[workload.name] = {"hand": workload.expected, "why": workload.why, "failed": failed, **peaks}
    benchlib.show(
        "peak bytes per phase: hand-derived vs tracker vs MemTracker vs CPU profiler",
        ["workload", "phase", "hand", "tracker", "MemTracker", "profiler", "differences"],
        rows,
        [
            "hand = tensor bytes derived from the sizes (see benchlib.core_workloads / each strategy's expect())",
            "the tracker and MemTracker count tensor storages; the profiler counts every CPU allocator call",
        ],
    )
    benchlib.write_json(args.json, {"accuracy": data, "scale": args.scale})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
