"""``--html FILE``: the history as one self-contained page. For each of the tests that grew most, a chart:
a panel per phase that changed, its peak over the commits as a step line on its own byte axis, each step
marked with its commit (hash and date under the axis, the subject and the figures on hover); then a
table of every other test, sorted like the terminal table.

Why a panel per phase: a test's phases differ in size (a whole call of 1 GiB, a step of 4 MiB), so on one
axis a small phase's steps are flat; on its own axis each step shows. Why charts for the top N only: a
page of 500 charts of 1,000 commits would weigh megabytes and bury the few tests that moved; the table
keeps every test on the page, one line each, with its sparkline.

The charts are SVG drawn here (no script: the page's policy allows only its own stylesheet), the markup
is the jinja2 template ``report/templates/history.html.j2``, the stylesheet ``report/static/history.css``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import jinja2

from cuda_allocator_model import PlotArea, byte_range, format_size
from pytest_gpumem.history.git import Commit
from pytest_gpumem.history.series import Gate, Series, Step, growth_text, signed
from pytest_gpumem.history.table import groups, sparkline
from pytest_gpumem.report import assets

__all__ = ["render"]

WIDTH, HEIGHT = 400, 180  # a panel's viewBox: three side by side at 1280 px, about 1:1
LEFT, RIGHT, TOP, BOTTOM = 66, 14, 10, 36
_AREA = PlotArea(LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM)
LABEL_WIDTH, LABEL_SPACE = 60, 6  # a commit label (its date, 10 px, is the wider line) and the room between two
_PHASE_CLASSES = 8  # the stylesheet's line colours, c0 (the whole call) to c7, repeating past the last

_Group = tuple[str, str, list[Series]]
_Label = tuple[float, str, str, str, str]
"""Where a commit label is (x), how it is anchored there, the short hash, the date and the hover text."""


@dataclass(frozen=True)
class _Assets:
    environment: jinja2.Environment
    css: str
    csp: str


@cache
def _assets() -> _Assets:
    """The template and stylesheet shipped beside the explanation page's, and a policy that lets the page
    load nothing and use only this stylesheet."""
    css = assets.static("history.css")
    return _Assets(assets.environment(), css, f"default-src 'none'; style-src {assets.sha256(css)}")


def render(
    file: str,
    series: Sequence[Series],
    commits: Sequence[Commit],
    notes: Sequence[str],
    top: int,
    gate: Gate | None = None,
) -> str:
    """The page: ``commits`` is the x axis (oldest first: every commit a point of a series is at), the
    ``top`` tests that changed most get a chart, ``notes`` (what was skipped) are listed, and a test whose
    phase broke ``gate`` says so."""
    shipped = _assets()
    axis = {c.sha: i for i, c in enumerate(commits)}
    found = groups(series)
    charted = [g for g in found if any(s.steps for s in g[2])][:top]
    rest = [g for g in found if g not in charted]
    return shipped.environment.get_template("history.html.j2").render(
        csp=shipped.csp,
        css=shipped.css,
        file=file,
        summary=_summary(found, commits, len(charted)),
        notes=list(notes),
        charts=[_chart(i, group, axis, gate) for i, group in enumerate(charted)],
        rest=[_row(members) for _, _, members in rest],
    )


def _summary(found: Sequence[_Group], commits: Sequence[Commit], charted: int) -> str:
    if not commits:
        return "No baselines in the file's committed versions."
    span = f"{len(commits)} commits, {commits[0].short} ({commits[0].date}) to {commits[-1].short} ({commits[-1].date})"
    changed = sum(1 for _, _, members in found if any(s.steps for s in members))
    shown = (
        f"the {charted} that grew most are charted" if charted < changed else "each is charted, largest growth first"
    )
    rest = "; the others are in the table" if len(found) > charted else ""
    return f"{span}. Of {len(found):,} tests (each device's figures apart), {changed:,} changed: {shown}{rest}."


def _row(members: list[Series]) -> dict[str, Any]:
    """A table line: the test's phase that grew most (the first: the series come sorted)."""
    s = members[0]
    largest = s.largest
    return {
        "nodeid": s.nodeid,
        "device": s.device,
        "phase": s.phase,
        "first": format_size(s.first),
        "latest": format_size(s.latest),
        "change": signed(s.change),
        "growth": growth_text(s),
        "steps": len(s.steps),
        "largest": "-" if largest is None else signed(largest.change),
        "commit": "-" if largest is None else largest.commit.describe(),
        "spark": sparkline([p.value for p in s.points]),
    }


def _chart(index: int, group: _Group, axis: dict[str, int], gate: Gate | None) -> dict[str, Any]:
    """One test's chart: a panel per phase that changed (on one commit axis), the others in a line, and
    the commits that changed a figure as a table."""
    nodeid, device, members = group
    commits = sorted({p.commit for s in members for p in s.points}, key=lambda c: axis[c.sha])
    first, last = axis[commits[0].sha], axis[commits[-1].sha]

    def x(commit: Commit) -> float:
        return _AREA.x((axis[commit.sha] - first) / max(1, last - first))

    over = [s.phase for s in members if gate is not None and gate.broke(s)]
    steady = [f"{s.phase} {format_size(s.latest)}" for s in members if not s.steps]
    return {
        "id": f"t{index}",
        "nodeid": nodeid,
        "device": device,
        "over": f"grew more than {gate.tolerance.describe()}: {', '.join(over)}" if gate and over else "",
        "panels": [_panel(k, s, x) for k, s in enumerate(members) if s.steps],
        "steady": f"unchanged: {', '.join(steady)}" if steady else "",
        "steps": [(c.short, c.date, c.subject, _changes(changes)) for c, changes in _steps_by_commit(members, axis)],
    }


