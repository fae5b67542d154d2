"""Explain a peak: what was alive at the moment of each phase's peak, by category, module and tensor.

The attributor (`backends/attribution.py`) records every change of a storage's counted bytes in order.
Replaying them gives the bytes at any moment: a region's peak is the first moment of its largest
total, exactly the meter's figure on the tracker. A phase's composition is the growth from its start
to its peak, so its parts add up to the phase's peak; `live` is what was alive at that moment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.attribution import CATEGORIES, LABELS, Allocation, Attributor, Region
from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    from pytest_gpumem.markers import Budget, Limit
    from pytest_gpumem.results import PhaseResult

FORMAT = "pytest-gpumem explanation 1"
TOP_MODULES = 10
TOP_CELLS = 10
TOP_TENSORS = 10
MAX_POINTS = 2000
MAX_SPANS = 200  # of a phase entered more often, the first ones (`entries` says how many there were)
OTHER_MODULES = "(other modules)"
STORED_CELLS = 8


@dataclass
class _Snapshot:
    """Bytes alive at one moment, aggregated."""

    categories: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    modules: dict[str, int] = field(default_factory=dict)
    cells: dict[tuple[str, str], int] = field(default_factory=dict)
    tensors: list[tuple[int, Allocation]] = field(default_factory=list)


def explain(attributor: Attributor, measured: Mapping[str, PhaseResult], nodeid: str, backend: str) -> dict[str, Any]:
    """The explanation of a measured call (`measured`: the call and its phases, by name)."""
    allocations = attributor.allocations
    totals = _running_totals(attributor)
    chosen = _peaks(attributor.regions, attributor.paused, totals)
    wanted = sorted({i for region, peak in chosen.values() for i in (region.start, peak)})
    snapshots, points = _replay(attributor, wanted, _sampled(totals, chosen))
    spans: dict[str, list[list[int]]] = {}
    for each in attributor.regions:
        spans.setdefault(each.name, []).append([each.start, each.end])
    phases: dict[str, Any] = {}
    for name, (region, peak) in chosen.items():
        result = measured.get(name)
        start, top = snapshots[region.start], snapshots[peak]
        computed = totals[peak] - totals[region.start]
        entry = _composition(start, top, allocations)
        entry.update(
            peak_bytes=computed if result is None else result.peak_bytes,
            start_bytes=totals[region.start],
            peak_index=peak,
            spans=spans[name][:MAX_SPANS],
            entries=len(spans[name]),
            unattributed_bytes=0 if result is None else result.peak_bytes - computed,
        )
        phases[name] = entry
    return {
        "format": FORMAT,
        "nodeid": nodeid,
        "backend": backend,
        "categories": list(CATEGORIES),
        "labels": dict(LABELS),
        "phases": phases,
        "timeline": {"events": len(totals) - 1, "points": points},
    }


def _running_totals(attributor: Attributor) -> list[int]:
    """Bytes allocated after each event (index 0: before the first)."""
    sizes = [0] * len(attributor.allocations)
    total = 0
    totals = [0]
    for allocation, size in zip(attributor.ids, attributor.sizes, strict=True):
        total += size - sizes[allocation]
        sizes[allocation] = size
        totals.append(total)
    return totals


def _peaks(
    regions: Sequence[Region], paused: Sequence[tuple[int, int]], totals: Sequence[int]
) -> dict[str, tuple[Region, int]]:
    """For each region name, the entry with the highest peak above its start and that peak's moment
    (the first moment of the largest total, outside spans the meter does not measure)."""
    hidden = {i for low, high in paused for i in range(low + 1, high)}
    chosen: dict[str, tuple[Region, int]] = {}
    for region in regions:
        moments = [i for i in range(region.start, min(region.end, len(totals) - 1) + 1) if i not in hidden]
        peak = max(moments, key=lambda i: (totals[i], -i))
        previous = chosen.get(region.name)
        rise = totals[peak] - totals[region.start]
        if previous is None or rise > totals[previous[1]] - totals[previous[0].start]:
            chosen[region.name] = (region, peak)
    return chosen


def _sampled(totals: Sequence[int], chosen: Mapping[str, tuple[Region, int]]) -> set[int]:
    """The moments a timeline shows: the highest of each bucket, plus each phase's peak."""
    keep = {peak for _, peak in chosen.values()} | {0, len(totals) - 1}
    bucket = max(1, -(-len(totals) // MAX_POINTS))
    for low in range(0, len(totals), bucket):
        keep.add(max(range(low, min(low + bucket, len(totals))), key=lambda i: totals[i]))
    return keep


def _replay(
    attributor: Attributor, wanted: Sequence[int], sampled: set[int]
) -> tuple[dict[int, _Snapshot], list[list[Any]]]:
    allocations = attributor.allocations
    live: dict[int, int] = {}
    by_category = dict.fromkeys(CATEGORIES, 0)
    snapshots: dict[int, _Snapshot] = {}
    points: list[list[Any]] = []
    targets = set(wanted)
    events = zip(attributor.ids, attributor.sizes, strict=True)
    for moment in range(len(attributor.ids) + 1):
        if moment:
            allocation, size = next(events)
            by_category[allocations[allocation].category] += size - live.get(allocation, 0)
            if size:
                live[allocation] = size
            else:
                live.pop(allocation, None)
        if moment in targets:
            snapshots[moment] = _snapshot(live, allocations)
        if moment in sampled:
            points.append([moment, [by_category[c] for c in CATEGORIES]])
    return snapshots, points


def _snapshot(live: Mapping[int, int], allocations: Sequence[Allocation]) -> _Snapshot:
    snap = _Snapshot()
    for index, size in live.items():
        allocation = allocations[index]
        snap.categories[allocation.category] += size
        snap.modules[allocation.module] = snap.modules.get(allocation.module, 0) + size
        cell = (allocation.category, allocation.module)
        snap.cells[cell] = snap.cells.get(cell, 0) + size
    snap.tensors = sorted(((size, allocations[i]) for i, size in live.items()), key=lambda t: (-t[0], t[1].id))
    del snap.tensors[TOP_TENSORS:]
    return snap


def growth(start: Mapping[Any, int], top: Mapping[Any, int]) -> dict[Any, int]:
    """`top - start` for each key of either side, the keys that did not change left out."""
    keys = dict.fromkeys([*top, *start])
    grown = {key: top.get(key, 0) - start.get(key, 0) for key in keys}
    return {key: value for key, value in grown.items() if value}


def _composition(start: _Snapshot, top: _Snapshot, allocations: Sequence[Allocation]) -> dict[str, Any]:
    modules = _largest(growth(start.modules, top.modules), TOP_MODULES)
    cells = sorted(growth(start.cells, top.cells).items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:TOP_CELLS]
    return {
        "categories": {c: top.categories[c] - start.categories[c] for c in CATEGORIES},
        "live": dict(top.categories),
        "modules": modules,
        "cells": [{"category": c, "module": m, "bytes": b} for (c, m), b in cells],
        "tensors": [_tensor(size, allocation) for size, allocation in top.tensors],
    }


def _largest(values: Mapping[str, int], count: int) -> dict[str, int]:
    """The `count` largest changes by size, the rest summed into one row (the sum is kept exact)."""
    ordered = sorted(values.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
    kept = dict(ordered[:count])
    rest = sum(value for _, value in ordered[count:])
    if rest:
        kept[OTHER_MODULES] = kept.get(OTHER_MODULES, 0) + rest
    return kept


def _tensor(size: int, allocation: Allocation) -> dict[str, Any]:
    return {
        "bytes": size,
        "dtype": allocation.dtype,
        "shape": None if allocation.shape is None else list(allocation.shape),
        "op": allocation.op,
        "where": allocation.where,
        "module": allocation.module,
        "category": allocation.category,
    }


# --- compact form (baselines) and what grew


def compact(explanation: Mapping[str, Any]) -> dict[str, Any]:
    """Per phase: the growth by category (sums to the peak) and the largest category x module cells."""
    out: dict[str, Any] = {}
    for name, phase in explanation["phases"].items():
        categories = {c: b for c, b in phase["categories"].items() if b}
        if phase.get("unattributed_bytes"):
            categories["unattributed"] = phase["unattributed_bytes"]
        cells = [[cell["category"], cell["module"], cell["bytes"]] for cell in phase["cells"][:STORED_CELLS]]
        out[name] = {"categories": categories, "cells": cells}
    return out


def what_grew(stored: Mapping[str, Any] | None, current: Mapping[str, Any] | None, phase: str) -> str | None:
    """The part of `phase` (compact compositions) that grew most against the baseline, e.g.
    "saved for backward of decoder.1 +3.9 MiB"; None when either side has no composition."""
    if not stored or not current or phase not in stored or phase not in current:
        return None
    old, new = stored[phase], current[phase]
    before = {(c, m): b for c, m, b in old.get("cells", [])}
    after = {(c, m): b for c, m, b in new.get("cells", [])}
    # only the largest cells are stored: one on a single side may have been just off the other's list
    cells = {cell: after[cell] - before[cell] for cell in after if cell in before}
    categories = growth(old.get("categories", {}), new.get("categories", {}))
    parts = [(LABELS.get(c, c) + f" of {m}", b) for (c, m), b in cells.items()]
    parts += [(LABELS.get(c, c), b) for c, b in categories.items()]
    grown = [(what, b) for what, b in parts if b > 0]
    if not grown:
        return None
    what, size = max(grown, key=lambda part: part[1])
    return f"{what} +{format_size(size)}"


# --- text


def describe(explanation: Mapping[str, Any], fmt: Any = format_size) -> list[str]:
    """Lines for the test's report section."""
    lines = [f"peak explained ({explanation['backend']}):"]
    for name, phase in explanation["phases"].items():
        lines.append(f"  {name}: peak {fmt(phase['peak_bytes'])} = {_parts(phase, fmt)}")
        modules = ", ".join(f"{m} {_signed(b, fmt)}" for m, b in phase["modules"].items())
        if modules:
            lines.append(f"    by module: {modules}")
        for tensor in phase["tensors"][:3]:
            lines.append(f"    alive at the peak: {describe_tensor(tensor, fmt)}")
    return lines


def _parts(phase: Mapping[str, Any], fmt: Any) -> str:
    parts = [f"{LABELS[c]} {_signed(b, fmt)}" for c, b in phase["categories"].items() if b]
    if phase.get("unattributed_bytes"):
        parts.append(f"unattributed {_signed(phase['unattributed_bytes'], fmt)}")
    return ", ".join(parts) or "nothing"


def _signed(value: int, fmt: Any) -> str:
    return f"-{fmt(-value)}" if value < 0 else str(fmt(value))


def describe_tensor(tensor: Mapping[str, Any], fmt: Any = format_size) -> str:
    what = "a storage" if tensor["dtype"] is None else f"{tensor['dtype']}{tensor['shape']}"
    where = f" at {tensor['where']}" if tensor["where"] else ""
    used = f"{LABELS[tensor['category']]}, {tensor['module']}"
    return f"{fmt(tensor['bytes'])} {what} ({used}), made by {tensor['op']}{where}"


def summary(explanation: Mapping[str, Any], phase: str = "call", count: int = 2) -> str:
    """A few words for a table cell: the largest parts of a phase's peak."""
    found = explanation["phases"].get(phase)
    if found is None:
        return ""
    parts = sorted(((b, c) for c, b in found["categories"].items() if b > 0), reverse=True)[:count]
    return ", ".join(f"{LABELS[c]} {format_size(b)}" for b, c in parts)


# --- in failure messages

HOW_TO_EXPLAIN = "see what made it with --gpumem-explain or max_memory(explain=True)"


def section(explanation: Mapping[str, Any] | None) -> str:
    return "" if explanation is None else "\n" + "\n".join(describe(explanation))


def over_limit(budget: Budget | None, call: PhaseResult, phases: Mapping[str, PhaseResult]) -> list[tuple[str, Limit]]:
    """The regions whose peaks exceed the budget ("call" for the whole call), with their limits."""
    if budget is None:
        return []
    over = [("call", budget.total)] if budget.total is not None and call.peak_bytes > budget.total.bytes else []
    return over + [
        (n, limit) for n, limit in budget.phases.items() if n in phases and phases[n].peak_bytes > limit.bytes
    ]


def made_of(explanation: Mapping[str, Any] | None, over: Sequence[tuple[str, Limit]]) -> str:
    """What a failure message adds: the largest parts of the first failing region's peak (in its limit's
    units), or how to get them."""
    if not over:
        return ""
    if explanation is None:
        return f" ({HOW_TO_EXPLAIN})"
    region, limit = over[0]
    phase = explanation["phases"].get(region)
    if phase is None:
        return ""
    cells = [c for c in phase["cells"] if c["bytes"] > 0][:2]
    parts = [f"{LABELS[c['category']]} of {c['module']} {limit.fmt(c['bytes'])}" for c in cells]
    return f"; {region} peak made of {', '.join(parts)}, ..." if parts else ""
