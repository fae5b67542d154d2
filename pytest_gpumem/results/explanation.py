"""What made each peak, as typed data: the explanation of a test call (per phase its peak, its growth by
category and module, the largest tensors alive at it, when it ran; the call's timeline) and the compact
composition a baseline stores. Each type has one to/from-JSON; the JSON is the report's `explanation`
and the baseline's `composition`, in the shape and key order they have always had.

`from_json` reads explanations made by earlier versions too: without `live` (before the page), without
`groups` and `folded` (before repeated blocks were folded), without `entries` (before spans were capped),
without the timeline's `unmeasured` spans (before the page folded advise's runs), without a phase's
`reserved_at_peak` (before the allocator's model was explained).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pytest_gpumem.results.checks import OffShape, fields, json_key, listed, member, refuse, signed_bytes, text
from pytest_gpumem.results.codec import Spec, Wording, encode

_FORMAT = "pytest-gpumem explanation 1"


def _span(data: Any, where: str) -> tuple[int, int]:
    if not isinstance(data, list) or len(data) != 2:
        raise refuse(where, "[first event, last event]", data)
    return _int(data[0], f"{where}[0]"), _int(data[1], f"{where}[1]")


def _int(value: Any, where: str) -> int:
    """An integer as JSON has it (a report edited by hand may hold "12" or true: refused, not converted)."""
    if type(value) is not int:
        raise refuse(where, "an integer", value)
    return value


def _str(value: Any, where: str) -> str:
    return text(value, where)


def _int_or_none(value: Any, where: str) -> int | None:
    return None if value is None else _int(value, where)


def _str_or_none(value: Any, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _object(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise refuse(where, "an object", data)
    return data


def _needed(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise OffShape(f"{where} has no {json_key(key)}")
    return data[key]


def _sizes(data: Any, where: str) -> dict[str, int]:
    return {key: _int(value, member(where, key)) for key, value in _object(data, where).items()}


def _each(data: Any, where: str) -> list[tuple[Any, str]]:
    """The items of a JSON list with their paths."""
    return [(item, f"{where}[{i}]") for i, item in enumerate(listed(data, where))]


@dataclass(frozen=True)
class Cell:
    """The growth of one category in one module (or module group) over a phase, in bytes."""

    category: str
    module: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"category": self.category, "module": self.module, "bytes": self.size}

    @classmethod
    def from_json(cls, data: Any, where: str = "cell") -> Cell:
        d = fields(data, where, ("category", "module", "bytes"))
        return cls(
            _str(d["category"], f"{where}.category"),
            _str(d["module"], f"{where}.module"),
            _int(d["bytes"], f"{where}.bytes"),
        )


@dataclass(frozen=True)
class Tensor:
    """A storage alive at a phase's peak: its bytes, what made it and where, what it is used for."""

    size: int
    dtype: str | None
    shape: tuple[int, ...] | None
    op: str
    where: str | None
    module: str
    category: str

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.size,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "op": self.op,
            "where": self.where,
            "module": self.module,
            "category": self.category,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "tensor") -> Tensor:
        d = _object(data, where)
        shape = d.get("shape")
        return cls(
            size=_int(_needed(d, "bytes", where), f"{where}.bytes"),
            dtype=_str_or_none(d.get("dtype"), f"{where}.dtype"),
            shape=None if shape is None else tuple(_int(size, at) for size, at in _each(shape, f"{where}.shape")),
            op=_str(d.get("op", ""), f"{where}.op"),
            where=_str_or_none(d.get("where"), f"{where}.where"),
            module=_str(d.get("module", ""), f"{where}.module"),
            category=_str(d.get("category", ""), f"{where}.category"),
        )


@dataclass(frozen=True)
class ReservedAtPeak:
    """The allocator model's memory at a phase's peak, as a card would hold it: `reserved` (its segments,
    all of the call's), `unallocated` of it in no block, and `inactive_split` of that in free blocks of
    segments that still hold a live block (what no retry or `empty_cache()` can give back)."""

    reserved: int
    unallocated: int
    inactive_split: int

    def to_json(self) -> dict[str, Any]:
        return {
            "reserved_bytes": self.reserved,
            "unallocated_bytes": self.unallocated,
            "inactive_split_bytes": self.inactive_split,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "reserved_at_peak") -> ReservedAtPeak:
        keys = ("reserved_bytes", "unallocated_bytes", "inactive_split_bytes")
        d = fields(data, where, keys)
        return cls(*(_int(d[key], f"{where}.{key}") for key in keys))


