"""The history shown: a table for the terminal (a test's line, then a row per phase, sorted by growth,
with a sparkline of each series where asked), a Markdown table of the top growers (and of what broke the
gate), and JSON."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from typing import Any

from cuda_allocator_model import format_size
from pytest_gpumem.history.git import Commit
from pytest_gpumem.history.series import Gate, Series, Step, growth_text, signed
from pytest_gpumem.report.markdown import cell, markdown_table
from pytest_gpumem.report.width import cut, display_width, pad, truncate

__all__ = ["JSON_VERSION", "WIDTH", "groups", "json_text", "markdown_text", "sparkline", "table"]

WIDTH = 120
JSON_VERSION = 1
"""The ``version`` of the ``--json`` document (docs/reference/json.md)."""
_BARS = "▁▂▃▄▅▆▇█"
_SPARK = 12
HEADERS = ("phase", "first", "latest", "change", "%", "steps", "largest step", "commit")
_RIGHT = (False, True, True, True, True, True, True, False)


def sparkline(values: Sequence[int], width: int = _SPARK) -> str:
    """One bar per value (at most ``width``, evenly picked), from the lowest figure to the highest."""
    if len(values) > width:
        values = [values[round(i * (len(values) - 1) / (width - 1))] for i in range(width)]
    low, high = min(values), max(values)
    if high == low:
        return _BARS[0] * len(values)
    return "".join(_BARS[(v - low) * (len(_BARS) - 1) // (high - low)] for v in values)


def _step(step: Step | None) -> tuple[str, str]:
    if step is None:
        return "-", "-"
    return signed(step.change), step.commit.describe()


def _cells(s: Series) -> list[str]:
    size, where = _step(s.largest)
    figures = [format_size(s.first), format_size(s.latest), signed(s.change), growth_text(s)]
    return [s.phase, *figures, str(len(s.steps)), size, where]


def groups(series: Sequence[Series]) -> list[tuple[str, str, list[Series]]]:
    """The series by test and device, in the order of their largest growth (the series come sorted)."""
    found: dict[tuple[str, str], list[Series]] = {}
    for s in series:
        found.setdefault((s.nodeid, s.device), []).append(s)
    return [(nodeid, device, members) for (nodeid, device), members in found.items()]


def table(series: Sequence[Series], sparklines: bool, width: int = WIDTH) -> str:
    """The terminal table, every line within ``width`` columns: each test's line names it and its device,
    its phases follow indented; the commit column is cut to what is left."""
    rows = [_cells(s) for s in series]
    widths = [max([display_width(h), *(display_width(r[i]) for r in rows)]) for i, h in enumerate(HEADERS)]
    spark = min(_SPARK, max((len(s.points) for s in series), default=1)) if sparklines else 0
    fixed = 2 + sum(widths[:-1]) + 2 * (len(HEADERS) - 1) + (spark + 2 if spark else 0)
    widths[-1] = max(min(widths[-1], width - fixed), 8)

    def line(cells: Sequence[str], bars: str = "") -> str:
        padded = [pad(truncate(c, w), w, right) for c, w, right in zip(cells, widths, _RIGHT, strict=True)]
        text = "  " + "  ".join(padded)
        return (text + "  " + pad(bars, spark) if spark else text).rstrip()

    lines = [line(HEADERS, "history" if spark >= 7 else "")]
    by_series = dict(zip(map(id, series), rows, strict=True))
    for nodeid, device, members in groups(series):
        lines.append(cut(f"{nodeid}  [{device}]", width, width // 2))
        for s in members:
            bars = sparkline([p.value for p in s.points], spark) if spark else ""
            lines.append(line(by_series[id(s)], bars))
    return "\n".join(lines)


def markdown_text(series: Sequence[Series], top: int, gate: Gate | None = None) -> str:
    """The ``top`` growers and every series that broke ``gate`` as a GitHub table (text written as the
    page writes it: ``<`` as ``&lt;``, so a subject or a phase name is never markup), one line saying
    how many more series there are, and under a gate, how many broke it and the exit status."""
    broke = {id(s) for s in series if gate is not None and gate.broke(s)}
    shown = [s for i, s in enumerate(series) if i < top or id(s) in broke]
    headers = ["test", "device", *(["gate"] if gate else []), *HEADERS]
    verdicts = [["over" if id(s) in broke else "-"] if gate else [] for s in shown]
    body = [[_code(s.nodeid), *map(_text, [s.device, *v, *_cells(s)])] for s, v in zip(shown, verdicts, strict=True)]
    text = markdown_table(headers, body) if shown else "No baselines in the file's history.\n"
    left = len(series) - len(shown)
    which = f"the top {top} growers" + (" and every series over the gate" if len(shown) > top else "")
    text += f"\n{left} more series ({which} shown)\n" if left > 0 else ""
    if gate is None:
        return text
    if broke:
        return text + f"\n{len(broke)} series grew more than {gate.describe()}: exit 1\n"
    return text + f"\nNo phase grew more than {gate.describe()}: exit 0\n"


def _text(text: str) -> str:
    return html.escape(text, quote=False)


def _code(nodeid: str) -> str:
    """A test id as a code span, its fence longer than any run of backticks in it; as escaped text
    where the cell would escape more than a pipe (a backslash would show doubled in a code span)."""
    if cell(nodeid).replace("\\|", "|") != nodeid:
        return _text(nodeid).replace("`", "&#96;")
    fence = "`" * (max(map(len, re.findall("`+", nodeid)), default=0) + 1)
    pad = " " if nodeid.startswith("`") or nodeid.endswith("`") else ""
    return f"{fence}{pad}{nodeid}{pad}{fence}"


def json_text(series: Sequence[Series], commits: Sequence[Commit], skipped: Sequence[str]) -> str:
    """Every commit read (oldest first), every series with its figures and steps, each point and step
    naming its commit by short hash, and the versions that were skipped: sorted keys, a line per commit
    and per series (a history of 1,000 commits x 500 tests is tens of megabytes)."""

    def one(value: object) -> str:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, allow_nan=False)

    def items(name: str, values: Sequence[object]) -> str:
        return f'"{name}": [' + ",".join(f"\n  {one(v)}" for v in values) + "]"

    listed = [{"short": c.short, "sha": c.sha, "date": c.date, "subject": c.subject} for c in commits]
    parts = [items("commits", listed), items("series", [_json(s) for s in series])]
    parts += [f'"skipped": {one(list(skipped))}', f'"version": {JSON_VERSION}']
    return "{" + ",\n ".join(parts) + "}\n"


def _json(s: Series) -> dict[str, Any]:
    largest = s.largest
    return {
        "nodeid": s.nodeid,
        "device": s.device,
        "reported": s.reported,  # figures of --reports, not of the committed file
        "phase": s.phase,
        "first": s.first,
        "latest": s.latest,
        "change": s.change,
        "percent": s.percent,
        "points": [[p.commit.short, p.value] for p in s.points],
        "steps": [{"commit": st.commit.short, "before": st.before, "after": st.after} for st in s.steps],
        "largest_step": None if largest is None else {"commit": largest.commit.short, "change": largest.change},
    }
