"""Explain a peak: what was alive at the moment of each phase's peak, by category, module and tensor.

The attributor (`backends/attribution.py`) records every change of a storage's counted bytes in order.
Replaying them gives the bytes at any moment: a region's peak is the first moment of its largest
total, exactly the meter's figure on the tracker. A phase's composition is the growth from its start
to its peak, so its parts add up to the phase's peak; `live` is what was alive at that moment.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.tracker.attribution import CATEGORIES, LABELS, Allocation, Attributor, Region
from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.results import PhaseResult

FORMAT = "pytest-gpumem explanation 1"
TOP_MODULES = 10
TOP_CELLS = 10
TOP_TENSORS = 10
MAX_POINTS = 2000
MAX_SPANS = 200  # of a phase entered more often, the first ones (`entries` says how many there were)
OTHER_MODULES = "(other modules)"
STORED_CELLS = 8  # of an explanation made before folding
FOLDED_CELLS = 24  # category x module-group parts a phase keeps (baselines store them all)
TOP_GROWN = 3  # module groups a regression names


@dataclass
class _Snapshot:
    """Bytes alive at one moment, aggregated."""

    categories: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    modules: dict[str, int] = field(default_factory=dict)
    cells: dict[tuple[str, str], int] = field(default_factory=dict)
    tensors: list[tuple[int, Allocation]] = field(default_factory=list)


def explain(attributor: Attributor, measured: Mapping[str, PhaseResult], nodeid: str, backend: str) -> dict[str, Any]:
    """The explanation of a measured call (`measured`: the call and its phases, by name)."""
    if attributor.overflowed:
        raise ValueError(
            f"the call made more than {attributor.limit:,} allocations, resizes and frees, the most an explanation "
            "follows (its host memory stays under about 100 MB)"
        )
    totals = _running_totals(attributor)
    chosen = _peaks(attributor.regions, attributor.paused, totals)
    wanted = sorted({i for region, peak in chosen.values() for i in (region.start, peak)})
    snapshots, points = _replay(attributor, wanted, _sampled(totals, chosen))
    spans: dict[str, list[list[int]]] = {}
    for each in attributor.regions:
        spans.setdefault(each.name, []).append([each.start, each.end])
    folded = repeated_blocks(attributor.kinds)
    phases: dict[str, Any] = {}
    for name, (region, peak) in chosen.items():
        result = measured.get(name)
        start, top = snapshots[region.start], snapshots[peak]
        computed = totals[peak] - totals[region.start]
        entry = _composition(start, top, folded)
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
        "folded": folded,
        "phases": phases,
        "timeline": {"events": len(totals) - 1, "points": points},
    }


def _running_totals(attributor: Attributor) -> array[int]:
    """Bytes allocated after each event (index 0: before the first)."""
    sizes = array("q", bytes(8 * len(attributor.allocations)))
    total = 0
    totals = array("q", [0])
    for allocation, size in zip(attributor.ids, attributor.sizes, strict=True):
        total += size - sizes[allocation]
        sizes[allocation] = size
        totals.append(total)
    return totals


def _peaks(
    regions: Sequence[Region], paused: Sequence[tuple[int, int]], totals: array[int]
) -> dict[str, tuple[Region, int]]:
    """For each region name, the entry with the highest peak above its start and that peak's moment
    (the first moment of the largest total, outside spans the meter does not measure)."""
    chosen: dict[str, tuple[Region, int]] = {}
    for region in regions:
        peak = _first_highest(totals, region.start, min(region.end, len(totals) - 1) + 1, paused)
        previous = chosen.get(region.name)
        rise = totals[peak] - totals[region.start]
        if previous is None or rise > totals[previous[1]] - totals[previous[0].start]:
            chosen[region.name] = (region, peak)
    return chosen


def _first_highest(totals: array[int], low: int, high: int, paused: Sequence[tuple[int, int]] = ()) -> int:
    """The first moment in [low, high) of the largest total, leaving out the moments inside paused spans."""
    best: int | None = None
    start = low
    for begin, end in [*sorted(paused), (high, high)]:
        stop = min(max(begin + 1, start), high)
        if stop > start:
            part = totals[start:stop]
            top = max(part)
            if best is None or top > totals[best]:
                best = start + part.index(top)
        start = max(start, end)
        if start >= high:
            break
    return low if best is None else best


def _sampled(totals: array[int], chosen: Mapping[str, tuple[Region, int]]) -> set[int]:
    """The moments a timeline shows: the highest of each bucket, plus each phase's peak."""
    keep = {peak for _, peak in chosen.values()} | {0, len(totals) - 1}
    bucket = max(1, -(-len(totals) // MAX_POINTS))
    for low in range(0, len(totals), bucket):
        keep.add(_first_highest(totals, low, min(low + bucket, len(totals))))
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
    largest = sorted(live.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_TENSORS]
    snap.tensors = [(size, allocations[i]) for i, size in largest]
    return snap


def growth(start: Mapping[Any, int], top: Mapping[Any, int]) -> dict[Any, int]:
    """`top - start` for each key of either side, the keys that did not change left out."""
    keys = dict.fromkeys([*top, *start])
    grown = {key: top.get(key, 0) - start.get(key, 0) for key in keys}
    return {key: value for key, value in grown.items() if value}


def _composition(start: _Snapshot, top: _Snapshot, folded: Collection[str]) -> dict[str, Any]:
    modules = _largest(growth(start.modules, top.modules), TOP_MODULES)
    grown = growth(start.cells, top.cells)
    cells = sorted(grown.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:TOP_CELLS]
    return {
        "categories": {c: top.categories[c] - start.categories[c] for c in CATEGORIES},
        "live": dict(top.categories),
        "modules": modules,
        "cells": [{"category": c, "module": m, "bytes": b} for (c, m), b in cells],
        "groups": _folded_cells(grown, folded),
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


# --- the ranks of gpumem.distributed()


def on_rank(entry: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """A rank's phase as part of the test's explanation: the rank named; its events, on the rank's own
    timeline, are not spans of the test's (`rank_peak_index` keeps where its peak was)."""
    kept = {key: value for key, value in entry.items() if key not in ("spans", "peak_index")}
    return {**kept, "rank": rank, "spans": [], "rank_peak_index": entry.get("peak_index")}


def highest(phases: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """Both sets of phase entries, the one with the higher peak where a name is in both."""
    out = dict(phases)
    for name, entry in more.items():
        if name not in out or entry["peak_bytes"] > out[name]["peak_bytes"]:
            out[name] = entry
    return out


def of_worlds(earlier: Mapping[str, Any], later: Mapping[str, Any]) -> dict[str, Any]:
    """Two worlds' explained ranks (`World.explained`) as one: the higher peak of each phase and of the
    whole run (`call`)."""
    calls = [c for c in (earlier.get("call"), later.get("call")) if c is not None]
    return {
        "phases": highest(earlier["phases"], later["phases"]),
        "folded": {**earlier["folded"], **later["folded"]},
        "call": max(calls, key=lambda c: c["peak_bytes"]) if calls else None,
    }


def with_ranks(explanation: Mapping[str, Any], ranks: Mapping[str, Any], ranks_peak: bool) -> dict[str, Any]:
    """The test's explanation with its explained ranks (`World.explained`: per-rank entries as `phase@rankN`,
    the worst rank's as `phase`) added; the worst rank's whole run is the call's composition when that run
    is the call's peak (`ranks_peak`)."""
    phases = highest(explanation["phases"], ranks["phases"])
    if ranks_peak and ranks.get("call") is not None:
        phases["call"] = ranks["call"]
    folded = {**ranks["folded"], **(explanation.get("folded") or {})}
    return {**explanation, "phases": phases, "folded": folded}


# --- compact form (baselines) and what grew


def compact(explanation: Mapping[str, Any]) -> dict[str, Any]:
    """Per phase: the growth by category (sums to the peak), the category x module-group parts (all of
    them, repeated blocks folded, or the largest ones of an explanation made before folding) and how many
    blocks each folded group has."""
    folded = explanation.get("folded")
    out: dict[str, Any] = {}
    for name, phase in explanation["phases"].items():
        categories = {c: b for c, b in phase["categories"].items() if b}
        if phase.get("unattributed_bytes"):
            categories["unattributed"] = phase["unattributed_bytes"]
        if isinstance(folded, dict) and isinstance(phase.get("groups"), list):
            cells = [[cell["category"], cell["module"], cell["bytes"]] for cell in phase["groups"]]
            blocks = {group: count for group, count in folded.items() if any(cell[1] == group for cell in cells)}
            out[name] = {"categories": categories, "cells": cells, "folded": blocks}
        else:
            cells = [[cell["category"], cell["module"], cell["bytes"]] for cell in phase["cells"][:STORED_CELLS]]
            out[name] = {"categories": categories, "cells": cells}
    return out


def what_grew(stored: Mapping[str, Any] | None, current: Mapping[str, Any] | None, phase: str) -> str | None:
    """Where `phase` (compact compositions) grew against the baseline: the module groups ranked by their
    growth, repeated blocks folded, modules new or gone named, e.g. "blocks.* +3.0 MiB (4 blocks), saved
    for backward; head +64.0 KiB (new), parameters"; None when either side has no composition."""
    if not stored or not current or phase not in stored or phase not in current:
        return None
    old, new = stored[phase], current[phase]
    return describe_growth(Growth.of(old, new)) or _category_growth(old, new)


@dataclass
class Growth:
    """A phase's change between two compact compositions, by module group and category."""

    groups: dict[str, dict[str, int]]  # group -> category -> change (bytes)
    added: list[str]  # groups only the current side has (None of it when a side lists only its largest)
    gone: list[str]
    blocks: dict[str, int]  # folded group -> how many blocks now
    was: dict[str, int]  # folded group -> how many blocks in the baseline

    @classmethod
    def of(cls, old: Mapping[str, Any], new: Mapping[str, Any]) -> Growth:
        was, blocks = dict(old.get("folded") or {}), dict(new.get("folded") or {})
        folds = {*was, *blocks}
        before, after = _by_cell(old, folds), _by_cell(new, folds)
        complete = "folded" in old and "folded" in new
        if not complete:  # a side lists only its largest cells: one missing there may just be off the list
            common = before.keys() & after.keys()
            before = {k: v for k, v in before.items() if k in common}
            after = {k: v for k, v in after.items() if k in common}
        groups: dict[str, dict[str, int]] = {}
        for (category, group), size in growth(before, after).items():
            groups.setdefault(group, {})[category] = size
        old_groups, new_groups = {g for _, g in before}, {g for _, g in after}
        added = sorted(new_groups - old_groups - {OTHER_MODULES}) if complete else []
        gone = sorted(old_groups - new_groups - {OTHER_MODULES}) if complete else []
        return cls(groups, added, gone, blocks, was)

    def ranked(self) -> list[tuple[str, int]]:
        """The groups that grew, most first."""
        totals = [(group, sum(parts.values())) for group, parts in self.groups.items()]
        return sorted(((g, t) for g, t in totals if t > 0), key=lambda gt: (-gt[1], gt[0]))


def describe_growth(grew: Growth, count: int = TOP_GROWN, fmt: Any = format_size) -> str:
    """The `count` groups that grew most, then the other new and gone ones by name."""
    ranked = grew.ranked()[:count]
    parts = [f"{g} +{fmt(total)}{_blocks_note(grew, g)}{_by_category(grew.groups[g], fmt)}" for g, total in ranked]
    shown = {group for group, _ in ranked}
    added = [group for group in grew.added if group not in shown]
    if added:
        parts.append(f"new: {_names(added)}")
    if grew.gone:
        parts.append(f"gone: {_names(grew.gone)}")
    return "; ".join(parts)


def _blocks_note(grew: Growth, group: str) -> str:
    if group in grew.added:
        return " (new)"
    now, was = grew.blocks.get(group), grew.was.get(group)
    if now is None:
        return ""
    return f" ({now} blocks, was {was})" if was is not None and was != now else f" ({now} blocks)"


def _by_category(parts: Mapping[str, int], fmt: Any) -> str:
    grown = sorted(((b, c) for c, b in parts.items() if b > 0), key=lambda bc: (-bc[0], bc[1]))
    if len(grown) == 1:
        return f", {LABELS.get(grown[0][1], grown[0][1])}"
    return ": " + ", ".join(f"{LABELS.get(c, c)} +{fmt(b)}" for b, c in grown[:2])


def _names(groups: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
    return ", ".join(groups[:shown]) + more


def _by_cell(side: Mapping[str, Any], folds: set[str]) -> dict[tuple[str, str], int]:
    cells: dict[tuple[str, str], int] = {}
    for category, module, size in side.get("cells", []):
        key = (category, fold(module, folds))
        cells[key] = cells.get(key, 0) + size
    return cells


def _category_growth(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    grown = [(c, b) for c, b in growth(old.get("categories", {}), new.get("categories", {})).items() if b > 0]
    if not grown:
        return None
    category, size = max(grown, key=lambda part: part[1])
    return f"{LABELS.get(category, category)} +{format_size(size)}"


# --- repeated blocks, folded


def repeated_blocks(kinds: Mapping[str, str]) -> dict[str, int]:
    """Lists of one kind of module: each parent whose numbered children (`h.0`, `h.1`, ...) are two or
    more of one class, as its group (`h.*`) with how many there are."""
    classes: dict[str, set[str]] = {}
    numbers: dict[str, set[str]] = {}
    for name, kind in kinds.items():
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            classes.setdefault(parent, set()).add(kind)
            numbers.setdefault(parent, set()).add(last)
    return {
        _group(parent): len(numbers[parent])
        for parent, found in classes.items()
        if len(found) == 1 and len(numbers[parent]) > 1
    }


def fold(module: str, folds: Collection[str]) -> str:
    """The group of `module`: the path up to its first number in a folded list, the number made `*`
    (`transformer.h.3.mlp` -> `transformer.h.*`); other modules are their own group."""
    if not folds:
        return module
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.isdigit() and _group(".".join(parts[:index])) in folds:
            return _group(".".join(parts[:index]))
    return module


def _group(parent: str) -> str:
    return f"{parent}.*" if parent else "*"


def _folded_cells(cells: Mapping[tuple[str, str], int], folds: Collection[str]) -> list[dict[str, Any]]:
    """Category x module-group parts, largest change first; past `FOLDED_CELLS`, the rest of each
    category in one "(other modules)" part (the sum stays exact)."""
    grouped: dict[tuple[str, str], int] = {}
    for (category, module), size in cells.items():
        key = (category, fold(module, folds))
        grouped[key] = grouped.get(key, 0) + size
    ordered = sorted(((k, v) for k, v in grouped.items() if v), key=lambda kv: (-abs(kv[1]), kv[0]))
    kept = dict(ordered[:FOLDED_CELLS])
    for (category, _), size in ordered[FOLDED_CELLS:]:
        key = (category, OTHER_MODULES)
        kept[key] = kept.get(key, 0) + size
    return [{"category": c, "module": m, "bytes": b} for (c, m), b in kept.items() if b]


# --- text


def describe(explanation: Mapping[str, Any], fmt: Any = format_size) -> list[str]:
    """Lines for the test's report section."""
    lines = [f"peak explained ({explanation['backend']}):"]
    for name, phase in explanation["phases"].items():
        lines.append(f"  {name}: peak {fmt(phase['peak_bytes'])} = {_parts(phase, fmt)}")
        modules = ", ".join(f"{m} {_signed(b, fmt)}{_blocks(explanation, m)}" for m, b in _by_group(phase).items())
        if modules:
            lines.append(f"    by module: {modules}")
        for tensor in phase["tensors"][:3]:
            lines.append(f"    alive at the peak: {describe_tensor(tensor, fmt)}")
    return lines


def _by_group(phase: Mapping[str, Any]) -> dict[str, int]:
    """Growth by module group (repeated blocks folded), largest first; `modules` of an explanation made
    before folding."""
    if not isinstance(phase.get("groups"), list):
        return dict(phase["modules"])
    totals: dict[str, int] = {}
    for cell in phase["groups"]:
        totals[cell["module"]] = totals.get(cell["module"], 0) + cell["bytes"]
    return _largest(growth({}, totals), TOP_MODULES)


def _blocks(explanation: Mapping[str, Any], group: str) -> str:
    count = (explanation.get("folded") or {}).get(group)
    return "" if count is None else f" ({count} blocks)"


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
    listed = phase["groups"] if isinstance(phase.get("groups"), list) else phase["cells"]
    cells = [c for c in listed if c["bytes"] > 0][:2]
    parts = [
        f"{LABELS[c['category']]} of {c['module']}{_blocks(explanation, c['module'])} {limit.fmt(c['bytes'])}"
        for c in cells
    ]
    return f"; {region} peak made of {', '.join(parts)}, ..." if parts else ""
