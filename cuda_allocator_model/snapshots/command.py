"""``pytest-gpumem replay SNAPSHOT``: a torch memory snapshot's trace replayed through the allocator's model,
how far the model agrees with the card, and the user's what-ifs side by side.

Agreement, per device: segment decisions, placements, reserved memory after each request, peak reserved
and the out-of-memory event (where the card's capacity can be derived from it). What-ifs: every
``--alloc-conf`` (on top of the snapshot's own PYTORCH_CUDA_ALLOC_CONF) under every ``--capacity``: peak
reserved, reserved but unallocated at that peak, and where it runs out. ``--json PATH`` writes every
figure, ``--html PATH`` a page with reserved and allocated memory over the trace per what-if.

Exit status: 0 replayed, 2 a file or an option that cannot be used (one line naming it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cuda_allocator_model.cards import parse_capacity
from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.sizes import format_size
from cuda_allocator_model.snapshots.agreement import Agreement, agree
from cuda_allocator_model.snapshots.read import Snapshot, read_snapshot
from cuda_allocator_model.snapshots.start import StartState
from cuda_allocator_model.snapshots.whatif import DeviceReplay, WhatIf, what_if

__all__ = ["add_parser", "run"]

Write = Callable[[Path, str], None]
Say = Callable[[str], None]
_RECORDED = "as recorded"
UNLIMITED = "unlimited"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The ``replay`` subcommand's options; the caller sets what it runs."""
    r = commands.add_parser("replay", help="replay a torch memory snapshot through the allocator's model")
    r.add_argument("snapshot", type=Path, metavar="SNAPSHOT", help="a torch.cuda.memory._dump_snapshot() pickle")
    r.add_argument(
        "--alloc-conf", action="append", type=alloc_conf, default=[], metavar="CONF",
        help="a what-if PYTORCH_CUDA_ALLOC_CONF on top of the snapshot's (repeatable)",
    )  # fmt: skip
    r.add_argument(
        "--capacity", action="append", type=capacity, default=[], metavar="CARD|SIZE",
        help="a what-if capacity: a card (H100-80GB), CARD:OUTSIDE or a size (repeatable; default unlimited)",
    )  # fmt: skip
    r.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every figure as JSON")
    r.add_argument("--html", type=Path, default=None, metavar="PATH", help="write a page of memory over the trace")
    r.add_argument(
        "--against", type=Path, default=None, metavar="PREDICTED",
        help="hold SNAPSHOT (a card's) against a prediction's (--gpumem-torch-snapshots): peaks, first differences",
    )  # fmt: skip
    return r


def alloc_conf(value: str) -> str:
    """A PYTORCH_CUDA_ALLOC_CONF value torch would accept, as given."""
    try:
        AllocatorSettings.parse(value)
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def capacity(value: str) -> str:
    """A capacity `parse_capacity` reads, as given."""
    try:
        parse_capacity(value)
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def run(args: argparse.Namespace, write: Write, say: Say) -> int:
    """Replay, print, write what was asked; ModelError (one line) for a file that is no snapshot."""
    snapshot = read_snapshot(args.snapshot)
    if args.against is not None:
        from cuda_allocator_model.snapshots.against import run_against

        return run_against(args, snapshot, write, say)
    replays = _replay_all(snapshot, args.alloc_conf, args.capacity)
    say(text(snapshot, replays))
    if args.json is not None:
        write(args.json, json_text(snapshot, replays))
    if args.html is not None:
        from cuda_allocator_model.snapshots.page import page

        write(args.html, page(snapshot, replays))
    return 0


def settings_for(snapshot: Snapshot, conf: str | None) -> AllocatorSettings:
    """The snapshot's settings, with `conf` read after its own PYTORCH_CUDA_ALLOC_CONF (later keys win)."""
    own = snapshot.allocator_settings or AllocatorSettings()
    if conf is None:
        return own
    joined = ",".join(part for part in (snapshot.alloc_conf, conf) if part)
    return AllocatorSettings.parse(joined, "--alloc-conf")


def _replay_all(snapshot: Snapshot, confs: Sequence[str], capacities: Sequence[str]) -> list[DeviceReplay]:
    """Agreement and what-ifs for every device that recorded a trace."""
    out = []
    for device, trace in enumerate(snapshot.traces):
        if not trace:
            continue
        agreement = agree(snapshot, device)
        caps: list[str | None] = [*capacities] or [None]
        outcomes = tuple(
            _what_if(snapshot, device, agreement.start, conf, cap) for conf in [None, *confs] for cap in caps
        )
        out.append(DeviceReplay(device, agreement, outcomes))
    return out


def _what_if(snapshot: Snapshot, device: int, start: StartState, conf: str | None, cap: str | None) -> WhatIf:
    settings = settings_for(snapshot, conf)
    limit = None if cap is None else parse_capacity(cap, "--capacity").bytes
    return what_if(snapshot, settings, limit, conf or _RECORDED, cap or UNLIMITED, device, start)


# ------------------------------------------------------------------------------------------- text


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole}" + (f" ({100 * part / whole:.2f}%)" if whole and part != whole else "")


def _size(n: int) -> str:
    return format_size(n)


