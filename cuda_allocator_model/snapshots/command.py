"""``pytest-gpumem replay SNAPSHOT``: a torch memory snapshot's trace replayed through the allocator's model,
how far the model agrees with the card, and the user's what-ifs side by side.

Agreement, per device: segment decisions, placements, reserved memory after each request, peak reserved,
the out-of-memory event (where the card's capacity can be derived from it) and, where a private pool
(MemPool, CUDA graph) held memory, each pool's reserved bytes at the end. What-ifs: every
``--alloc-conf`` (on top of the snapshot's own PYTORCH_CUDA_ALLOC_CONF) under every ``--capacity``: peak
reserved, reserved but unallocated at that peak, and where it runs out. ``--json PATH`` writes every
figure, ``--html PATH`` a page with reserved and allocated memory over the trace per what-if.

Exit status: 0 replayed, 2 a file or an option that cannot be used (one line naming it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda_allocator_model.cards import parse_capacity
from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.sizes import format_size
from cuda_allocator_model.snapshots import final
from cuda_allocator_model.snapshots.agreement import Agreement, agree
from cuda_allocator_model.snapshots.final import untraced
from cuda_allocator_model.snapshots.read import read_snapshot
from cuda_allocator_model.snapshots.records import Snapshot
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
    r.add_argument(
        "--device", type=_device, default=None, metavar="N",
        help="replay (or with --against, compare) device N only (default: every device traced)",
    )  # fmt: skip
    return r


def _device(value: str) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 4):
        raise argparse.ArgumentTypeError(f"a device index (0, 1, ...), got {value[:20]!r}")
    return int(value)


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
    _outputs_apart(args)
    for conf in args.alloc_conf:
        _fraction_of_a_card(conf, args.capacity)
    snapshot = read_snapshot(args.snapshot)
    if args.against is not None:
        from cuda_allocator_model.snapshots.against import run_against

        return run_against(args, snapshot, write, say)
    if untraced(snapshot):
        return _final_state(args, snapshot, write, say)
    replays = _replay_all(snapshot, args.alloc_conf, args.capacity, args.device)
    say(text(snapshot, replays))
    if args.json is not None:
        write(args.json, json_text(snapshot, replays))
    if args.html is not None:
        from cuda_allocator_model.snapshots.page import page

        write(args.html, page(snapshot, replays))
    return 0


def _outputs_apart(args: argparse.Namespace) -> None:
    """No output may be written over an input or over another output: refused before anything is read."""
    inputs = [("SNAPSHOT", args.snapshot), ("--against", args.against)]
    outputs = [("--json", args.json), ("--html", args.html)]
    named = [(flag, path) for flag, path in inputs if path is not None]
    for flag, path in outputs:
        if path is None:
            continue
        same = next((other for other, seen in named if _same_file(path, seen)), None)
        if same is not None:
            role = "the snapshot read" if same in ("SNAPSHOT", "--against") else f"{same}'s output too"
            raise ModelError(f"{flag} {path} is {role}; write it elsewhere")
        named.append((flag, path))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except (OSError, RuntimeError):  # a link loop, a path that cannot be resolved: not the same
        return False


def _fraction_of_a_card(conf: str, capacities: Sequence[str]) -> None:
    """per_process_memory_fraction takes a fraction of a card's total memory: every capacity must name one."""
    if AllocatorSettings.parse(conf, "--alloc-conf").per_process_memory_fraction >= 1.0:
        return
    bare = next((cap for cap in capacities if not parse_capacity(cap, "--capacity").on_a_card), None)
    if not capacities or bare is not None:
        got = f"--capacity {bare} is a size, not a card" if bare is not None else "no --capacity names a card"
        raise ModelError(
            f"--alloc-conf {conf}: per_process_memory_fraction is a share of a card's memory, but {got}: "
            "name one (--capacity H100-80GB, or TOTAL:OUTSIDE)"
        )


def settings_for(snapshot: Snapshot, conf: str | None) -> AllocatorSettings:
    """The snapshot's settings, with `conf` read after its own PYTORCH_CUDA_ALLOC_CONF (later keys win)."""
    own = snapshot.allocator_settings or AllocatorSettings()
    if conf is None:
        return own
    joined = ",".join(part for part in (snapshot.alloc_conf, conf) if part)
    return AllocatorSettings.parse(joined, "--alloc-conf")


