"""One self-contained HTML page per explained test: live memory over the test call as a stacked area by
category, phases shaded, the peak marked with its top contributors, and the largest tensors of each phase.
A test that called gpumem.advise also gets the advice's rows as a table.

The page loads nothing (a Content-Security-Policy forbids it): the jinja2 template (`templates/`) writes
the tables, the explanation travels inside as JSON, and the script (`static/page.js`) draws the chart from
it; the peak it marks (the call's, as its table says), every size and every axis tick it shows come
from here (`view`). What advise and check_gradients ran inside the test is folded on the event axis
(`html_axis`), labeled, and listed under the chart."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import jinja2

from cuda_allocator_model import byte_ticks, format_size
from pytest_gpumem.report import assets
from pytest_gpumem.report.html_axis import Axis, AxisSpan, event_axis, event_ticks
from pytest_gpumem.results.advice import AS_IS, Advice, Row
from pytest_gpumem.results.explanation import Explanation, PhaseExplanation, Point, Tensor, UnmeasuredSpan

COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#edc948", "#b07aa1", "#76b7b2", "#ff9da7", "#9c755f")
"""One colour per category, in the explanation's stacking order (repeating past the ninth)."""

_MAX_ROWS = 10
"""The most rows of a module or category x module table (the tensors table shows all it is given)."""

_UNLISTED = "#bbb"  # the colour of a category the explanation does not list, and of unattributed bytes
_TIP_TENSORS = 5  # tensors the chart's tooltip lists at a phase's peak
_PEAK_CONTRIBUTORS = 3  # cells the peak's label names
_Y_HEADROOM = 1.08  # the chart's top, over its peak
_X_LABEL = "event in the test call (allocation, resize or free)"
_X_FOLDED = "; grey: folded, measured by no phase"
WHERE_CHARS, WHERE_PARTS = 40, 2  # a source path longer than this keeps its last parts in the tensors table


@dataclass(frozen=True)
class _Assets:
    environment: jinja2.Environment
    css: str
    script: str
    csp: str


@cache
def _assets() -> _Assets:
    """The template, stylesheet and script shipped in the package, and the policy that lets only this
    script run."""
    script = assets.static("page.js")
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src {assets.sha256(script)}"
    return _Assets(assets.environment(break_parts=_break_parts), assets.static("page.css"), script, csp)


def _break_parts(text: str) -> list[str]:
    """`text` in the parts the page may break a line between (the template's `wrap`): after each `.`, `/`
    and `_`, so module paths, op names and file paths wrap there rather than mid-word."""
    return re.split(r"(?<=[./_])", text)


def _short_where(where: str) -> str:
    """A source line as the tensors table shows it: a long path cut to its last directories."""
    parts = where.split("/")
    if len(where) <= WHERE_CHARS or len(parts) <= WHERE_PARTS:
        return where
    return "…/" + "/".join(parts[-WHERE_PARTS:])


def render(explanation: Explanation, advice: Advice | None = None) -> str:
    """The whole page for one explanation, and the test's advice (if it called gpumem.advise) as a
    table: one HTML document that needs nothing else to open."""
    shipped = _assets()
    return shipped.environment.get_template("page.html.j2").render(
        csp=shipped.csp,
        css=shipped.css,
        script=shipped.script,
        nodeid=explanation.nodeid,
        backend=explanation.backend,
        legend=[
            {"colour": _colour(explanation, c), "label": explanation.label(c)} for c in reversed(explanation.categories)
        ],
        advice=None if advice is None else _advice_view(advice),
        folded=_folded_view(explanation.timeline.unmeasured),
        phases=[_phase_view(name, phase, explanation) for name, phase in _phases(explanation)],
        data=_script_json(explanation.to_json()),
        view=_script_json(chart_texts(explanation)),
    )