@dataclass(frozen=True)
class PhaseExplanation:
    """One phase's peak explained. `categories`, `modules`, `cells` and `groups` are the growth from the
    phase's start to its peak (they add up to it); `live` is what was alive at the peak by category;
    `groups` are the category x module-group parts with repeated blocks folded. A rank's phase (`rank`
    set) has no spans on the test's timeline; `rank_peak_index` is where its peak was on the rank's own.
    `reserved_at_peak` is there where the allocator's model served the call (`--gpumem-round=cuda`)."""

    peak_bytes: int
    categories: dict[str, int]
    modules: dict[str, int]
    cells: list[Cell]
    tensors: list[Tensor]
    start_bytes: int = 0
    live: dict[str, int] | None = None
    groups: list[Cell] | None = None
    peak_index: int | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    entries: int | None = None
    unattributed_bytes: int = 0
    rank: int | None = None
    rank_peak_index: int | None = None
    reserved_at_peak: ReservedAtPeak | None = None

    @property
    def parts(self) -> list[Cell]:
        """The category x module parts: the folded groups, or the largest cells of an explanation made
        before folding."""
        return self.cells if self.groups is None else self.groups

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"categories": dict(self.categories)}
        if self.live is not None:
            data["live"] = dict(self.live)
        data["modules"] = dict(self.modules)
        data["cells"] = [cell.to_json() for cell in self.cells]
        if self.groups is not None:
            data["groups"] = [cell.to_json() for cell in self.groups]
        data["tensors"] = [tensor.to_json() for tensor in self.tensors]
        data["peak_bytes"] = self.peak_bytes
        data["start_bytes"] = self.start_bytes
        if self.rank is None:
            data["peak_index"] = self.peak_index
            data["spans"] = [list(span) for span in self.spans]
        if self.entries is not None:
            data["entries"] = self.entries
        data["unattributed_bytes"] = self.unattributed_bytes
        if self.reserved_at_peak is not None:
            data["reserved_at_peak"] = self.reserved_at_peak.to_json()
        if self.rank is not None:
            data.update(rank=self.rank, spans=[list(span) for span in self.spans], rank_peak_index=self.rank_peak_index)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "phase") -> PhaseExplanation:
        d = _object(data, where)
        groups, live, entries = d.get("groups"), d.get("live"), d.get("entries")
        reserved = d.get("reserved_at_peak")
        return cls(
            peak_bytes=_int(_needed(d, "peak_bytes", where), f"{where}.peak_bytes"),
            categories=_sizes(_needed(d, "categories", where), f"{where}.categories"),
            modules=_sizes(_needed(d, "modules", where), f"{where}.modules"),
            cells=[Cell.from_json(cell, at) for cell, at in _each(_needed(d, "cells", where), f"{where}.cells")],
            tensors=[Tensor.from_json(t, at) for t, at in _each(_needed(d, "tensors", where), f"{where}.tensors")],
            start_bytes=_int(d.get("start_bytes", 0), f"{where}.start_bytes"),
            live=None if live is None else _sizes(live, f"{where}.live"),
            groups=None if groups is None else [Cell.from_json(c, at) for c, at in _each(groups, f"{where}.groups")],
            peak_index=_int_or_none(d.get("peak_index"), f"{where}.peak_index"),
            spans=[_span(span, at) for span, at in _each(d.get("spans", []), f"{where}.spans")],
            entries=None if entries is None else _int(entries, f"{where}.entries"),
            unattributed_bytes=_int(d.get("unattributed_bytes", 0), f"{where}.unattributed_bytes"),
            rank=_int_or_none(d.get("rank"), f"{where}.rank"),
            rank_peak_index=_int_or_none(d.get("rank_peak_index"), f"{where}.rank_peak_index"),
            reserved_at_peak=None
            if reserved is None
            else ReservedAtPeak.from_json(reserved, f"{where}.reserved_at_peak"),
        )


@dataclass(frozen=True)
class Point:
    """Live bytes by category (in the explanation's category order) after event `index` of the call."""

    index: int
    sizes: list[int]

    def to_json(self) -> list[Any]:
        return [self.index, list(self.sizes)]

    @classmethod
    def from_json(cls, data: Any, where: str = "point") -> Point:
        if not isinstance(data, list) or len(data) != 2:
            raise refuse(where, "[event index, [bytes per category]]", data)
        index, sizes = data
        return cls(_int(index, f"{where}[0]"), [_int(size, at) for size, at in _each(sizes, f"{where}[1]")])

    @property
    def total(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class UnmeasuredSpan:
    """Events [start, end] of the call that no phase measures: what gpumem.advise or
    gpumem.check_gradients (`by`) ran inside the test."""

    by: str
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, data: Any, where: str = "unmeasured") -> UnmeasuredSpan:
        d = fields(data, where, ("by", "start", "end"))
        return cls(_str(d["by"], f"{where}.by"), _int(d["start"], f"{where}.start"), _int(d["end"], f"{where}.end"))


@dataclass(frozen=True)
class SampledTimeline:
    """How many events the call had, the sampled moments a chart draws, and the spans not measured."""

    events: int
    points: list[Point]
    unmeasured: list[UnmeasuredSpan] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"events": self.events, "points": [point.to_json() for point in self.points]}
        if self.unmeasured:
            data["unmeasured"] = [span.to_json() for span in self.unmeasured]
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "timeline") -> SampledTimeline:
        d = _object(data, where)
        return cls(
            _int(d.get("events", 0), f"{where}.events"),
            [Point.from_json(point, at) for point, at in _each(d.get("points", []), f"{where}.points")],
            [UnmeasuredSpan.from_json(span, at) for span, at in _each(d.get("unmeasured", []), f"{where}.unmeasured")],
        )