def _replay_all(
    snapshot: Snapshot, confs: Sequence[str], capacities: Sequence[str], only: int | None = None
) -> list[DeviceReplay]:
    """Agreement and what-ifs for every device that recorded a trace (or device `only`)."""
    out = []
    for device, trace in enumerate(snapshot.traces):
        if not trace or (only is not None and device != only):
            continue
        agreement = agree(snapshot, device)
        caps: list[str | None] = [*capacities] or [None]
        derived = None if capacities else agreement.capacity  # the card's own, where it ran out
        outcomes = tuple(
            _what_if(snapshot, device, agreement.start, conf, cap, derived) for conf in [None, *confs] for cap in caps
        )
        out.append(DeviceReplay(device, agreement, outcomes))
    return out


def _what_if(
    snapshot: Snapshot, device: int, start: StartState, conf: str | None, cap: str | None, derived: int | None = None
) -> WhatIf:
    """One what-if; without a capacity named, the card's own where its trace ran out (`derived`), else none."""
    capacity = None if cap is None else parse_capacity(cap, "--capacity")
    settings = settings_for(snapshot, conf).on_card(None if capacity is None else capacity.total)
    limit = derived if capacity is None else capacity.bytes
    text = cap or (UNLIMITED if derived is None else f"the card's {_size(derived)}")
    return what_if(snapshot, settings, limit, conf or _RECORDED, text, device, start)


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
        f"  peak reserved: card {_size(a.peak_reserved_card)}, "
        f"model {_versus(a.peak_reserved_card, a.peak_reserved_model)}",
    ]
    if a.card_oom_at is not None or a.model_oom_at is not None:
        cap = "" if a.capacity is None else f" (capacity {_size(a.capacity)} from the card's device_free)"
        lines.append(f"  out of memory: card at request {a.card_oom_at}, model at request {a.model_oom_at}{cap}")
    if a.releases_unmatched:
        lines.append(f"  {a.releases_unmatched} segment releases of the card the model could not follow")
    lines += [f"  start not exact: {caveat}" for caveat in start.caveats]
    if a.first_mismatch is not None:
        lines.append(f"  first request that differs: {a.first_mismatch}")
    if a.pools:
        pools = (f"{final.pool_name(p.pool)} card {_size(p.card)}, model {_versus(p.card, p.model)}" for p in a.pools)
        lines.append(f"  reserved at the end, pools kept apart: {'; '.join(pools)}")
    return lines


_TAIL = f"{'peak reserved':>13} {'unalloc@peak':>12}  runs out at: request size where"


def _runs_out(o: WhatIf) -> str:
    oom = o.out_of_memory
    if oom is None:
        return "no"
    if oom.request < 0:
        return f"the start, {_size(oom.size)} live"
    where = oom.frame.split(" ", 1)[0] if ".py:" in oom.frame else oom.frame  # the function name: in --json
    return f"#{oom.request} {_size(oom.size)} {where}"


def _table(a: Agreement, outcomes: Sequence[WhatIf]) -> list[str]:
    """The card's own row, then one per what-if; settings and capacities in full, however long."""
    card = "the card, as traced"
    wide = max(len(card), *(len(o.setting) for o in outcomes))
    cap = max(len("capacity"), *(len(o.capacity) for o in outcomes))
    oom = "no" if a.card_oom_at is None else f"#{a.card_oom_at}"
    peak, unallocated = _size(a.peak_reserved_card), _size(a.unallocated_at_peak)
    lines = [
        f"{'setting':<{wide}} {'capacity':<{cap}} {_TAIL}",
        f"{card:<{wide}} {'-':<{cap}} {peak:>13} {unallocated:>12}  {oom}",
    ]
    for o in outcomes:
        figures = f"{_size(o.peak_reserved):>13} {_size(o.unallocated_at_peak):>12}"
        lines.append(f"{o.setting:<{wide}} {o.capacity:<{cap}} {figures}  {_runs_out(o)}")
    return lines


def _versus(card: int, model: int) -> str:
    """The model's figure beside the card's: 'equal' (to the byte), or the model's with its difference."""
    if card == model:
        return "equal"
    sign = "+" if model > card else "-"
    return f"{_size(model)} ({sign}{_size(abs(model - card))}, {model - card:+,} B)"


def text(snapshot: Snapshot, replays: Sequence[DeviceReplay]) -> str:
    settings = snapshot.allocator_settings
    conf = "not recorded (torch < 2.3): defaults" if settings is None else (snapshot.alloc_conf or "defaults")
    lines = [snapshot.path, f"format {snapshot.tier}, {len(replays)} device(s) traced, allocator settings {conf}"]
    for r in replays:
        lines += _agreement_lines(r.agreement)
        if r.agreement.pools and snapshot.pools_inferred:
            lines.append("  the trace has no pool_id: each entry is in the pool of the segment that held its address")
        lines.append(f"what if (the {len(r.agreement.start.live)} requests live at the start on an empty cache):")
        lines += _table(r.agreement, r.outcomes)
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
        "pools_at_end": [{"pool": list(p.pool), "card_reserved": p.card, "model_reserved": p.model} for p in a.pools],
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
        "pools_inferred": snapshot.pools_inferred,
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


