"""Measured worlds: what starting one costs, and per-rank peaks of the reference distributed strategies
against their hand derivation (reference_losses/distributed.py; exact on the tracker).

Start-up: `gpumem.distributed(noop, N)` end to end (start N processes, forked from a server that imported
torch once, form the gloo group through a FileStore, run nothing, send the phases back, exit), median of
`--repeat` runs; the first world of the process also starts the server.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import benchlib

from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.distributed.world import Worlds
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring
from pytest_gpumem.measure.meter import GpuMem
from reference_losses.distributed import PHASES, STRATEGIES, expected, run_strategies, sizes

WORLD_SIZES = (2, 4)
DIST_TIMEOUT = 120.0  # seconds, the option's default


def noop(rank: int, world_size: int, meter: GpuMem) -> None:
    return None


def measured(fn: Any, world_size: int, args: tuple[Any, ...] = ()) -> tuple[float, GpuMem]:
    """Seconds for one measured world, and the meter holding its phases."""
    measured = Measurement(TrackerBackend(), f"benchmark {world_size} ranks", Worlds(DIST_TIMEOUT))
    with measuring(measured) as call:
        start = time.perf_counter()
        call.meter.distributed(fn, world_size, args=args)
        seconds = time.perf_counter() - start
    return seconds, call.meter


def startup(repeat: int) -> dict[int, list[float]]:
    return {n: [measured(noop, n)[0] for _ in range(repeat)] for n in WORLD_SIZES}


def peaks(scale: float) -> list[dict[str, Any]]:
    """Per strategy, world size, phase and rank: the tracker's peak and the hand derivation."""
    rows = []
    for n in WORLD_SIZES:
        _, meter = measured(run_strategies, n, (scale,))
        for strategy in STRATEGIES:
            derived = {e.phase: e.low for e in expected(strategy, sizes(scale, n)) if not e.net}
            for phase in PHASES:
                name = f"{strategy}.{phase}"
                got = [meter.result(f"{name}@rank{r}").requested_peak_bytes for r in range(n)]
                rows.append({"strategy": strategy, "ranks": n, "phase": phase, "hand": derived[name], "tracker": got})
    return rows


def main() -> None:
    p = benchlib.parser(__doc__ or "")
    p.add_argument("--repeat", type=int, default=3, help="worlds started per size (default 3)")
    p.add_argument("--scale", type=float, default=1.0, help="the Net's batch scale (default 1: 512 rows)")
    args = p.parse_args()
    times = startup(args.repeat)
    benchlib.show(
        f"start-up of a measured world (seconds, median of {args.repeat})",
        ["ranks", "median", "runs"],
        [[n, f"{statistics.median(t):.2f}", ", ".join(f"{s:.2f}" for s in t)] for n, t in times.items()],
    )
    rows = peaks(args.scale)
    benchlib.show(
        f"per-rank peaks, Net at scale {args.scale:g} (bytes; every rank)",
        ["strategy", "ranks", "phase", "hand", "tracker per rank", "tracker - hand"],
        [
            [r["strategy"], r["ranks"], r["phase"], f"{r['hand']:,}", ", ".join(f"{g:,}" for g in r["tracker"]),
             ", ".join(str(g - r["hand"]) for g in sorted(set(r["tracker"])))]
            for r in rows
        ],
    )  # fmt: skip
    benchlib.write_json(args.json, {"startup_seconds": {str(n): t for n, t in times.items()}, "peaks": rows})


if __name__ == "__main__":
    main()