@dataclass(frozen=True)
class Explanation:
    """What made the peaks of one test call, phase by phase (`call` is the whole call). `categories`
    are in stacking order with their `labels`; `folded` names each group of repeated blocks (`h.*`)
    with how many blocks it has (None in explanations made before folding)."""

    nodeid: str
    backend: str
    categories: list[str]
    labels: dict[str, str]
    phases: dict[str, PhaseExplanation]
    timeline: SampledTimeline
    folded: dict[str, int] | None = None
    format: str = _FORMAT

    def label(self, category: str) -> str:
        return self.labels.get(category, category)

    def blocks(self, group: str) -> int | None:
        """How many blocks a folded group has, None for any other module."""
        return None if self.folded is None else self.folded.get(group)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format,
            "nodeid": self.nodeid,
            "backend": self.backend,
            "categories": list(self.categories),
            "labels": dict(self.labels),
        }
        if self.folded is not None:
            data["folded"] = dict(self.folded)
        data["phases"] = {name: phase.to_json() for name, phase in self.phases.items()}
        data["timeline"] = self.timeline.to_json()
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "explanation") -> Explanation:
        d = _object(data, where)
        folded = d.get("folded")
        labels = _object(d.get("labels", {}), f"{where}.labels")
        phases = _object(_needed(d, "phases", where), f"{where}.phases")
        return cls(
            nodeid=_str(d.get("nodeid", ""), f"{where}.nodeid"),
            backend=_str(d.get("backend", "?"), f"{where}.backend"),
            categories=[_str(c, at) for c, at in _each(d.get("categories", []), f"{where}.categories")],
            labels={key: _str(value, member(f"{where}.labels", key)) for key, value in labels.items()},
            phases={
                name: PhaseExplanation.from_json(phase, member(f"{where}.phases", name))
                for name, phase in phases.items()
            },
            timeline=SampledTimeline.from_json(d.get("timeline", {}), f"{where}.timeline"),
            folded=None if folded is None else _sizes(folded, f"{where}.folded"),
            format=_str(d.get("format", _FORMAT), f"{where}.format"),
        )


@dataclass(frozen=True)
class RanksExplanation:
    """The explained ranks of a distributed run as parts of the test's explanation: each rank's phases as
    `phase@rankN`, each phase's worst rank as `phase`, the worst rank's whole run as `call` (None when
    not explained)."""

    phases: dict[str, PhaseExplanation]
    folded: dict[str, int]
    call: PhaseExplanation | None


def _signed_sizes(value: dict[str, Any]) -> bool:
    return all(isinstance(k, str) and signed_bytes(v) for k, v in value.items())


def _is_folded(value: dict[str, Any]) -> bool:
    return all(isinstance(g, str) and signed_bytes(n) and n > 0 for g, n in value.items())


def _is_cell(cell: object) -> bool:
    return (
        isinstance(cell, list)
        and len(cell) == 3
        and isinstance(cell[0], str)
        and isinstance(cell[1], str)
        and signed_bytes(cell[2])
    )


def _read_cells(value: Any, where: str, wording: Wording) -> list[Cell]:
    if not isinstance(value, list) or not all(_is_cell(cell) for cell in value):
        raise wording.refuse(where, "a list of [category, module, bytes]", value)
    return [Cell(*cell) for cell in value]


def _write_cells(cells: list[Cell]) -> list[list[Any]]:
    return [[cell.category, cell.module, cell.size] for cell in cells]


@dataclass(frozen=True)
class PhaseComposition:
    """What a baseline keeps of a phase's explanation: the growth by category (sums to the peak, with
    `unattributed`; a byte count may be negative, a phase that freed what was alive at its start), the
    category x module-group parts (`[category, module, bytes]` each), and how many blocks each folded
    group has (None in compositions made before folding, which keep only their largest cells)."""

    categories: Annotated[dict[str, int], Spec(expected="an object of category -> bytes", check=_signed_sizes)]
    cells: Annotated[list[Cell], Spec(via=(_read_cells, _write_cells))]
    folded: Annotated[
        dict[str, int] | None, Spec(omit=None, expected="an object of module group -> blocks", check=_is_folded)
    ] = None


Composition = dict[str, PhaseComposition]
"""A test's composition: per phase name."""

COMPOSITION = Spec(
    expected="an object of phase name -> parts", names=bool, names_expected="phase names must be non-empty strings"
)
"""What a stored composition must be (`StoredComposition`, a baseline entry's `composition`)."""

StoredComposition = Annotated[Composition, COMPOSITION]


def composition_to_json(composition: Mapping[str, PhaseComposition]) -> dict[str, Any]:
    written: dict[str, Any] = encode(dict(composition), Composition)
    return written
