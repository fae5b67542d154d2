"""The replay's page: reserved (solid) and allocated (dashed) memory over the trace's requests, one colour per
what-if, one chart per device, as inline SVG (no script, no network asset)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING

from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    from pytest_gpumem.snapshots.read import Snapshot
    from pytest_gpumem.snapshots.whatif import DeviceReplay

__all__ = ["final_page", "page"]

WIDTH, HEIGHT, LEFT, BOTTOM, POINTS = 900, 320, 80, 24, 600
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _bucketed(values: Sequence[int]) -> list[tuple[int, int]]:
    """(index, the largest value of its bucket): at most POINTS points, peaks kept."""
    step = max(1, -(-len(values) // POINTS))
    return [(i, max(values[i : i + step])) for i in range(0, len(values), step)]


def _line(values: Sequence[int], top: int, count: int, colour: str, dashed: bool) -> str:
    def x(i: int) -> float:
        return LEFT + (WIDTH - LEFT - 10) * i / max(count - 1, 1)

    def y(v: int) -> float:
        return 10 + (HEIGHT - BOTTOM - 10) * (1 - v / top)

    points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in _bucketed(values))
    dash = ' stroke-dasharray="4 3"' if dashed else ""
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{points}"/>'


def _chart(replay: DeviceReplay) -> str:
    outcomes = replay.outcomes
    top = max([1, *(max(o.reserved, default=0) for o in outcomes)])
    count = max([1, *(len(o.reserved) for o in outcomes)])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    parts.append(f'<text x="4" y="16" font-size="11">{escape(format_size(top))}</text>')
    parts.append(f'<text x="4" y="{HEIGHT - BOTTOM}" font-size="11">0</text>')
    parts.append(f'<text x="{WIDTH - 150}" y="{HEIGHT - 6}" font-size="11">requests ({count - 1})</text>')
    for i, o in enumerate(outcomes):
        colour = COLOURS[i % len(COLOURS)]
        parts.append(_line(o.reserved, top, count, colour, False))
        parts.append(_line(o.allocated, top, count, colour, True))
    parts.append("</svg>")
    legend = "".join(
        f'<li><span style="color:{COLOURS[i % len(COLOURS)]}">&#9632;</span> {escape(o.setting)}, '
        f"{escape(o.capacity)}: peak reserved {escape(format_size(o.peak_reserved))}</li>"
        for i, o in enumerate(outcomes)
    )
    head = f"<h2>device {replay.device}</h2><p>reserved: solid; allocated: dashed</p>"
    return head + "".join(parts) + f"<ul>{legend}</ul>"


def page(snapshot: Snapshot, replays: Sequence[DeviceReplay]) -> str:
    title = escape(f"replay of {snapshot.path}")
    body = "".join(_chart(r) for r in replays) or "<p>no device recorded a trace</p>"
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