# ------------------------------------------------------------------------------- a final state only


@dataclass(frozen=True)
class FinalDevice:
    """One device of a snapshot that holds its final state only."""

    device: int
    pools: list[final.PoolState]
    by_frame: list[final.Holder]
    by_size: list[final.Holder]
    outcomes: tuple[WhatIf, ...]
    capacities: dict[str, int]  # the bytes of each capacity named


def _final_state(args: argparse.Namespace, snapshot: Snapshot, write: Write, say: Say) -> int:
    devices = [d for d in final.final_devices(snapshot) if args.device is None or d == args.device]
    bare = final.without_trace(snapshot)
    caps: list[str | None] = [*args.capacity] or [None]
    sized = {cap: parse_capacity(cap, "--capacity").bytes for cap in args.capacity}
    sections = []
    for d in devices:
        start = final.start_of(snapshot, d)
        outcomes = tuple(_what_if(bare, d, start, conf, cap) for conf in [None, *args.alloc_conf] for cap in caps)
        by_frame, by_size = final.held_by(snapshot, d)
        sections.append(FinalDevice(d, final.pools(snapshot, d), by_frame, by_size, outcomes, sized))
    say(final_text(snapshot, sections))
    if args.json is not None:
        write(args.json, final_json(snapshot, sections))
    if args.html is not None:
        from cuda_allocator_model.snapshots.page import final_page

        write(args.html, final_page(snapshot, final_text(snapshot, sections)))
    return 0


def _final_rows(section: FinalDevice) -> list[str]:
    outcomes = section.outcomes
    total = final.totals(section.pools)
    wide = max(len("the card, at its end"), *(len(o.setting) for o in outcomes))
    cap = max(len("capacity"), *(len(o.capacity) for o in outcomes))
    head = f"{'setting':<{wide}} {'capacity':<{cap}} {'reserved':>10} {'unallocated':>11} {'headroom':>10}  runs out"
    unallocated = total.reserved - total.allocated
    lines = [
        head,
        f"{'the card, at its end':<{wide}} {'-':<{cap}} {_size(total.reserved):>10} {_size(unallocated):>11}",
    ]
    for o in outcomes:
        limit = section.capacities.get(o.capacity)
        room = "-" if limit is None or o.out_of_memory else _size(limit - o.peak_reserved)
        oom = "no" if o.out_of_memory is None else f"yes, at a live block of {_size(o.out_of_memory.size)}"
        figures = f"{_size(o.peak_reserved):>10} {_size(o.unallocated_at_peak):>11} {room:>10}"
        lines.append(f"{o.setting:<{wide}} {o.capacity:<{cap}} {figures}  {oom}")
    return lines


def final_text(snapshot: Snapshot, sections: Sequence[FinalDevice]) -> str:
    settings = snapshot.allocator_settings
    conf = "not recorded (torch < 2.3): defaults" if settings is None else (snapshot.alloc_conf or "defaults")
    lines = [
        snapshot.path,
        f"format {snapshot.tier}, the final state only (no request traced), allocator settings {conf}",
    ]
    for section in sections:
        lines.append(f"device {section.device}:")
        if len(section.pools) > 1:
            lines += final.state_lines(final.totals(section.pools), "all pools")
        for state in section.pools:
            lines += final.state_lines(state, final.pool_name(state.pool))
        lines += final.holder_lines("live blocks by the user frame that allocated them", section.by_frame)
        lines += final.holder_lines("live blocks by size", section.by_size)
        live = sum(p.live_blocks for p in section.pools)
        lines.append(f"what if the {live} live blocks were allocated again, in address order, on an empty cache:")
        lines += _final_rows(section)
    if not sections:
        lines.append("no device holds a segment")
    return "\n".join(lines)


def final_json(snapshot: Snapshot, sections: Sequence[FinalDevice]) -> str:
    doc = {
        "snapshot": snapshot.path,
        "format": snapshot.tier,
        "final_state_only": True,
        "alloc_conf": snapshot.alloc_conf,
        "devices": [
            {
                "device": s.device,
                "all_pools": final.state_json(final.totals(s.pools)),
                "pools": [final.state_json(p) for p in s.pools],
                "by_frame": final.holders_json(s.by_frame),
                "by_size": final.holders_json(s.by_size),
                "what_if": [
                    {**_outcome_json(o), "headroom": None if o.out_of_memory or o.capacity not in s.capacities
                     else s.capacities[o.capacity] - o.peak_reserved}
                    for o in s.outcomes
                ],
            }
            for s in sections
        ],
    }  # fmt: skip
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"
