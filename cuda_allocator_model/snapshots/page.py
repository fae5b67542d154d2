"""The replay's page: reserved (solid) and allocated (dashed) memory over the trace's requests, one colour per
what-if, one chart per device, as inline SVG (no script, no network asset). The card's own reserved memory
(from its trace) is drawn in black, each capacity named is a dotted line with its name, and where a what-if
runs out is marked on its line and said in the legend."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING

from cuda_allocator_model.chart import PlotArea
from cuda_allocator_model.sizes import format_size

if TYPE_CHECKING:
    from cuda_allocator_model.snapshots.records import Snapshot
    from cuda_allocator_model.snapshots.whatif import DeviceReplay, WhatIf

__all__ = ["final_page", "page"]

WIDTH, HEIGHT, LEFT, BOTTOM, POINTS = 900, 320, 80, 24, 600
_AREA = PlotArea(LEFT, WIDTH - 10, 10, HEIGHT - BOTTOM)
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _bucketed(values: Sequence[int]) -> list[tuple[int, int]]:
    """(index, the largest value of its bucket): at most POINTS points, peaks kept."""
    step = max(1, -(-len(values) // POINTS))
    return [(i, max(values[i : i + step])) for i in range(0, len(values), step)]


def _line(values: Sequence[int], top: int, count: int, colour: str, dashed: bool) -> str:
    points = " ".join(f"{_x(i, count):.1f},{_y(v, top):.1f}" for i, v in _bucketed(values))
    dash = ' stroke-dasharray="4 3"' if dashed else ""
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{points}"/>'


def card_reserved(snapshot: Snapshot, device: int, start: int) -> list[int]:
    """The card's reserved bytes when recording began, then after each request (from its segment events)."""
    reserved, out = start, [start]
    for e in snapshot.trace(device):
        if e.action in ("segment_alloc", "segment_map"):
            reserved += e.size
        elif e.action in ("segment_free", "segment_unmap"):
            reserved -= e.size
        elif e.action == "alloc":
            out.append(reserved)
    return out


def _capacities(outcomes: Sequence[WhatIf]) -> dict[str, int]:
    return {o.capacity: o.limit for o in outcomes if o.limit is not None}


def _chart(snapshot: Snapshot, replay: DeviceReplay) -> str:
    outcomes = replay.outcomes
    card = card_reserved(snapshot, replay.device, replay.agreement.start.reserved)
    limits = _capacities(outcomes)
    top = max([1, max(card), *limits.values(), *(max(o.reserved, default=0) for o in outcomes)])
    count = max([len(card), *(len(o.reserved) for o in outcomes)])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    parts.append(f'<text x="4" y="16" font-size="11">{escape(format_size(top))}</text>')
    parts.append(f'<text x="4" y="{HEIGHT - BOTTOM}" font-size="11">0</text>')
    parts.append(f'<text x="{WIDTH - 150}" y="{HEIGHT - 6}" font-size="11">requests ({count - 1})</text>')
    for name, limit in limits.items():
        y = _y(limit, top)
        parts.append(
            f'<line x1="{LEFT}" x2="{_AREA.right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#555" stroke-dasharray="1 3"/>'
        )
        parts.append(
            f'<text x="{LEFT + 4}" y="{y - 3:.1f}" font-size="11">{escape(name)}: {escape(format_size(limit))}</text>'
        )
    parts.append(_line(card, top, count, "#000000", False))
    for i, o in enumerate(outcomes):
        colour = COLOURS[i % len(COLOURS)]
        parts.append(_line(o.reserved, top, count, colour, False))
        parts.append(_line(o.allocated, top, count, colour, True))
        if o.out_of_memory is not None and o.reserved:
            x, y = _x(len(o.reserved) - 1, count), _y(o.reserved[-1], top)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="none" stroke="{colour}" stroke-width="2"/>')
    parts.append("</svg>")
    legend = [f"<li><span>&#9632;</span> the card, as traced: peak reserved {escape(_exact(max(card)))}</li>"]
    legend += [
        f'<li><span style="color:{COLOURS[i % len(COLOURS)]}">&#9632;</span> {escape(o.setting)}, '
        f"{escape(o.capacity)}: peak reserved {escape(_exact(o.peak_reserved))}{escape(_ran_out(o))}</li>"
        for i, o in enumerate(outcomes)
    ]
    head = f"<h2>device {replay.device}</h2><p>reserved: solid; allocated: dashed; a circle: where it runs out</p>"
    return head + "".join(parts) + f"<ul>{''.join(legend)}</ul>"


def _exact(n: int) -> str:
    return f"{format_size(n)} ({n:,} B)"


def _ran_out(o: WhatIf) -> str:
    oom = o.out_of_memory
    if oom is None:
        return ""
    where = "a request live at the start" if oom.request < 0 else f"request #{oom.request}"
    return f"; runs out at {where}, {format_size(oom.size)} ({oom.frame})"


def _x(i: int, count: int) -> float:
    return _AREA.x(i / max(count - 1, 1))


def _y(v: int, top: int) -> float:
    return _AREA.y(v, 0, top)


def page(snapshot: Snapshot, replays: Sequence[DeviceReplay]) -> str:
    title = escape(f"replay of {snapshot.path}")
    body = "".join(_chart(snapshot, r) for r in replays) or "<p>no device recorded a trace</p>"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
        f'<body style="font-family:sans-serif"><h1>{title}</h1>{body}</body></html>\n'
    )


def final_page(snapshot: Snapshot, text: str) -> str:
    """A final state's page: the figures as the terminal shows them (no trace to draw)."""
    title = escape(f"final state of {snapshot.path}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
        f'<body style="font-family:sans-serif"><h1>{title}</h1><pre>{escape(text)}</pre></body></html>\n'
    )
