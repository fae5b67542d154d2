"""How close a meta prediction comes to real cards: the workloads of ../shared/snapshots, rebuilt as our own
code (benchmarks/workloads.py), predicted on the meta device by the tracker and its model of the caching
allocator, against the figures the cards' traces give (cuda_allocator_model.snapshots.replay).

    python benchmarks/validate_snapshots.py [--json PATH] [--snapshots DIR] [--only NAME] [--capacity CARD|SIZE]

One table: requests (ours/card), peak allocated and peak reserved (prediction, card, difference), and the
share of the card's request sizes that line up with ours (difflib.SequenceMatcher). Then, per workload, the
first requests that differ, with the card's frames (the first user Python frame, the C++ op) and ours (op,
line). The allocator model fed the card's own requests is given too: it separates the model's error from
the workload's. No GPU is needed; without the snapshots folder the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT, ROOT / "benchmarks"):
    if str(entry) not in sys.path:  # run from a checkout where the package is not installed
        sys.path.insert(0, str(entry))

import benchlib  # noqa: E402
import torch  # noqa: E402
from conv_workloads import nca_single_step, nca_whole_slide  # noqa: E402
from workloads import WORKLOADS, Record, Workload, scaled_attention  # noqa: E402

from cuda_allocator_model.cards import capacity_bytes  # noqa: E402
from cuda_allocator_model.snapshots.against import line_of, op_of  # noqa: E402
from cuda_allocator_model.snapshots.read import Event, read_snapshot  # noqa: E402
from cuda_allocator_model.snapshots.replay import CardFigures, replay  # noqa: E402
from pytest_gpumem.backends.base import Settings  # noqa: E402
from pytest_gpumem.backends.tracker.backend import TrackerBackend  # noqa: E402
from pytest_gpumem.errors import GpuMemError  # noqa: E402

SNAPSHOTS = ROOT.parent / "shared" / "snapshots"


@dataclass
class Prediction:
    """What the tracker predicted on meta, from the point where the card's recording began."""

    requests: list[dict[str, Any]]
    peak_allocated: int
    peak_requested: int
    peak_reserved: int
    seconds: float


@dataclass
class Comparison:
    name: str
    snapshot: str
    card: str | None
    from_empty: bool
    ours: dict[str, int]
    theirs: dict[str, int]
    aligned: float
    differences: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def conv_workloads() -> tuple[Workload, ...]:
    """The conv traces whose workloads can be rebuilt from their requests (`conv_workloads.py`): the plain
    PyTorch NCA step (depthwise 3x3, two 1x1 convolutions through cuDNN) and the OctreeNCA-2D whole-slide
    inference (5 levels, 70 steps). Not rebuilt: the custom CUDA layer's step (its kernel is not torch's), and
    the 3-D training run, whose model's configuration was a local file (CATALOG.md) and whose trace starts
    mid-run."""
    return (
        Workload(
            "conv NCA step",
            "HugePandaCoder__octree-nca-groupeq__traditional_single_step.pickle",
            nca_single_step,
            None,
        ),
        Workload(
            "conv NCA slide warm",
            "HugePandaCoder__octree-nca-groupeq__inference2_peso_oct.pickle",
            nca_whole_slide,
            None,
        ),
    )


def predict(workload: Workload, capacity: int | None = None) -> Prediction:
    """Run `workload` on meta under the tracker (CUDA rounding, the workload's card, the allocator held to
    `capacity` bytes where given), events recorded."""
    backend = TrackerBackend(device="meta")
    backend.predict_card(workload.card)
    backend.configure(Settings(events=True, capacity=capacity))
    mark = [0]

    def record() -> None:
        recorder = backend.ledger.recorder
        mark[0] = len(recorder.events or []) if recorder is not None else 0
        backend.reset_peak()

    started = time.perf_counter()
    backend.start()
    try:
        workload.run("meta", record)
        events = (backend.trace() or {}).get("events", [])
        peak = backend.peak()
    finally:
        backend.stop()
    requests = [e for e in events[mark[0] :] if e["action"] == "alloc"]
    reserved = peak.reserved or 0
    return Prediction(requests, peak.allocated, peak.requested, reserved, time.perf_counter() - started)


