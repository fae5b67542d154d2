"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const W = 1000, H = 440, M = { left: 84, right: 16, top: 30, bottom: 46 };
  const BANDS = ["#dce7f3", "#f5e6d0", "#dff0d8", "#eddcec", "#f2efcc", "#d9eeee"];
  const data = JSON.parse(document.getElementById("gpumem-data").textContent);
  // every size a reader sees comes formatted from Python (cuda_allocator_model.sizes), in `view`
  const view = JSON.parse(document.getElementById("gpumem-view").textContent);
  const colours = view.colours;
  const categories = data.categories || [];
  const labels = data.labels || {};
  const phases = data.phases || {};
  const timeline = data.timeline || {};
  const points = (timeline.points || []).map(p => [p[0], categories.map((_, c) => Number(p[1][c] || 0))]);

  function digits(n) {
    return Number(n).toLocaleString("en-US");
  }

  function label(category) {
    return labels[category] || category;
  }

  function phasesAt(index) {
    return Object.keys(phases).filter(name => name !== "call" &&
      (phases[name].spans || []).some(s => s[0] <= index && index <= s[1]));
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

  // the event axis in segments (from Python): [first event, last event, left, right], left and right as
  // shares of the width; a folded span (what advise or check_gradients ran) takes a narrow one
  function share(i) {
    for (const [from, to, left, right] of view.segments) {
      if (i <= to) return to === from ? left : left + ((Math.max(i, from) - from) / (to - from)) * (right - left);
    }
    return 1;
  }

  function eventAt(x) {
    for (const [from, to, left, right] of view.segments) {
      if (x <= right) return right === left ? from : from + ((Math.max(x, left) - left) / (right - left)) * (to - from);
    }
    return view.x_max;
  }

  function makeScales(xMax, yMax) {
    const width = W - M.left - M.right, height = H - M.top - M.bottom;
    return {
      x: i => M.left + share(i) * width,
      event: px => eventAt((px - M.left) / width),
      y: b => M.top + height - (b / yMax) * height,
      xMax: xMax, yMax: yMax,
    };
  }

  function foldAt(index) {
    return view.folds.find(f => f.start < index && index < f.end) || null;
  }

  function drawAxes(svg, s) {
    for (const [bytes, text] of view.ticks) {
      el(svg, "line", { x1: M.left, x2: W - M.right, y1: s.y(bytes), y2: s.y(bytes), stroke: "#e6e6e6" });
      el(svg, "text", { x: M.left - 6, y: s.y(bytes) + 4, "text-anchor": "end" }, text);
    }
    for (const [i, text] of view.x_ticks) {
      el(svg, "line", { x1: s.x(i), x2: s.x(i), y1: H - M.bottom, y2: H - M.bottom + 4, stroke: "#888" });
      el(svg, "text", { x: s.x(i), y: H - M.bottom + 17, "text-anchor": "middle" }, text);
    }
    el(svg, "line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, stroke: "#888" });
    el(svg, "text", { x: (M.left + W - M.right) / 2, y: H - 6, "text-anchor": "middle" },
      view.x_label);
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

  function drawFolds(svg, s) {
    for (const fold of view.folds) {
      const x0 = s.x(fold.start), width = Math.max(1, s.x(fold.end) - x0);
      const group = el(svg, "g", { class: "fold", "data-by": fold.label });
      el(group, "title", {}, fold.title);
      el(group, "rect", { x: x0, y: M.top, width: width, height: H - M.top - M.bottom, fill: "#f2f2f2", opacity: 0.7 });
      el(group, "rect", { x: x0, y: M.top - 20, width: width, height: 18, fill: "#d4d4d4" });
      for (const i of [fold.start, fold.end]) {
        el(group, "line", { x1: s.x(i), x2: s.x(i), y1: M.top - 20, y2: H - M.bottom, stroke: "#777" });
      }
      if (width >= 16) {  // the label runs up the fold from its foot, whatever its width
        const x = x0 + width / 2 + 4, y = H - M.bottom - 8;
        el(group, "text", { x: x, y: y, "text-anchor": "start", class: "fold-label",
          transform: "rotate(-90 " + x + " " + y + ")" }, fold.label);
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

  // the texts of point i (or of no point): [size, bytes, growth over the call's start, [by category]]
  function texts(i) {
    return i === null ? view.empty : view.points[i];
  }

  function drawPeak(svg, s, i, total) {
    const index = points[i][0], x = s.x(index), y = s.y(total);
    el(svg, "line", { x1: x, x2: x, y1: M.top, y2: H - M.bottom, stroke: "#111", "stroke-width": 1.5 });
    el(svg, "circle", { cx: x, cy: y, r: 5, fill: "#111", stroke: "#fff", "stroke-width": 1.5 });
    const lines = ["peak " + texts(i)[0] + " (" + texts(i)[1] + " B) at event " + digits(index)];
    const top = view.contributors;
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

  function showPeak(i, total) {
    const index = i === null ? 0 : points[i][0], where = phasesAt(index), shown = texts(i);
    let text = "Peak " + shown[0] + " (" + shown[1] + " B) live at event " + digits(index);
    if (where.length) text += " in " + where.join(", ");
    if (view.start) text += ": +" + shown[2] + " over the " + view.start + " live at the start";
    if (view.unattributed) text += "; the measured peak has " + view.unattributed + " more, unattributed (allocator)";
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

  function fillTip(tip, i, stacked) {
    tip.replaceChildren();
    const index = points[i][0], where = phasesAt(index), fold = foldAt(index);
    tipRow(tip, "event " + digits(index) + (where.length ? " (" + where.join(", ") + ")" : "") + ": " +
      texts(i)[0] + " live", null, "head");
    if (fold) tipRow(tip, fold.title, null, "row wrap");
    for (let c = categories.length - 1; c >= 0; c--) {
      if (points[i][1][c]) tipRow(tip, label(categories[c]) + ": " + texts(i)[3][c], colours[c % colours.length]);
    }
    const peaks = Object.keys(phases).filter(name => phases[name].peak_index === index);
    const tensors = peaks.length ? view.tensors[peaks[0]] || [] : [];
    if (tensors.length) {
      tipRow(tip, "peak of " + peaks.join(" and ") + "; largest live tensors:", null, "head");
      tensors.slice(0, 5).forEach(text => tipRow(tip, text, null, "row wrap"));
    }
  }

  function hover(svg, s, stacked) {
    const tip = document.getElementById("gpumem-tip");
    const cursor = el(svg, "line", { y1: M.top, y2: H - M.bottom, stroke: "#333", "stroke-dasharray": "2,2",
      visibility: "hidden", "pointer-events": "none" });
    svg.addEventListener("mousemove", event => {
      const p = new DOMPoint(event.clientX, event.clientY).matrixTransform(svg.getScreenCTM().inverse());
      const i = nearest(s.event(p.x));
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
      showPeak(null, 0);
      el(svg, "text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no memory events recorded");
      return;
    }
    const peak = view.peak, total = stacked[peak][categories.length];
    showPeak(peak, total);
    const s = makeScales(view.x_max, view.y_max);
    const spans = phaseSpans();
    drawBands(svg, s, spans);
    drawAxes(svg, s);
    drawAreas(svg, s, stacked);
    drawFolds(svg, s);
    drawEdges(svg, s, spans);
    drawPeak(svg, s, peak, total);
    hover(svg, s, stacked);
  }

  draw();
})();
