"""Replay a call's attribution events into its typed Explanation: what was alive at the moment of each
phase's peak, by category, module and tensor, and the explained ranks of a distributed run joined in.

The attributor (`backends/tracker/attribution.py`) records every change of a storage's counted bytes in
order. Replaying them gives the bytes at any moment: a region's peak is the first moment of its largest
total, exactly the meter's figure on the tracker. A phase's composition is the growth from its start
to its peak, so its parts add up to the phase's peak; `live` is what was alive at that moment, and where
the allocator's model served the call, `reserved_at_peak` what it held in segments then.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from pytest_gpumem.backends.tracker.allocation import Allocation, RegionSpan
from pytest_gpumem.backends.tracker.attribution import Attributor
from pytest_gpumem.explain.blocks import fold, repeated_blocks
from pytest_gpumem.results import RANK_SEPARATOR, rank_phase
from pytest_gpumem.results.categories import CATEGORIES, LABELS
from pytest_gpumem.results.explanation import (
    Cell,
    Explanation,
    PhaseExplanation,
    Point,
    RanksExplanation,
    ReservedAtPeak,
    SampledTimeline,
    Tensor,
    UnmeasuredSpan,
)

if TYPE_CHECKING:
    from pytest_gpumem.results import PhaseResult

TOP_MODULES = 10
_TOP_CELLS = 10
_TOP_TENSORS = 10
_MAX_POINTS = 2000
_MAX_SPANS = 200  # of a phase entered more often, the first ones (`entries` says how many there were)
OTHER_MODULES = "(other modules)"
_FOLDED_CELLS = 24  # category x module-group parts a phase keeps (baselines store them all)

K = TypeVar("K", bound=Hashable)


@dataclass
class _Snapshot:
    """Bytes alive at one moment, aggregated."""

    categories: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    modules: dict[str, int] = field(default_factory=dict)
    cells: dict[tuple[str, str], int] = field(default_factory=dict)
    tensors: list[tuple[int, Allocation]] = field(default_factory=list)  # each with its category at the moment


def explain(attributor: Attributor, measured: Mapping[str, PhaseResult], nodeid: str, backend: str) -> Explanation:
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
    spans: dict[str, list[tuple[int, int]]] = {}
    for each in attributor.regions:
        spans.setdefault(each.name, []).append((each.start, each.end))
    folded = repeated_blocks(attributor.kinds)
    phases: dict[str, PhaseExplanation] = {}
    for name, (region, peak) in chosen.items():
        result = measured.get(name)
        computed = totals[peak] - totals[region.start]
        phases[name] = _phase(
            snapshots[region.start], snapshots[peak], folded,
            peak_bytes=computed if result is None else result.peak_bytes,
            start_bytes=totals[region.start],
            peak_index=peak,
            spans=spans[name][:_MAX_SPANS],
            entries=len(spans[name]),
            unattributed_bytes=0 if result is None else result.peak_bytes - computed,
            reserved_at_peak=_reserved_at(attributor, peak, totals),
        )  # fmt: skip
    return Explanation(
        nodeid=nodeid,
        backend=backend,
        categories=list(CATEGORIES),
        labels=dict(LABELS),
        folded=folded,
        phases=phases,
        timeline=SampledTimeline(len(totals) - 1, points, _unmeasured(attributor)),
    )


def _unmeasured(attributor: Attributor) -> list[UnmeasuredSpan]:
    """The spans of the call that gpumem.advise and gpumem.check_gradients ran, named by what ran."""
    spans = zip(attributor.paused_by, attributor.paused, strict=True)
    return [UnmeasuredSpan(by, start, end) for by, (start, end) in spans]


def _reserved_at(attributor: Attributor, moment: int, totals: array[int]) -> ReservedAtPeak | None:
    """The allocator model's reserved memory at `moment`, where the model served the call: what of it no
    block held (its segments minus the bytes allocated then), and what of that was inactive split."""
    trace = attributor.allocator_trace
    if trace is None:
        return None
    reserved, inactive_split = trace.at(moment)
    return ReservedAtPeak(reserved, reserved - totals[moment], inactive_split)


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
    regions: Sequence[RegionSpan], paused: Sequence[tuple[int, int]], totals: array[int]
) -> dict[str, tuple[RegionSpan, int]]:
    """For each region name, the entry with the highest peak above its start and that peak's moment
    (the first moment of the largest total, outside spans the meter does not measure)."""
    chosen: dict[str, tuple[RegionSpan, int]] = {}
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


def _sampled(totals: array[int], chosen: Mapping[str, tuple[RegionSpan, int]]) -> set[int]:
    """The moments a timeline shows: the highest of each bucket, plus each phase's peak."""
    keep = {peak for _, peak in chosen.values()} | {0, len(totals) - 1}
    bucket = max(1, -(-len(totals) // _MAX_POINTS))
    for low in range(0, len(totals), bucket):
        keep.add(_first_highest(totals, low, min(low + bucket, len(totals))))
    return keep


def _replay(
    attributor: Attributor, wanted: Sequence[int], sampled: set[int]
) -> tuple[dict[int, _Snapshot], list[Point]]:
    allocations = attributor.allocations
    live: dict[int, int] = {}
    by_category = dict.fromkeys(CATEGORIES, 0)
    snapshots: dict[int, _Snapshot] = {}
    points: list[Point] = []
    targets = set(wanted)
    unsaved = _unsaved(attributor)
    now: dict[int, str] = {}  # the allocations whose category changed: what each is for from then on
    events = zip(attributor.ids, attributor.sizes, strict=True)
    for moment in range(len(attributor.ids) + 1):
        if moment:
            allocation, size = next(events)
            by_category[now.get(allocation) or allocations[allocation].category] += size - live.get(allocation, 0)
            if size:
                live[allocation] = size
            else:
                live.pop(allocation, None)
        for allocation in unsaved.get(moment, ()):
            now[allocation] = "temporaries"
            by_category["saved"] -= live.get(allocation, 0)
            by_category["temporaries"] += live.get(allocation, 0)
        if moment in targets:
            snapshots[moment] = _snapshot(live, allocations, moment)
        if moment in sampled:
            points.append(Point(moment, [by_category[c] for c in CATEGORIES]))
    return snapshots, points


def _unsaved(attributor: Attributor) -> dict[int, list[int]]:
    """The allocations that stop being saved for backward after each event (their graphs released them)."""
    found: dict[int, list[int]] = {}
    for moment, index in attributor.unsaved:
        allocation = attributor.allocations[index]
        if allocation.unsaved_at == moment and allocation.category_at(moment) != allocation.category:
            found.setdefault(moment, []).append(index)
    return found


def _snapshot(live: Mapping[int, int], allocations: Sequence[Allocation], moment: int) -> _Snapshot:
    snap = _Snapshot()
    for index, size in live.items():
        allocation = allocations[index]
        category = allocation.category_at(moment)
        snap.categories[category] += size
        snap.modules[allocation.module] = snap.modules.get(allocation.module, 0) + size
        cell = (category, allocation.module)
        snap.cells[cell] = snap.cells.get(cell, 0) + size
    largest = sorted(live.items(), key=lambda kv: (-kv[1], kv[0]))[:_TOP_TENSORS]
    snap.tensors = [(size, _at(allocations[i], moment)) for i, size in largest]
    return snap


def _at(allocation: Allocation, moment: int) -> Allocation:
    category = allocation.category_at(moment)
    return allocation if category == allocation.category else replace(allocation, category=category)


def changes(start: Mapping[K, int], top: Mapping[K, int]) -> dict[K, int]:
    """`top - start` for each key of either side, the keys that did not change left out."""
    keys = dict.fromkeys([*top, *start])
    grown = {key: top.get(key, 0) - start.get(key, 0) for key in keys}
    return {key: value for key, value in grown.items() if value}


def _phase(
    start: _Snapshot, top: _Snapshot, folded: Collection[str], *, peak_bytes: int, start_bytes: int,
    peak_index: int, spans: list[tuple[int, int]], entries: int, unattributed_bytes: int,
    reserved_at_peak: ReservedAtPeak | None,
) -> PhaseExplanation:  # fmt: skip
    grown = changes(start.cells, top.cells)
    cells = sorted(grown.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:_TOP_CELLS]
    return PhaseExplanation(
        peak_bytes=peak_bytes,
        categories={c: top.categories[c] - start.categories[c] for c in CATEGORIES},
        live=dict(top.categories),
        modules=largest(changes(start.modules, top.modules), TOP_MODULES),
        cells=[Cell(c, m, b) for (c, m), b in cells],
        groups=folded_cells(grown, folded),
        tensors=[_tensor(size, allocation) for size, allocation in top.tensors],
        start_bytes=start_bytes,
        peak_index=peak_index,
        spans=spans,
        entries=entries,
        unattributed_bytes=unattributed_bytes,
        reserved_at_peak=reserved_at_peak,
    )


def largest(values: Mapping[str, int], count: int) -> dict[str, int]:
    """The `count` largest changes by size, the rest summed into one row (the sum is kept exact)."""
    ordered = sorted(values.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
    kept = dict(ordered[:count])
    rest = sum(value for _, value in ordered[count:])
    if rest:
        kept[OTHER_MODULES] = kept.get(OTHER_MODULES, 0) + rest
    return kept


def _tensor(size: int, allocation: Allocation) -> Tensor:
    return Tensor(
        size=size,
        dtype=allocation.dtype,
        shape=allocation.shape,
        op=allocation.op,
        where=allocation.where,
        module=allocation.module,
        category=allocation.category,
    )


def folded_cells(cells: Mapping[tuple[str, str], int], folds: Collection[str]) -> list[Cell]:
    """Category x module-group parts, largest change first; past `_FOLDED_CELLS`, the rest of each
    category in one "(other modules)" part (the sum stays exact)."""
    grouped: dict[tuple[str, str], int] = {}
    for (category, module), size in cells.items():
        key = (category, fold(module, folds))
        grouped[key] = grouped.get(key, 0) + size
    ordered = sorted(((k, v) for k, v in grouped.items() if v), key=lambda kv: (-abs(kv[1]), kv[0]))
    kept = dict(ordered[:_FOLDED_CELLS])
    for (category, _), size in ordered[_FOLDED_CELLS:]:
        key = (category, OTHER_MODULES)
        kept[key] = kept.get(key, 0) + size
    return [Cell(c, m, b) for (c, m), b in kept.items() if b]


# --- the ranks of gpumem.distributed()


def on_rank(phase: PhaseExplanation, rank: int) -> PhaseExplanation:
    """A rank's phase as part of the test's explanation: the rank named; its events, on the rank's own
    timeline, are not spans of the test's (`rank_peak_index` keeps where its peak was)."""
    return replace(phase, rank=rank, spans=[], peak_index=None, rank_peak_index=phase.peak_index)


def of_ranks(
    explained: Sequence[tuple[int, Explanation]], run: str, worst: Mapping[str, int]
) -> RanksExplanation | None:
    """The ranks' explanations as one, for the test's (`with_ranks`): each rank's phases as `phase@rankN`
    (its whole call as `run@rankN`), each measured phase's worst rank (`worst`: phase -> rank) as `phase`,
    the worst rank's whole run as `call`; None when no rank explained its peaks."""
    if not explained:
        return None
    phases: dict[str, PhaseExplanation] = {}
    folded: dict[str, int] = {}
    for rank, explanation in explained:
        for name, phase in explanation.phases.items():
            phases[rank_phase(run if name == "call" else name, rank)] = on_rank(phase, rank)
        folded.update(explanation.folded or {})
    for name in dict.fromkeys(n.rpartition(RANK_SEPARATOR)[0] for n in list(phases)):
        chosen = rank_phase(name, worst[name]) if name in worst else None
        if chosen in phases:
            phases[name] = phases[chosen]
    return RanksExplanation(phases, folded, phases.get(run))


def highest(
    phases: Mapping[str, PhaseExplanation], more: Mapping[str, PhaseExplanation]
) -> dict[str, PhaseExplanation]:
    """Both sets of phases, the one with the higher peak where a name is in both."""
    out = dict(phases)
    for name, phase in more.items():
        if name not in out or phase.peak_bytes > out[name].peak_bytes:
            out[name] = phase
    return out


def of_worlds(earlier: RanksExplanation, later: RanksExplanation) -> RanksExplanation:
    """Two worlds' explained ranks (`World.explained`) as one: the higher peak of each phase and of the
    whole run (`call`)."""
    calls = [c for c in (earlier.call, later.call) if c is not None]
    return RanksExplanation(
        phases=highest(earlier.phases, later.phases),
        folded={**earlier.folded, **later.folded},
        call=max(calls, key=lambda c: c.peak_bytes) if calls else None,
    )


def with_ranks(explanation: Explanation, ranks: RanksExplanation, ranks_peak: bool) -> Explanation:
    """The test's explanation with its explained ranks (per-rank phases as `phase@rankN`, the worst rank's
    as `phase`) added; the worst rank's whole run is the call's composition when that run is the call's
    peak (`ranks_peak`)."""
    phases = highest(explanation.phases, ranks.phases)
    if ranks_peak and ranks.call is not None:
        phases["call"] = ranks.call
    return replace(explanation, phases=phases, folded={**ranks.folded, **(explanation.folded or {})})