def compiled_attention(device: str, record: Record) -> None:
    """CS336's naive attention (`scaled_attention`) under torch.compile: Q, K, V = randn(8, 256, 16)
    requiring grad, forward only, its output dropped each step (so the graph's saved tensors go with it);
    5 warmup steps, then 100 recorded."""
    q, k, v = (torch.randn(8, 256, 16, device=device, requires_grad=True) for _ in range(3))
    compiled = torch.compile(scaled_attention)
    for step in range(105):
        if step == 5:
            record()
        out = compiled(q, k, v)
        del out


def compiled_workloads() -> tuple[Workload, ...]:
    """The compiled row: the one trace of a compiled step whose workload its frames and catalog give."""
    snapshot = "sungdk0822__CS336-assignment2-systems__attn_d16_s256_fwd_compile.pickle"
    return (Workload("compiled attn s256", snapshot, compiled_attention, None),)


Opcode = tuple[str, int, int, int, int]


def alignment(ours: Sequence[int], theirs: Sequence[int]) -> tuple[float, list[Opcode]]:
    """Share of the card's requests matched by ours in order, and the opcodes that turn ours into theirs."""
    matcher = difflib.SequenceMatcher(None, list(ours), list(theirs), autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    opcodes: list[Opcode] = list(matcher.get_opcodes())
    return (matched / len(theirs) if theirs else 1.0), opcodes


def differences(
    opcodes: list[Opcode], ours: list[dict[str, Any]], theirs: tuple[Event, ...], count: int
) -> list[dict[str, Any]]:
    """The first `count` kinds of differing runs of requests: the card's (size, op, user frame) against ours
    (size, op, line), each kind once with how often it recurs (`times`)."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            continue
        card = [
            {"index": j, "bytes": theirs[j].size, "user_frame": line_of(theirs[j]), "op": op_of(theirs[j])}
            for j in range(j1, min(j2, j1 + 3))
        ]
        mine = [
            {"index": i, "bytes": ours[i]["bytes"], "op": ours[i]["op"], "where": ours[i]["where"]}
            for i in range(i1, min(i2, i1 + 3))
        ]
        kind = (tag, tuple((r["bytes"], r["op"]) for r in card), tuple((r["bytes"], r["op"]) for r in mine))
        if kind in found:
            found[kind]["times"] += 1
        elif len(found) < count:
            found[kind] = {"kind": tag, "card": card, "ours": mine, "card_count": j2 - j1, "our_count": i2 - i1}
            found[kind]["times"] = 1
    return list(found.values())


def compare(workload: Workload, folder: Path, capacity: int | None = None) -> Comparison:
    started = time.perf_counter()
    snapshot = read_snapshot(folder / workload.snapshot)
    card: CardFigures = replay(snapshot)
    predicted = predict(workload, capacity)
    sizes = [r["bytes"] for r in predicted.requests]
    share, opcodes = alignment(sizes, [e.size for e in card.requests])
    ours = {
        "requests": len(sizes),
        "peak_allocated": predicted.peak_allocated,
        "peak_requested": predicted.peak_requested,
        "peak_reserved": predicted.peak_reserved,
    }
    theirs = {
        "requests": len(card.requests),
        "peak_allocated": card.peak_allocated,
        "peak_requested": card.peak_requested,
        "peak_reserved": card.peak_reserved,
        "model_peak_reserved": card.model_peak_reserved,
        "start_requested": card.start_requested,
        "start_reserved": card.start_reserved,
    }
    found = differences(opcodes, predicted.requests, card.requests, 4)
    return Comparison(
        workload.name,
        workload.snapshot,
        workload.card,
        card.from_empty,
        ours,
        theirs,
        share,
        found,
        time.perf_counter() - started,
    )


def percent(ours: int, theirs: int) -> str:
    return "n/a" if not theirs else f"{100.0 * (ours - theirs) / theirs:+.1f}%"


HEADER = (
    f"{'workload':<19} {'requests':>9} {'alloc ours':>11} {'alloc card':>11} {'diff':>7} "
    f"{'resv ours':>11} {'resv card':>11} {'diff':>7} {'align':>6}"
)


def row(c: Comparison) -> str:
    o, t = c.ours, c.theirs
    requests = f"{o['requests']}/{t['requests']}"
    return (
        f"{c.name[:19]:<19} {requests:>9} {o['peak_allocated']:>11} {t['peak_allocated']:>11} "
        f"{percent(o['peak_allocated'], t['peak_allocated']):>7} {o['peak_reserved']:>11} {t['peak_reserved']:>11} "
        f"{percent(o['peak_reserved'], t['peak_reserved']):>7} {100 * c.aligned:>5.1f}%"
    )


def details(c: Comparison) -> list[str]:
    """The lines under the table for one workload: what the model makes of the card's own requests, and the
    first differing requests."""
    t = c.theirs
    start = "from empty" if c.from_empty else f"warm ({t['start_requested']} B live at the start)"
    lines = [
        f"{c.name}: {c.snapshot[:48]}",
        f"  card {c.card or 'unknown'}, {start}",
        f"  peak requested: ours {c.ours['peak_requested']}, card {t['peak_requested']}",
    ]
    if c.from_empty:  # a warm trace's cache is not the model's empty one
        reserved = t["model_peak_reserved"]
        lines.append(
            f"  the allocator's model fed the card's requests reserves {reserved} "
            f"({percent(reserved, t['peak_reserved'])} against the card)"
        )
    for diff in c.differences:
        again = f" (x{diff['times']})" if diff["times"] > 1 else ""
        lines.append(f"  {diff['kind']}{again}: card {diff['card_count']} request(s), ours {diff['our_count']}")
        lines += [f"    card {r['bytes']:>11} {r['op']:<22} {r['user_frame'][:56]}" for r in diff["card"]]
        lines += [
            f"    ours {r['bytes']:>11} {str(r['op'])[:22]:<22} {str(r['where'] or '-')[-56:]}" for r in diff["ours"]
        ]
    if not c.differences:
        lines.append("  every request lines up")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="meta predictions against real cards' snapshots")
    p.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write every figure as JSON")
    p.add_argument("--snapshots", type=Path, default=SNAPSHOTS, help=f"the snapshots folder (default {SNAPSHOTS})")
    p.add_argument("--only", action="append", default=None, help="run only workloads whose name contains this")
    p.add_argument("--capacity", metavar="CARD|SIZE", default=None, help="hold the allocator's model to a card")
    args = p.parse_args(argv)
    try:
        capacity = None if args.capacity is None else capacity_bytes(args.capacity, "--capacity")
    except GpuMemError as exc:
        print(f"validate_snapshots: {exc}")
        return 2
    if not args.snapshots.is_dir():
        print(f"validate_snapshots: no snapshots folder at {args.snapshots}; nothing to compare")
        return 0
    started = time.perf_counter()
    every = (*WORKLOADS, *conv_workloads(), *compiled_workloads())
    chosen = [w for w in every if not args.only or any(part in w.name for part in args.only)]
    results = [compare(workload, args.snapshots, capacity) for workload in chosen]
    print(HEADER)
    for result in results:
        print(row(result))
    print("(bytes; diff = (ours - card) / card; align = share of the card's request sizes matched in order)")
    for result in results:
        print()
        print("\n".join(details(result)))
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    benchlib.write_json(args.json, {"validate_snapshots": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