def _agreement_lines(a: Agreement) -> list[str]:
    start = a.start
    began = (
        "from empty"
        if start.empty
        else f"warm: {len(start.segments)} segments ({_size(start.reserved)}), {len(start.live)} requests live"
    )
    lines = [
        f"device {a.device}: {a.events} events, {a.requests} requests; recording began {began}",
        f"  segment decisions {_share(a.decisions_matched, a.requests)} ({a.new_segments} new segments)",
        f"  placements {_share(a.placements_matched, a.requests)}",
        f"  reserved after each request {_share(a.reserved_matched, a.requests)}",
        f"  peak reserved: card {_size(a.peak_reserved_card)}, model {_size(a.peak_reserved_model)}",
    ]
    if a.card_oom_at is not None or a.model_oom_at is not None:
        cap = "" if a.capacity is None else f" (capacity {_size(a.capacity)} from the card's device_free)"
        lines.append(f"  out of memory: card at request {a.card_oom_at}, model at request {a.model_oom_at}{cap}")
    if a.releases_unmatched:
        lines.append(f"  {a.releases_unmatched} segment releases of the card the model could not follow")
    lines += [f"  start not exact: {caveat}" for caveat in start.caveats]
    if a.first_mismatch is not None:
        lines.append(f"  first request that differs: {a.first_mismatch}")
    return lines


_HEAD = f"{'setting':<24} {'capacity':<13} {'peak reserved':>13} {'unalloc@peak':>12}  runs out at: request size where"


def _runs_out(o: WhatIf) -> str:
    oom = o.out_of_memory
    if oom is None:
        return "no"
    if oom.request < 0:
        return f"the start, {_size(oom.size)} live"
    where = oom.frame.split(" ", 1)[0] if ".py:" in oom.frame else oom.frame  # the function name: in --json
    return f"#{oom.request} {_size(oom.size)} {where}"


def _card_row(a: Agreement) -> str:
    """The card itself, from its own cache at the start (the exact replay's figures)."""
    oom = "no" if a.card_oom_at is None else f"#{a.card_oom_at}"
    peak, unallocated = _size(a.peak_reserved_card), _size(a.unallocated_at_peak)
    return f"{'the card, as traced':<24} {'-':<13} {peak:>13} {unallocated:>12}  {oom}"


def _what_if_row(o: WhatIf) -> str:
    setting = o.setting if len(o.setting) <= 24 else o.setting[:23] + "~"
    row = f"{setting:<24} {o.capacity[:13]:<13} {_size(o.peak_reserved):>13} {_size(o.unallocated_at_peak):>12}  "
    row += _runs_out(o)
    return row if len(row) <= 100 else row[:99] + "~"


def text(snapshot: Snapshot, replays: Sequence[DeviceReplay]) -> str:
    settings = snapshot.allocator_settings
    conf = "not recorded (torch < 2.3): defaults" if settings is None else (snapshot.alloc_conf or "defaults")
    name = snapshot.path if len(snapshot.path) <= 100 else "..." + snapshot.path[-97:]
    lines = [name, f"format {snapshot.tier}, {len(replays)} device(s) traced, allocator settings {conf}"]
    for r in replays:
        lines += _agreement_lines(r.agreement)
        lines.append(f"what if (the {len(r.agreement.start.live)} requests live at the start on an empty cache):")
        lines.append(_HEAD)
        lines.append(_card_row(r.agreement))
        lines += [_what_if_row(o) for o in r.outcomes]
        ignored = sorted({key for o in r.outcomes for key in o.ignored})
        if ignored:
            lines.append(f"  not modelled, without effect here: {', '.join(ignored)}")
    if not replays:
        lines.append("no device recorded a trace")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- JSON


def _agreement_json(a: Agreement) -> dict[str, Any]:
    return {
        "events": a.events,
        "requests": a.requests,
        "decisions_matched": a.decisions_matched,
        "new_segments": a.new_segments,
        "placements_matched": a.placements_matched,
        "reserved_matched": a.reserved_matched,
        "peak_reserved_card": a.peak_reserved_card,
        "peak_reserved_model": a.peak_reserved_model,
        "unallocated_at_peak": a.unallocated_at_peak,
        "releases_unmatched": a.releases_unmatched,
        "card_oom_at": a.card_oom_at,
        "model_oom_at": a.model_oom_at,
        "capacity": a.capacity,
        "first_mismatch": a.first_mismatch,
        "start": {
            "empty": a.start.empty,
            "segments": len(a.start.segments),
            "reserved": a.start.reserved,
            "live_requests": len(a.start.live),
            "requested": a.start.requested,
            "caveats": list(a.start.caveats),
        },
    }


def _outcome_json(o: WhatIf) -> dict[str, Any]:
    oom = o.out_of_memory
    return {
        "setting": o.setting,
        "capacity": o.capacity,
        "peak_reserved": o.peak_reserved,
        "unallocated_at_peak": o.unallocated_at_peak,
        "peak_allocated": o.peak_allocated,
        "out_of_memory": None if oom is None else {"request": oom.request, "size": oom.size, "frame": oom.frame},
        "ignored": list(o.ignored),
    }


def json_text(snapshot: Snapshot, replays: Sequence[DeviceReplay]) -> str:
    doc = {
        "snapshot": snapshot.path,
        "format": snapshot.tier,
        "alloc_conf": snapshot.alloc_conf,
        "devices": [
            {
                "device": r.device,
                "agreement": _agreement_json(r.agreement),
                "what_if": [_outcome_json(o) for o in r.outcomes],
            }
            for r in replays
        ],
    }
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"