def _script_json(value: object) -> str:
    """JSON that cannot end the <script> element holding it: <, > and & written as JSON escapes."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _colour(explanation: Explanation, category: str) -> str:
    categories = explanation.categories
    return COLOURS[categories.index(category) % len(COLOURS)] if category in categories else _UNLISTED


# --- what the script shows, formatted here


def chart_texts(explanation: Explanation) -> dict[str, Any]:
    """Every size the chart's script shows, formatted: for each timeline point its total (size, bytes,
    growth over the call's start) and its categories; the peak's point (the call's, where its table says)
    with its label and tooltip; both axes, each with its extent (`x_max`, `y_max`) and its ticks
    ([position, text]), the event axis's `segments` and its `folds` (what ran that no phase measured)."""
    call = explanation.phases.get("call")
    start = 0 if call is None else call.start_bytes
    points = explanation.timeline.points
    x_max = max(1, explanation.timeline.events, points[-1].index if points else 0)
    y_max = max(1.0, max((point.total for point in points), default=0) * _Y_HEADROOM)
    axis = event_axis(x_max, explanation.timeline.unmeasured)
    return {
        "colours": list(COLOURS),
        "points": [_point_texts(point, start) for point in points],
        "empty": _point_texts(Point(0, []), start),
        "peak": _peak_point(explanation, axis),
        "start": format_size(start) if start else "",
        "unattributed": format_size(call.unattributed_bytes) if call is not None and call.unattributed_bytes else "",
        "contributors": [] if call is None else _contributors(explanation, call),
        "tensors": {
            name: [_tensor_text(explanation, tensor) for tensor in phase.tensors[:_TIP_TENSORS]]
            for name, phase in explanation.phases.items()
        },
        "x_max": x_max,
        "x_ticks": event_ticks(axis),
        "x_label": _X_LABEL + (_X_FOLDED if axis.folds else ""),
        "segments": [part.to_json() for part in axis.segments],
        "folds": [_fold_texts(part) for part in axis.folds],
        "y_max": y_max,
        "ticks": byte_ticks(y_max),
    }


def _peak_point(explanation: Explanation, axis: Axis) -> int | None:
    """The timeline point the chart marks as the peak: the call's peak (the moment its table names),
    else (an explanation without it) the first largest point outside the folded spans; None without
    points."""
    points = explanation.timeline.points
    call = explanation.phases.get("call")
    if call is not None and call.peak_index is not None:
        found = next((i for i, point in enumerate(points) if point.index == call.peak_index), None)
        if found is not None:
            return found
    measured = [i for i, point in enumerate(points) if axis.fold_at(point.index) is None] or list(range(len(points)))
    return max(measured, key=lambda i: (points[i].total, -i), default=None)


def _folded_view(unmeasured: list[UnmeasuredSpan]) -> list[dict[str, Any]]:
    """What ran that no phase measures, one line per caller (gpumem.advise, ...): how often, how many
    events, where on the event axis."""
    by: dict[str, list[UnmeasuredSpan]] = {}
    for span in unmeasured:
        by.setdefault(span.by or "unmeasured", []).append(span)
    view = []
    for name, spans in by.items():
        events = sum(span.end - span.start for span in spans)
        where = f"events {spans[0].start:,} to {spans[0].end:,}" if len(spans) == 1 else f"{len(spans)} times"
        view.append({"by": name, "runs": len(spans), "events": events, "text": f"{name}: {events:,} events ({where})"})
    return view


def _fold_texts(part: AxisSpan) -> dict[str, Any]:
    """A folded span's label on the chart, and its tooltip."""
    events = f"events {part.start:,} to {part.end:,} ({part.end - part.start:,} events)"
    title = f"{part.by}: {events}, folded on this axis; no phase measures them"
    return {"start": part.start, "end": part.end, "label": part.by, "title": title}


def _point_texts(point: Point, start: int) -> list[Any]:
    total = point.total
    return [format_size(total), f"{total:,}", format_size(total - start), [format_size(s) for s in point.sizes]]


def _contributors(explanation: Explanation, call: PhaseExplanation) -> list[str]:
    cells = sorted((c for c in call.cells if c.size > 0), key=lambda c: -c.size)[:_PEAK_CONTRIBUTORS]
    return [f"{explanation.label(c.category)} of {c.module}: {format_size(c.size)}" for c in cells]


def _tensor_text(explanation: Explanation, tensor: Tensor) -> str:
    shape = ", ".join(str(size) for size in tensor.shape or ())
    module = f" in {tensor.module}" if tensor.module else ""
    return (
        f"[{shape}] {tensor.dtype} {format_size(tensor.size)} {explanation.label(tensor.category)}, "
        f"{tensor.op} at {tensor.where}{module}"
    )


# --- the tables


def _phases(explanation: Explanation) -> list[tuple[str, PhaseExplanation]]:
    """The phases, the whole call first."""
    return sorted(explanation.phases.items(), key=lambda item: item[0] != "call")


def _phase_view(name: str, phase: PhaseExplanation, explanation: Explanation) -> dict[str, Any]:
    cells = {f"{explanation.label(c.category)}, {c.module}": c.size for c in phase.cells}
    ranked = [("by module", "module", phase.modules), ("by category and module", "category, module", cells)]
    return {
        "name": name,
        "peak_index": "" if phase.peak_index is None else phase.peak_index,
        "title": "the whole call" if name == "call" else name,
        "summary": _phase_summary(phase),
        "peak": format_size(phase.peak_bytes),
        "categories": [
            {"colour": colour, "label": label, "size": format_size(size), "share": _share(size, phase.peak_bytes)}
            for colour, label, size in _category_rows(phase, explanation)
        ],
        "ranked": [
            {"title": title, "heading": heading, "rows": _ranked(sizes)} for title, heading, sizes in ranked if sizes
        ],
        "tensors": [_tensor_view(tensor, explanation) for tensor in phase.tensors],
    }


def _phase_summary(phase: PhaseExplanation) -> str:
    ran = f"; ran {len(phase.spans)} times" if len(phase.spans) > 1 else ""
    return (
        f"peak {format_size(phase.peak_bytes)} above its start ({format_size(phase.start_bytes)} live at the"
        f" start), reached at event {phase.peak_index or 0:,}{ran}"
    )


def _category_rows(phase: PhaseExplanation, explanation: Explanation) -> list[tuple[str, str, int]]:
    """(colour, label, growth) of each category in stacking order, then any the explanation did not list,
    then what the allocator kept that no tensor accounts for."""
    names = [*explanation.categories, *(name for name in phase.categories if name not in explanation.categories)]
    rows = [(_colour(explanation, n), explanation.label(n), phase.categories.get(n, 0)) for n in names]
    if phase.unattributed_bytes:
        rows.append((_UNLISTED, "unattributed", phase.unattributed_bytes))
    return rows


def _share(size: int, total: int) -> str:
    return f"{100 * size / total:.0f}%".replace("-0%", "0%") if total else ""


def _ranked(sizes: Mapping[str, int]) -> list[tuple[str, str]]:
    ranked = sorted(sizes.items(), key=lambda item: -item[1])[:_MAX_ROWS]
    return [(name, format_size(size)) for name, size in ranked]


def _tensor_view(tensor: Tensor, explanation: Explanation) -> dict[str, Any]:
    shape = "a storage" if tensor.shape is None else "[" + ", ".join(str(size) for size in tensor.shape) + "]"
    return {
        "shape": shape,
        "dtype": tensor.dtype or "",
        "size": format_size(tensor.size),
        "digits": f"{tensor.size:,}",
        "colour": _colour(explanation, tensor.category),
        "label": explanation.label(tensor.category),
        "op": tensor.op,
        "where": _short_where(tensor.where or ""),
        "where_full": tensor.where or "",
        "module": tensor.module,
    }


# --- the advice table


def _advice_summary(advice: Advice, best: Row | None) -> str:
    measured = (
        f"gpumem.advise ran the step on {advice.backend} ({advice.device}) in {advice.seconds:.1f} s, apart from "
        f"the test's call. Peaks are absolute: the {format_size(advice.live_bytes)} live at the step's start "
        f"({format_size(advice.resident_bytes)} of it model state) plus the step's peak above it."
    )
    if advice.capacity is None:
        return f"{measured} No capacity was given, so none is judged to fit."
    capacity = format_size(advice.capacity)
    if best is None:
        return f"{measured} None fits the capacity of {capacity}."
    if best.name == AS_IS:
        return f"{measured} The step fits the capacity of {capacity} as it is."
    return f"{measured} Best: {best.name}, the least extra compute that fits the capacity of {capacity}."


def _advice_view(advice: Advice) -> dict[str, Any]:
    best = None if advice.capacity is None else advice.best()
    return {
        "summary": _advice_summary(advice, best),
        "rows": [_advice_row(advice, row, row is best) for row in advice.rows if row.measured],
        "skipped": [(row.name, row.skipped) for row in advice.rows if row.skipped is not None],
        "conflicts": list(advice.conflicts),
    }


def _advice_row(advice: Advice, row: Row, best: bool) -> dict[str, Any]:
    assert row.peak_bytes is not None
    absolute = advice.absolute(row)
    return {
        "name": row.name,
        "best": best,
        "description": row.description,
        "absolute": format_size(absolute),
        "absolute_digits": f"{absolute:,}",
        "peak": format_size(row.peak_bytes),
        "peak_digits": f"{row.peak_bytes:,}",
        "peak_in": row.peak_phase or "",
        "phases": ", ".join(f"{p.name} {format_size(advice.live_bytes + p.step_peak)}" for p in row.phases),
        "saving": "" if row.name == AS_IS or row.saving_bytes is None else format_size(row.saving_bytes),
        "flops": "" if row.extra_flops is None else f"{row.extra_flops:+,}",
        "compute": advice.compute(row),
        "gradients": row.gradients,
        "fits": "" if row.fits is None else ("yes" if row.fits else "no"),
    }