def _panel(k: int, s: Series, x: Callable[[Commit], float]) -> dict[str, Any]:
    """One phase: its title and figures, its byte axis, its step line, and at each step a guide, a dot
    and the commit's label (where there is room)."""
    low, high, marks = byte_range(min(p.value for p in s.points), max(p.value for p in s.points))

    def y(value: float) -> float:
        return _AREA.y(value, low, high)

    points = s.points
    path = [f"M{x(points[0].commit):.1f} {y(points[0].value):.1f}"]
    path += [f"H{x(point.commit):.1f}V{y(point.value):.1f}" for point in points[1:]]
    titles = [f"{st.commit.describe()}\n{_change(s, st)}" for st in s.steps]
    steps = f"{len(s.steps)} step{'' if len(s.steps) == 1 else 's'}"
    return {
        "colour": f"c{k % _PHASE_CLASSES}",
        "phase": s.phase,
        "figures": f"{format_size(s.first)} -> {format_size(s.latest)} ({growth_text(s)}, {steps})",
        "width": WIDTH,
        "height": HEIGHT,
        "plot": {"left": _AREA.left, "right": _AREA.right, "top": _AREA.top, "bottom": _AREA.bottom},
        "yticks": [(round(y(mark), 1), text) for mark, text in marks],
        "path": "".join(path),
        "dots": [(round(x(st.commit), 1), round(y(st.after), 1), t) for st, t in zip(s.steps, titles, strict=True)],
        "guides": [(round(x(st.commit), 1), t) for st, t in zip(s.steps, titles, strict=True)],
        "labels": _labels(s, x),
    }


def _steps_by_commit(members: list[Series], axis: dict[str, int]) -> list[tuple[Commit, list[tuple[Series, Step]]]]:
    """The commits that changed a figure of the test, in history order, with each phase's step there."""
    found: dict[str, tuple[Commit, list[tuple[Series, Step]]]] = {}
    for s in members:
        for step in s.steps:
            found.setdefault(step.commit.sha, (step.commit, []))[1].append((s, step))
    return sorted(found.values(), key=lambda item: axis[item[0].sha])


def _labels(s: Series, x: Callable[[Commit], float]) -> list[_Label]:
    """Commit labels under the axis, none over another: the last commit's, the largest step's and the
    first's always (one that would cover another moved aside, to the nearest free place), then the
    other steps' where there is room, left to right."""
    placed: list[_Label] = []
    largest = s.largest
    kept = [s.points[-1].commit, *([largest.commit] if largest else []), s.points[0].commit]
    for commit in dict.fromkeys(kept):
        natural = _left(x(commit))
        left = _nearest_free(natural, placed)
        placed.append(_label(commit, x(commit)) if left == natural else _label(commit, left, "start"))
    for commit in sorted({st.commit for st in s.steps} - set(kept), key=x):
        natural = _left(x(commit))
        if _nearest_free(natural, placed) == natural:
            placed.append(_label(commit, x(commit)))
    return sorted(placed, key=lambda label: label[0])


def _anchor(at: float) -> str:
    """A label near an edge is aligned to end there rather than cross it."""
    return "start" if at < LEFT + LABEL_WIDTH / 2 else "end" if at > WIDTH - LABEL_WIDTH / 2 else "middle"


def _left(at: float, anchor: str | None = None) -> float:
    return at - {"start": 0, "middle": LABEL_WIDTH / 2, "end": LABEL_WIDTH}[anchor or _anchor(at)]


def _label(commit: Commit, at: float, anchor: str | None = None) -> _Label:
    return (round(at, 1), anchor or _anchor(at), commit.short, commit.date, commit.describe())


def _nearest_free(left: float, placed: Sequence[_Label]) -> float:
    """The left edge nearest to ``left`` where a label covers none of ``placed`` and stays in the panel."""
    boxes = [_left(at, anchor) for at, anchor, *_ in placed]

    def free(edge: float) -> bool:
        inside = 0 <= edge <= WIDTH - LABEL_WIDTH
        return inside and all(abs(edge - other) >= LABEL_WIDTH + LABEL_SPACE for other in boxes)

    edges = [left, *(b + sign * (LABEL_WIDTH + LABEL_SPACE) for b in boxes for sign in (-1, 1))]
    return min((edge for edge in edges if free(edge)), key=lambda edge: abs(edge - left), default=left)


def _change(s: Series, step: Step) -> str:
    return f"{s.phase}: {format_size(step.before)} -> {format_size(step.after)} ({signed(step.change)})"


def _changes(changes: list[tuple[Series, Step]]) -> str:
    return ", ".join(f"{s.phase} {signed(step.change)}" for s, step in changes)
