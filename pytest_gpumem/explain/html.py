"""One self-contained HTML page per explained test: live memory over the test call as a stacked area by
category, phases shaded, the peak marked with its top contributors, and the largest tensors of each phase.

The page loads nothing (a Content-Security-Policy forbids it): the explanation travels inside it as JSON,
an inline script draws the chart from it and computes the peak a reader sees, and the tables are written
here, in Python. A test that called gpumem.advise also gets the advice's rows as a table."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from pathlib import Path
from typing import Any

from pytest_gpumem.measure.advice import AS_IS, Advice, PhasePeak, Row
from pytest_gpumem.sizes import format_size

COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#edc948", "#b07aa1", "#76b7b2", "#ff9da7", "#9c755f")
"""One colour per category, in the explanation's stacking order (repeating past the ninth)."""

MAX_ROWS = 10
"""The most rows of a module or category x module table (the tensors table shows all it is given)."""

_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 24px auto;
       max-width: 1120px; padding: 0 16px; }
h1 { font-size: 18px; margin: 0 0 4px; overflow-wrap: anywhere; font-family: ui-monospace, monospace; }
h2 { font-size: 16px; margin: 28px 0 4px; border-bottom: 1px solid #ddd; }
h3 { font-size: 13px; margin: 10px 0 4px; color: #555; }
.meta { color: #666; margin: 0 0 12px; }
#gpumem-peak { font-size: 16px; font-weight: 600; margin: 8px 0; }
#gpumem-legend { display: flex; flex-wrap: wrap; gap: 4px 18px; margin: 4px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
#gpumem-chart { width: 100%; height: auto; display: block; }
#gpumem-chart text { font-size: 12px; fill: #333; }
#gpumem-chart .peak-label text { font-size: 13px; }
#gpumem-tip { position: fixed; display: none; pointer-events: none; background: #fff; border: 1px solid #999;
              border-radius: 4px; padding: 6px 8px; font-size: 12px; box-shadow: 0 2px 6px rgba(0,0,0,.2);
              max-width: 520px; }
#gpumem-tip .row { white-space: nowrap; }
#gpumem-tip .wrap { white-space: normal; padding-left: 1em; text-indent: -1em; }
#gpumem-tip .head { font-weight: 600; }
.tables { display: flex; flex-wrap: wrap; gap: 8px 32px; align-items: flex-start; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eee; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.total td { font-weight: 600; border-top: 1px solid #bbb; }
td.code, span.code { font-family: ui-monospace, monospace; font-size: 12px; }
td .what { display: block; color: #666; font-size: 12px; }
tr.best td { background: #e6f2dd; }
.badge { font-size: 11px; font-weight: 600; color: #fff; background: #3f7f2f; border-radius: 3px; padding: 0 4px;
         margin-left: 6px; }
"""

_SCRIPT = r"""
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const W = 1000, H = 440, M = { left: 84, right: 16, top: 30, bottom: 46 };
  const BANDS = ["#dce7f3", "#f5e6d0", "#dff0d8", "#eddcec", "#f2efcc", "#d9eeee"];
  const data = JSON.parse(document.getElementById("gpumem-data").textContent);
  const colours = JSON.parse(document.getElementById("gpumem-colours").textContent);
  const categories = data.categories || [];
  const labels = data.labels || {};
  const phases = data.phases || {};
  const call = phases.call || {};
  const timeline = data.timeline || {};
  const points = (timeline.points || []).map(p => [p[0], categories.map((_, c) => Number(p[1][c] || 0))]);

  function formatSize(n) {
    // pytest_gpumem.sizes.format_size: binary units, one decimal rounded half to even like Python's
    const sign = n < 0 ? "-" : "";
    let value = Math.abs(n);
    if (value < 1024) return sign + value + " B";
    const units = ["KiB", "MiB", "GiB", "TiB"];
    for (let u = 0; u < units.length; u++) {
      value /= 1024;
      if (value < 1024 || u === units.length - 1) return sign + oneDecimal(value) + " " + units[u];
    }
  }

  function oneDecimal(value) {
    const tenths = value * 10, floor = Math.floor(tenths), rest = tenths - floor;
    const n = rest > 0.5 || (rest === 0.5 && floor % 2 === 1) ? floor + 1 : floor;
    return Math.floor(n / 10) + "." + (n % 10);
  }

  function digits(n) {
    return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }

  function label(category) {
    return labels[category] || category;
  }

  function phasesAt(index) {
    return Object.keys(phases).filter(name => name !== "call" &&
      (phases[name].spans || []).some(s => s[0] <= index && index <= s[1]));
  }

  function peakOf(stacked) {
    let best = 0;
    for (let i = 1; i < stacked.length; i++) {
      if (stacked[i][categories.length] > stacked[best][categories.length]) best = i;
    }
    return best;
  }

  // stacked[i][c] is the sum of categories before c at point i; stacked[i][categories.length] the total
  function stack() {
    return points.map(p => {
      const sums = [0];
      p[1].forEach(v => sums.push(sums[sums.length - 1] + v));
      return sums;
    });
  }

  function el(parent, tag, attributes, text) {
    const node = document.createElementNS(SVG, tag);
    for (const key in attributes) node.setAttribute(key, attributes[key]);
    if (text !== undefined) node.textContent = text;
    parent.appendChild(node);
    return node;
  }

  function niceStep(raw) {
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const m = raw / power;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * power;
  }

  function makeScales(xMax, yMax) {
    const width = W - M.left - M.right, height = H - M.top - M.bottom;
    return {
      x: i => M.left + (i / xMax) * width,
      y: b => M.top + height - (b / yMax) * height,
      xMax: xMax, yMax: yMax,
    };
  }

  function byteTicks(yMax) {
    let unit = 1, name = "B";
    for (const [size, n] of [[1024, "KiB"], [1024 ** 2, "MiB"], [1024 ** 3, "GiB"], [1024 ** 4, "TiB"]]) {
      if (yMax >= size) { unit = size; name = n; }
    }
    const step = Math.max(niceStep(yMax / unit / 5), unit === 1 ? 1 : 0);
    const ticks = [];
    for (let v = 0; v * unit <= yMax; v += step) {
      ticks.push([v * unit, (Math.round(v * 1000) / 1000) + " " + name]);
    }
    return ticks;
  }

  function drawAxes(svg, s) {
    for (const [bytes, text] of byteTicks(s.yMax)) {
      el(svg, "line", { x1: M.left, x2: W - M.right, y1: s.y(bytes), y2: s.y(bytes), stroke: "#e6e6e6" });
      el(svg, "text", { x: M.left - 6, y: s.y(bytes) + 4, "text-anchor": "end" }, text);
    }
    const step = Math.max(1, niceStep(s.xMax / 8));
    for (let i = 0; i <= s.xMax; i += step) {
      el(svg, "line", { x1: s.x(i), x2: s.x(i), y1: H - M.bottom, y2: H - M.bottom + 4, stroke: "#888" });
      el(svg, "text", { x: s.x(i), y: H - M.bottom + 17, "text-anchor": "middle" }, digits(i));
    }
    el(svg, "line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, stroke: "#888" });
    el(svg, "text", { x: (M.left + W - M.right) / 2, y: H - 6, "text-anchor": "middle" },
      "event in the test call (allocation, resize or free)");
    el(svg, "text", { x: 14, y: M.top + (H - M.top - M.bottom) / 2, "text-anchor": "middle",
      transform: "rotate(-90 14 " + (M.top + (H - M.top - M.bottom) / 2) + ")" }, "live memory");
  }

  function phaseSpans() {
    const spans = [];
    Object.keys(phases).filter(name => name !== "call").forEach((name, n) => {
      for (const span of phases[name].spans || []) spans.push({ name: name, from: span[0], to: span[1], n: n });
    });
    return spans;
  }

  function drawBands(svg, s, spans) {
    for (const span of spans) {
      const x0 = s.x(span.from), width = Math.max(1, s.x(span.to) - x0);
      const colour = BANDS[span.n % BANDS.length];
      el(svg, "rect", { x: x0, y: M.top, width: width, height: H - M.top - M.bottom, fill: colour, opacity: 0.55 });
      const strip = el(svg, "rect", { x: x0, y: M.top - 20, width: width, height: 18, fill: colour });
      el(strip, "title", {}, span.name);
      if (width > span.name.length * 7 + 6) {
        el(svg, "text", { x: x0 + width / 2, y: M.top - 7, "text-anchor": "middle" }, span.name);
      }
    }
  }

  function drawEdges(svg, s, spans) {
    for (const span of spans) {
      for (const i of [span.from, span.to]) {
        el(svg, "line", { x1: s.x(i), x2: s.x(i), y1: M.top - 20, y2: H - M.bottom, stroke: "#666",
          "stroke-dasharray": "3,3", opacity: 0.6 });
      }
    }
  }

  // memory is a step function of the event index: a point's value holds until the next point
  function stepEdge(s, stacked, c) {
    const out = [];
    stacked.forEach((sums, i) => {
      const next = i + 1 < points.length ? points[i + 1][0] : Math.max(points[i][0], s.xMax);
      const y = s.y(sums[c]).toFixed(1);
      out.push(s.x(points[i][0]).toFixed(1) + "," + y, s.x(next).toFixed(1) + "," + y);
    });
    return out;
  }

  function drawAreas(svg, s, stacked) {
    categories.forEach((category, c) => {
      if (!points.some(p => p[1][c] !== 0)) return;
      const upper = stepEdge(s, stacked, c + 1), lower = stepEdge(s, stacked, c).reverse();
      const path = "M" + upper.join("L") + "L" + lower.join("L") + "Z";
      const area = el(svg, "path", { d: path, fill: colours[c % colours.length], opacity: 0.9 });
      el(area, "title", {}, label(category));
    });
  }

  function contributors() {
    const cells = (call.cells || []).filter(c => c.bytes > 0).sort((a, b) => b.bytes - a.bytes).slice(0, 3);
    return cells.map(cell => label(cell.category) +
      (cell.module === "(no module)" ? " (no module)" : " of " + cell.module) + ": " + formatSize(cell.bytes));
  }

  function drawPeak(svg, s, index, total) {
    const x = s.x(index), y = s.y(total);
    el(svg, "line", { x1: x, x2: x, y1: M.top, y2: H - M.bottom, stroke: "#111", "stroke-width": 1.5 });
    el(svg, "circle", { cx: x, cy: y, r: 5, fill: "#111", stroke: "#fff", "stroke-width": 1.5 });
    const lines = ["peak " + formatSize(total) + " (" + digits(total) + " B) at event " + digits(index)];
    const top = contributors();
    if (top.length) lines.push("grew most since the call started:");
    const group = el(svg, "g", { class: "peak-label" });
    const box = el(group, "rect", { fill: "#fff", stroke: "#111", rx: 3, opacity: 0.93 });
    const text = el(group, "text", { y: M.top + 8 });
    lines.concat(top).forEach((line, n) => {
      el(text, "tspan", { dy: n === 0 ? 12 : 16, "font-weight": n === 0 ? "bold" : "normal" }, line);
    });
    placeLabel(text, box, x);
  }

  function placeLabel(text, box, x) {
    const width = Math.max(...Array.from(text.childNodes, t => t.getComputedTextLength()));
    const left = x + 10 + width + 12 <= W - M.right ? x + 10 : Math.max(M.left + 2, x - 10 - width - 12);
    for (const tspan of text.childNodes) tspan.setAttribute("x", left + 6);
    const bb = text.getBBox();
    box.setAttribute("x", left);
    box.setAttribute("y", bb.y - 4);
    box.setAttribute("width", width + 12);
    box.setAttribute("height", bb.height + 8);
  }

  function showPeak(index, total) {
    const start = Number(call.start_bytes || 0);
    const where = phasesAt(index);
    let text = "Peak " + formatSize(total) + " (" + digits(total) + " B) live at event " + digits(index);
    if (where.length) text += " in " + where.join(", ");
    if (start) text += ": +" + formatSize(total - start) + " over the " + formatSize(start) + " live at the start";
    const unattributed = Number(call.unattributed_bytes || 0);
    if (unattributed) text += "; the measured peak has " + formatSize(unattributed) + " more, unattributed (allocator)";
    const node = document.getElementById("gpumem-peak");
    node.textContent = text;
    node.setAttribute("data-bytes", String(total));
    node.setAttribute("data-index", String(index));
  }

  function nearest(index) {
    let lo = 0, hi = points.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (points[mid][0] < index) lo = mid + 1; else hi = mid;
    }
    return lo > 0 && index - points[lo - 1][0] < points[lo][0] - index ? lo - 1 : lo;
  }

  function tipRow(tip, text, colour, cls) {
    const row = document.createElement("div");
    row.className = cls || "row";
    if (colour) {
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = colour;
      row.appendChild(swatch);
    }
    row.appendChild(document.createTextNode(text));
    tip.appendChild(row);
  }

  function tensorText(t) {
    return "[" + (t.shape || []).join(", ") + "] " + t.dtype + " " + formatSize(t.bytes) + " " +
      label(t.category) + ", " + t.op + " at " + t.where + (t.module ? " in " + t.module : "");
  }

  function fillTip(tip, i, stacked) {
    tip.replaceChildren();
    const index = points[i][0], where = phasesAt(index);
    tipRow(tip, "event " + digits(index) + (where.length ? " (" + where.join(", ") + ")" : "") + ": " +
      formatSize(stacked[i][categories.length]) + " live", null, "head");
    for (let c = categories.length - 1; c >= 0; c--) {
      const size = points[i][1][c];
      if (size) tipRow(tip, label(categories[c]) + ": " + formatSize(size), colours[c % colours.length]);
    }
    const peaks = Object.keys(phases).filter(name => phases[name].peak_index === index);
    const tensors = peaks.length ? phases[peaks[0]].tensors || [] : [];
    if (tensors.length) {
      tipRow(tip, "peak of " + peaks.join(" and ") + "; largest live tensors:", null, "head");
      tensors.slice(0, 5).forEach(t => tipRow(tip, tensorText(t), null, "row wrap"));
    }
  }

  function hover(svg, s, stacked) {
    const tip = document.getElementById("gpumem-tip");
    const cursor = el(svg, "line", { y1: M.top, y2: H - M.bottom, stroke: "#333", "stroke-dasharray": "2,2",
      visibility: "hidden", "pointer-events": "none" });
    svg.addEventListener("mousemove", event => {
      const p = new DOMPoint(event.clientX, event.clientY).matrixTransform(svg.getScreenCTM().inverse());
      const i = nearest(((p.x - M.left) / (W - M.left - M.right)) * s.xMax);
      cursor.setAttribute("x1", s.x(points[i][0]));
      cursor.setAttribute("x2", s.x(points[i][0]));
      cursor.setAttribute("visibility", "visible");
      fillTip(tip, i, stacked);
      tip.style.display = "block";
      const right = event.clientX + 16 + tip.offsetWidth > window.innerWidth;
      tip.style.left = (right ? event.clientX - 16 - tip.offsetWidth : event.clientX + 16) + "px";
      tip.style.top = Math.max(4, event.clientY - tip.offsetHeight - 12) + "px";
    });
    svg.addEventListener("mouseleave", () => {
      tip.style.display = "none";
      cursor.setAttribute("visibility", "hidden");
    });
  }

  function draw() {
    const svg = document.getElementById("gpumem-chart");
    const stacked = stack();
    if (!points.length) {
      showPeak(0, 0);
      el(svg, "text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no memory events recorded");
      return;
    }
    const peak = peakOf(stacked), total = stacked[peak][categories.length];
    showPeak(points[peak][0], total);
    const xMax = Math.max(1, Number(timeline.events || 0), points[points.length - 1][0]);
    const s = makeScales(xMax, Math.max(1, total * 1.08));
    const spans = phaseSpans();
    drawBands(svg, s, spans);
    drawAxes(svg, s);
    drawAreas(svg, s, stacked);
    drawEdges(svg, s, spans);
    drawPeak(svg, s, points[peak][0], total);
    hover(svg, s, stacked);
  }

  draw();
})();
"""

_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
_CSP = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{_SCRIPT_HASH}'"


def render(explanation: dict[str, Any], advice: object = None) -> str:
    """The whole page for one explanation: one HTML document that needs nothing else to open. `advice`:
    the test's `info["advice"]` (`Advice.to_json`), shown as a table; anything else shows nothing."""
    nodeid = str(explanation.get("nodeid", ""))
    head = (
        f'<meta charset="utf-8">\n<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        f"<title>gpumem: {_text(nodeid)}</title>\n<style>{_CSS}</style>"
    )
    body = "\n".join(
        part
        for part in [
            f'<h1 id="gpumem-test">{_text(nodeid)}</h1>',
            f'<p class="meta">memory of the test call, measured by {_text(explanation.get("backend", "?"))}</p>',
            '<p id="gpumem-peak">Peak: needs JavaScript to draw the chart.</p>',
            _legend(explanation),
            '<svg id="gpumem-chart" viewBox="0 0 1000 440" role="img" aria-label="live memory over the test call">'
            "</svg>",
            '<div id="gpumem-tip"></div>',
            _advice_section(advice),
            *(_phase_section(name, phase, explanation) for name, phase in _phases(explanation)),
            f'<script type="application/json" id="gpumem-data">{_script_json(explanation)}</script>',
            f'<script type="application/json" id="gpumem-colours">{_script_json(list(COLOURS))}</script>',
            f"<script>{_SCRIPT}</script>",
        ]
        if part
    )
    return f'<!DOCTYPE html>\n<html lang="en">\n<head>\n{head}\n</head>\n<body>\n{body}\n</body>\n</html>\n'


def write_html(folder: Path, explanation: dict[str, Any], advice: object = None) -> Path:
    """Writes the page of one explanation (and the test's advice, if any) into `folder` (made if missing),
    named after its test; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file_stem(str(explanation.get('nodeid', '')))}.html"
    path.write_text(render(explanation, advice), encoding="utf-8")
    return path


def file_stem(nodeid: str) -> str:
    """A file name for a test: its id in safe characters, cut to 120, and a hash of the whole id that keeps
    different ids apart (the recipe of `failures.write_evidence`, so a test's files sit side by side)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[:120] + "-" + hashlib.sha1(nodeid.encode()).hexdigest()[:8]


def _script_json(value: object) -> str:
    """JSON that cannot end the <script> element holding it: <, > and & written as JSON escapes."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _text(value: object) -> str:
    return html.escape(str(value), quote=True)


def _label(explanation: dict[str, Any], category: str) -> str:
    return str(explanation.get("labels", {}).get(category, category))


def _colour(explanation: dict[str, Any], category: str) -> str:
    categories = list(explanation.get("categories", []))
    return COLOURS[categories.index(category) % len(COLOURS)] if category in categories else "#bbb"


def _swatch(colour: str) -> str:
    return f'<span class="swatch" style="background:{colour}"></span>'


def _legend(explanation: dict[str, Any]) -> str:
    items = "".join(
        f"<span>{_swatch(_colour(explanation, category))}{_text(_label(explanation, category))}</span>"
        for category in reversed(explanation.get("categories", []))
    )
    return f'<div id="gpumem-legend">{items}</div>'


def _phases(explanation: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The phases, the whole call first."""
    phases: dict[str, dict[str, Any]] = explanation.get("phases", {})
    return sorted(phases.items(), key=lambda item: item[0] != "call")


def _phase_section(name: str, phase: dict[str, Any], explanation: dict[str, Any]) -> str:
    tables = [
        _category_table(phase, explanation),
        _ranked_table("by module", "module", phase.get("modules", {})),
        _ranked_table("by category and module", "category, module", _cells(phase, explanation)),
    ]
    return (
        f'<section class="phase" data-phase="{_text(name)}">\n'
        f"<h2>{_text('the whole call' if name == 'call' else name)}</h2>\n"
        f'<p class="meta">{_text(_phase_summary(phase))}</p>\n'
        f'<div class="tables">{"".join(tables)}</div>\n'
        f"{_tensor_table(phase, explanation)}\n</section>"
    )


def _phase_summary(phase: dict[str, Any]) -> str:
    spans = phase.get("spans", [])
    ran = f"; ran {len(spans)} times" if len(spans) > 1 else ""
    return (
        f"peak {format_size(int(phase.get('peak_bytes', 0)))} above its start"
        f" ({format_size(int(phase.get('start_bytes', 0)))} live at the start),"
        f" reached at event {int(phase.get('peak_index', 0)):,}{ran}"
    )


def _category_table(phase: dict[str, Any], explanation: dict[str, Any]) -> str:
    peak = int(phase.get("peak_bytes", 0))
    body = "".join(
        f"<tr><td>{_swatch(colour)}{_text(label)}</td>"
        f'<td class="num">{format_size(size)}</td><td class="num">{_share(size, peak)}</td></tr>'
        for colour, label, size in _category_rows(phase, explanation)
    )
    body += f'<tr class="total"><td>peak above start</td><td class="num">{format_size(peak)}</td><td></td></tr>'
    return (
        '<div class="composition"><h3>by category</h3><table><tr><th>category</th><th class="num">growth</th>'
        f'<th class="num">share</th></tr>{body}</table></div>'
    )


def _category_rows(phase: dict[str, Any], explanation: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(colour, label, growth) of each category in stacking order, then any the explanation did not list,
    then what the allocator kept that no tensor accounts for."""
    growth: dict[str, int] = phase.get("categories", {})
    names = list(explanation.get("categories", []))
    names += [name for name in growth if name not in names]
    rows = [(_colour(explanation, name), _label(explanation, name), int(growth.get(name, 0))) for name in names]
    if phase.get("unattributed_bytes"):
        rows.append(("#bbb", "unattributed", int(phase["unattributed_bytes"])))
    return rows


def _share(size: int, total: int) -> str:
    return f"{100 * size / total:.0f}%".replace("-0%", "0%") if total else ""


def _cells(phase: dict[str, Any], explanation: dict[str, Any]) -> dict[str, int]:
    return {
        f"{_label(explanation, cell.get('category', '?'))}, {cell.get('module', '?')}": int(cell.get("bytes", 0))
        for cell in phase.get("cells", [])
    }


def _ranked_table(title: str, heading: str, sizes: dict[str, int]) -> str:
    ranked = sorted(sizes.items(), key=lambda item: -int(item[1]))[:MAX_ROWS]
    if not ranked:
        return ""
    body = "".join(
        f'<tr><td class="code">{_text(name)}</td><td class="num">{format_size(int(size))}</td></tr>'
        for name, size in ranked
    )
    return (
        f"<div><h3>{_text(title)}</h3><table><tr><th>{_text(heading)}</th>"
        f'<th class="num">growth</th></tr>{body}</table></div>'
    )


_TENSOR_COLUMNS = ("shape", "dtype", "bytes", "category", "op", "line", "module")


def _tensor_table(phase: dict[str, Any], explanation: dict[str, Any]) -> str:
    tensors = phase.get("tensors", [])
    if not tensors:
        return ""
    head = "".join(f"<th{' class=num' if name == 'bytes' else ''}>{name}</th>" for name in _TENSOR_COLUMNS)
    body = "".join(_tensor_row(tensor, explanation) for tensor in tensors)
    return f'<h3>largest tensors live at the peak</h3>\n<table class="tensors"><tr>{head}</tr>{body}</table>'


def _tensor_row(tensor: dict[str, Any], explanation: dict[str, Any]) -> str:
    dims = tensor.get("shape")
    shape = "a storage" if not isinstance(dims, list) else "[" + ", ".join(str(size) for size in dims) + "]"
    size = int(tensor.get("bytes", 0))
    cells = [
        f'<td class="code">{_text(shape)}</td>',
        f'<td class="code">{_text(tensor.get("dtype", ""))}</td>',
        f'<td class="num" title="{size:,} B">{format_size(size)}</td>',
        f"<td>{_swatch(_colour(explanation, tensor.get('category', '')))}"
        f"{_text(_label(explanation, tensor.get('category', '')))}</td>",
        f'<td class="code">{_text(tensor.get("op", ""))}</td>',
        f'<td class="code">{_text(tensor.get("where", ""))}</td>',
        f'<td class="code">{_text(tensor.get("module", ""))}</td>',
    ]
    return f"<tr>{''.join(cells)}</tr>"


_ADVICE_COLUMNS = (
    ("strategy", ""),
    ("peak", "num"),
    ("above the start", "num"),
    ("peak in", ""),
    ("each phase's peak", ""),
    ("saves vs as-is", "num"),
    ("extra compute", "num"),
    ("gradients", ""),
    ("fits", ""),
)


def read_advice(data: object) -> Advice | None:
    """The Advice that `Advice.to_json` wrote, or None for anything not shaped like it (a test may put
    its own value under info["advice"])."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        return None
    try:
        live = int(data.get("live_bytes") or 0)
        capacity = data.get("capacity")
        return Advice(
            rows=tuple(_read_row(row, live) for row in data["rows"]),
            capacity=None if capacity is None else int(capacity),
            live_bytes=live,
            backend=str(data.get("backend", "?")),
            device=str(data.get("device", "?")),
            resident_bytes=int(data.get("resident_bytes") or 0),
            conflicts=tuple(str(text) for text in data.get("conflicts", [])),
            seconds=float(data.get("seconds") or 0.0),
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _read_row(data: dict[str, Any], live: int) -> Row:
    name, description = str(data["name"]), str(data.get("description", ""))
    strategies = tuple(str(part) for part in data.get("strategies", []))
    if data.get("skipped") is not None:
        return Row(name, description, strategies, skipped=str(data["skipped"]))
    absolute: dict[str, int] = data.get("absolute_phases", {})
    phases = tuple(
        PhasePeak(str(phase), int(peak), int(absolute[phase]) - live if phase in absolute else None)
        for phase, peak in data.get("phases", {}).items()
    )
    return Row(
        name,
        description,
        strategies,
        peak_bytes=int(data["peak_bytes"]),
        phases=phases,
        saving_bytes=_int_or_none(data.get("saving_bytes")),
        flops=_int_or_none(data.get("flops")),
        extra_flops=_int_or_none(data.get("extra_flops")),
        gradients=str(data.get("gradients", "")),
        gradients_equal=None if data.get("gradients_equal") is None else bool(data["gradients_equal"]),
        fits=None if data.get("fits") is None else bool(data["fits"]),
    )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _advice_section(data: object) -> str:
    advice = read_advice(data)
    if advice is None:
        return ""
    best = None if advice.capacity is None else advice.best()
    head = "".join(f"<th{' class=num' if cls else ''}>{_text(name)}</th>" for name, cls in _ADVICE_COLUMNS)
    body = "".join(_advice_row(advice, row, row is best) for row in advice.rows if row.measured)
    skipped = "".join(
        f'<tr><td class="code">{_text(row.name)}</td><td>{_text(row.skipped)}</td></tr>'
        for row in advice.rows
        if row.skipped is not None
    )
    parts = [
        '<section id="gpumem-advice">\n<h2>advice: the step with each memory-saving strategy</h2>',
        f'<p class="meta" id="gpumem-advice-summary">{_text(_advice_summary(advice, best))}</p>',
        f'<table class="advice"><tr>{head}</tr>{body}</table>',
    ]
    if skipped:
        parts.append(
            f'<h3>skipped</h3>\n<table class="skipped"><tr><th>strategy</th><th>why</th></tr>{skipped}</table>'
        )
    if advice.conflicts:
        items = "".join(f"<li>{_text(text)}</li>" for text in advice.conflicts)
        parts.append(f'<h3>not combined</h3>\n<ul class="conflicts">{items}</ul>')
    return "\n".join(parts) + "\n</section>"


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


def _advice_row(advice: Advice, row: Row, best: bool) -> str:
    assert row.peak_bytes is not None
    absolute = advice.absolute(row)
    badge = '<span class="badge">best</span>' if best else ""
    what = f'<span class="what">{_text(row.description)}</span>' if row.description else ""
    phases = ", ".join(f"{p.name} {format_size(advice.live_bytes + p.step_peak)}" for p in row.phases)
    saving = "" if row.name == AS_IS or row.saving_bytes is None else format_size(row.saving_bytes)
    flops = "" if row.extra_flops is None else f' title="{row.extra_flops:+,} FLOPs"'
    fits = "" if row.fits is None else ("yes" if row.fits else "no")
    cells = [
        f'<td><span class="code">{_text(row.name)}</span>{badge}{what}</td>',
        f'<td class="num" title="{absolute:,} B">{format_size(absolute)}</td>',
        f'<td class="num" title="{row.peak_bytes:,} B">+{format_size(row.peak_bytes)}</td>',
        f"<td>{_text(row.peak_phase or '')}</td>",
        f"<td>{_text(phases)}</td>",
        f'<td class="num">{saving}</td>',
        f'<td class="num"{flops}>{_text(advice.compute(row))}</td>',
        f"<td>{_text(row.gradients)}</td>",
        f"<td>{fits}</td>",
    ]
    return f'<tr{" class=best" if best else ""} data-strategy="{_text(row.name)}">{"".join(cells)}</tr>'
