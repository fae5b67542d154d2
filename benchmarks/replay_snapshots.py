"""How exactly the allocator's model replays real cards' memory traces: every snapshot in a folder read,
its start walked back from the final segments, and its trace replayed with new segments at the card's
addresses (cuda_allocator_model.snapshots.agreement), per file and device:

    python benchmarks/replay_snapshots.py [DIR] [--json PATH] [--speed]

Columns: events, requests, segment decisions matched (new segments in brackets), placements matched,
reserved bytes matched after each request, peak reserved card/model (bytes; `=` when equal), where
recording began (empty, warm, or warm with a caveat: a ring buffer that may have wrapped), seconds to
read and to replay. `--speed` times a synthetic trace of 100,000 events (written by our own recorded
allocator model: `pytest_gpumem/backends/tracker/torch_snapshot.py`) read from bytes, walked back and
replayed. Without the folder the script says so and exits 0. No GPU is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout where the package is not installed
    sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402

from cuda_allocator_model.settings import AllocatorSettings  # noqa: E402
from cuda_allocator_model.snapshots import final  # noqa: E402
from cuda_allocator_model.snapshots.agreement import Agreement, agree  # noqa: E402
from cuda_allocator_model.snapshots.final import untraced  # noqa: E402
from cuda_allocator_model.snapshots.read import Snapshot, read_snapshot, snapshot_from_bytes  # noqa: E402
from cuda_allocator_model.snapshots.whatif import what_if  # noqa: E402
from pytest_gpumem.backends.tracker.torch_snapshot import RecordedModel, snapshot_of  # noqa: E402
from pytest_gpumem.errors import GpuMemError  # noqa: E402

SNAPSHOTS = ROOT.parent / "shared" / "snapshots"


def header(wide: int) -> str:
    return (
        f"{'file':<{wide}} {'events':>6} {'requests':>8} {'decisions':>14} {'placements':>10} {'reserved':>8} "
        f"{'peak reserved card/model':>26} {'start':<6} {'read s':>6} {'replay s':>8}"
    )


def row(name: str, a: Agreement, read_s: float, replay_s: float, wide: int) -> str:
    decided = f"{a.decisions_matched} ({a.new_segments})"
    peak = f"{a.peak_reserved_card}/" + (
        "=" if a.peak_reserved_model == a.peak_reserved_card else str(a.peak_reserved_model)
    )
    start = "empty" if a.start.empty else "warm" + ("*" if a.start.caveats else "")
    short = name.removesuffix(".pickle")
    return (
        f"{short:<{wide}} {a.events:>6} {a.requests:>8} {decided:>14} {a.placements_matched:>10} "
        f"{a.reserved_matched:>8} {peak:>26} {start:<6} {read_s:>6.2f} {replay_s:>8.3f}"
    )


def validate(folder: Path) -> list[dict[str, Any]]:
    wide = max(len(p.name.removesuffix(".pickle")) + 11 for p in folder.glob("*.pickle"))  # names never cut
    print(header(wide))
    results: list[dict[str, Any]] = []
    finals: list[tuple[str, Snapshot, float]] = []
    for path in sorted(folder.glob("*.pickle")):
        started = time.perf_counter()
        try:
            snapshot = read_snapshot(path)
        except GpuMemError as exc:
            print(f"{path.name:<{wide}} refused: {str(exc).split(': ', 1)[-1][:100]}")
            continue
        read_s = time.perf_counter() - started
        if untraced(snapshot):
            finals.append((path.name, snapshot, read_s))
            continue
        for device, trace in enumerate(snapshot.traces):
            if not trace:
                continue
            started = time.perf_counter()
            a = agree(snapshot, device)
            replay_s = time.perf_counter() - started
            print(row(path.name if device == 0 else f"{path.name} (device {device})", a, read_s, replay_s, wide))
            results.append(_figures(path.name, a, read_s, replay_s))
    print("(decisions: matched (the card's new segments); start warm*: may be a wrapped ring buffer)")
    _totals(results)
    _final_states(finals, wide)
    return results


def _final_states(finals: list[tuple[str, Snapshot, float]], wide: int) -> None:
    """The snapshots that hold a final state only: what the segments hold, and the live blocks allocated
    again on an empty cache by the model (as recorded)."""
    if not finals:
        return
    print(f"\n{'final state only':<{wide}} {'format':>6} {'segments':>8} {'reserved':>14} {'allocated':>14} "
          f"{'live':>6} {'again: reserved':>15} {'unalloc':>11} {'read s':>6}")  # fmt: skip
    for name, snapshot, read_s in finals:
        for device in final.final_devices(snapshot):
            total = final.totals(final.pools(snapshot, device))
            start = final.start_of(snapshot, device)
            settings = snapshot.allocator_settings or AllocatorSettings()
            again = what_if(final.without_trace(snapshot), settings, None, "as recorded", "unlimited", device, start)
            short = name.removesuffix(".pickle")
            print(
                f"{short:<{wide}} {snapshot.tier:>6} {total.segments:>8} {total.reserved:>14} {total.allocated:>14} "
                f"{total.live_blocks:>6} {again.peak_reserved:>15} {again.unallocated_at_peak:>11} {read_s:>6.2f}"
            )


def _figures(name: str, a: Agreement, read_s: float, replay_s: float) -> dict[str, Any]:
    return {
        "file": name, "device": a.device, "events": a.events, "requests": a.requests,
        "decisions_matched": a.decisions_matched, "new_segments": a.new_segments,
        "placements_matched": a.placements_matched, "reserved_matched": a.reserved_matched,
        "peak_reserved_card": a.peak_reserved_card, "peak_reserved_model": a.peak_reserved_model,
        "card_oom_at": a.card_oom_at, "model_oom_at": a.model_oom_at, "start_empty": a.start.empty,
        "start_caveats": list(a.start.caveats), "read_seconds": read_s, "replay_seconds": replay_s,
    }  # fmt: skip


def _totals(results: list[dict[str, Any]]) -> None:
    requests = sum(r["requests"] for r in results)
    decisions = sum(r["decisions_matched"] for r in results)
    placements = sum(r["placements_matched"] for r in results)
    reserved = sum(r["reserved_matched"] for r in results)
    peaks = sum(r["peak_reserved_card"] == r["peak_reserved_model"] for r in results)
    print(
        f"total: {len(results)} traces, {requests} requests; decisions {decisions}, placements {placements}, "
        f"reserved {reserved} matched; peak reserved equal in {peaks}/{len(results)}"
    )


def synthetic(events: int, seed: int = 0) -> bytes:
    """A from-empty snapshot of about `events` events from our recorded model: a training-like mix of
    request sizes (512 B to 64 MiB), most freed soon after, some kept."""
    rng = random.Random(seed)
    model = RecordedModel()
    sizes = [rng.choice((512, 4096, 65_536, 1 << 20, 3 << 20, 12 << 20, 40 << 20, 64 << 20)) for _ in range(64)]
    live: list[int] = []
    key = 0
    while len(model.events) < events:
        if live and (len(live) > 200 or rng.random() < 0.45):
            model.free(live.pop(rng.randrange(len(live))))
        else:
            key += 1
            model.malloc(key, rng.choice(sizes) - rng.randrange(512))
            live.append(key)
    return pickle.dumps(snapshot_of(model))


def speed(events: int, repeat: int = 5) -> dict[str, float]:
    """The best of `repeat` runs (a shared machine's other work only ever slows one down): seconds to read
    the bytes, and to walk back and replay; CPU seconds of the whole as well."""
    data = synthetic(events)
    runs = []
    for _ in range(repeat):
        started, cpu = time.perf_counter(), time.process_time()
        snapshot = snapshot_from_bytes(data, "synthetic")
        read = time.perf_counter()
        a = agree(snapshot)
        done = time.perf_counter()
        assert a.exact, "our own snapshot must replay exactly"
        runs.append((done - started, read - started, done - read, time.process_time() - cpu))
    total, read_s, replay_s, cpu_s = min(runs)
    print(
        f"speed (best of {repeat}): {len(snapshot.trace())} events ({a.requests} requests), read {read_s:.3f} s, "
        f"walked back and replayed {replay_s:.3f} s, total {total:.3f} s ({cpu_s:.3f} s CPU)"
    )
    return {"events": len(snapshot.trace()), "read_s": read_s, "replay_s": replay_s, "total_s": total, "cpu_s": cpu_s}


def _requests(sizes: list[int]) -> bytes:
    model = RecordedModel()
    for key, size in enumerate(sizes):
        model.malloc(key, size)
        if key >= 8:
            model.free(key - 8)
    return pickle.dumps(snapshot_of(model))


def against_speed(requests: int, folder: Path) -> float:
    """Seconds of `replay CARD --against OURS` (in this process) for `requests` requests of four sizes,
    where the prediction replaces one request in 1,000."""
    rng = random.Random(requests)
    sizes = [rng.choice((512, 4096, 1 << 20, 3 << 20)) for _ in range(requests)]
    card, ours = folder / f"card{requests}.pickle", folder / f"ours{requests}.pickle"
    card.write_bytes(_requests(sizes))
    ours.write_bytes(_requests([7 * 512 if i % 1000 == 500 else x for i, x in enumerate(sizes)]))
    from pytest_gpumem.cli import main as cli

    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["replay", str(card), "--against", str(ours)]) == 0
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the allocator's model replaying real cards' traces")
    p.add_argument("folder", nargs="?", type=Path, default=SNAPSHOTS, help=f"snapshots (default {SNAPSHOTS})")
    p.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write every figure as JSON")
    p.add_argument("--speed", action="store_true", help="also time a synthetic 100,000-event trace")
    args = p.parse_args(argv)
    results: list[dict[str, Any]] = []
    if args.folder.is_dir():
        results = validate(args.folder)
    else:
        print(f"replay_snapshots: no snapshots folder at {args.folder}; nothing to replay")
    timing: dict[str, Any] | None = dict(speed(100_000)) if args.speed else None
    if timing is not None:
        with tempfile.TemporaryDirectory() as folder:
            against = {n: against_speed(n, Path(folder)) for n in (5_000, 20_000, 100_000)}
        print("replay --against: " + ", ".join(f"{n:,} requests {s:.2f} s" for n, s in against.items()))
        timing["against_s"] = against
    benchlib.write_json(args.json, {"replay_snapshots": results, "speed": timing})
    return 0


if __name__ == "__main__":
    sys.exit(main())
