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
from typing import Any

FORMAT = "pytest-gpumem explanation 1"


def _int(value: Any) -> int:
    """An integer as JSON has it (a report edited by hand may hold "12" or true: refused, not converted)."""
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r:.40}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r:.40}")
    return value


def _int_or_none(value: Any) -> int | None:
    return None if value is None else _int(value)


def _str_or_none(value: Any) -> str | None:
    return None if value is None else _str(value)


def _sizes(data: Mapping[str, Any]) -> dict[str, int]:
    return {_str(key): _int(value) for key, value in data.items()}


@dataclass(frozen=True)
class Cell:
    """The growth of one category in one module (or module group) over a phase, in bytes."""

    category: str
    module: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"category": self.category, "module": self.module, "bytes": self.size}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cell:
        return cls(_str(data["category"]), _str(data["module"]), _int(data["bytes"]))


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
    def from_json(cls, data: Mapping[str, Any]) -> Tensor:
        shape = data.get("shape")
        return cls(
            size=_int(data["bytes"]),
            dtype=_str_or_none(data.get("dtype")),
            shape=None if shape is None else tuple(_int(size) for size in shape),
            op=_str(data.get("op", "")),
            where=_str_or_none(data.get("where")),
            module=_str(data.get("module", "")),
            category=_str(data.get("category", "")),
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
    def from_json(cls, data: Mapping[str, Any]) -> ReservedAtPeak:
        return cls(_int(data["reserved_bytes"]), _int(data["unallocated_bytes"]), _int(data["inactive_split_bytes"]))


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
    def from_json(cls, data: Mapping[str, Any]) -> PhaseExplanation:
        groups, live, entries = data.get("groups"), data.get("live"), data.get("entries")
        reserved = data.get("reserved_at_peak")
        return cls(
            peak_bytes=_int(data["peak_bytes"]),
            categories=_sizes(data["categories"]),
            modules=_sizes(data["modules"]),
            cells=[Cell.from_json(cell) for cell in data["cells"]],
            tensors=[Tensor.from_json(tensor) for tensor in data["tensors"]],
            start_bytes=_int(data.get("start_bytes") or 0),
            live=None if live is None else _sizes(live),
            groups=None if not isinstance(groups, list) else [Cell.from_json(cell) for cell in groups],
            peak_index=_int_or_none(data.get("peak_index")),
            spans=[(_int(start), _int(end)) for start, end in data.get("spans", [])],
            entries=None if entries is None else _int(entries),
            unattributed_bytes=_int(data.get("unattributed_bytes") or 0),
            rank=_int_or_none(data.get("rank")),
            rank_peak_index=_int_or_none(data.get("rank_peak_index")),
            reserved_at_peak=None if reserved is None else ReservedAtPeak.from_json(reserved),
        )


@dataclass(frozen=True)
class Point:
    """Live bytes by category (in the explanation's category order) after event `index` of the call."""

    index: int
    sizes: list[int]

    def to_json(self) -> list[Any]:
        return [self.index, list(self.sizes)]

    @classmethod
    def from_json(cls, data: Any) -> Point:
        index, sizes = data
        return cls(_int(index), [_int(size) for size in sizes])

    @property
    def total(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class Unmeasured:
    """Events [start, end] of the call that no phase measures: what gpumem.advise or
    gpumem.check_gradients (`by`) ran inside the test."""

    by: str
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Unmeasured:
        return cls(_str(data["by"]), _int(data["start"]), _int(data["end"]))


@dataclass(frozen=True)
class Timeline:
    """How many events the call had, the sampled moments a chart draws, and the spans not measured."""

    events: int
    points: list[Point]
    unmeasured: list[Unmeasured] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"events": self.events, "points": [point.to_json() for point in self.points]}
        if self.unmeasured:
            data["unmeasured"] = [span.to_json() for span in self.unmeasured]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Timeline:
        return cls(
            _int(data.get("events", 0)),
            [Point.from_json(point) for point in data.get("points", [])],
            [Unmeasured.from_json(span) for span in data.get("unmeasured", [])],
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
    timeline: Timeline
    folded: dict[str, int] | None = None
    format: str = FORMAT

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
    def from_json(cls, data: Mapping[str, Any]) -> Explanation:
        folded = data.get("folded")
        return cls(
            nodeid=_str(data.get("nodeid", "")),
            backend=_str(data.get("backend", "?")),
            categories=[_str(category) for category in data.get("categories", [])],
            labels={_str(key): _str(value) for key, value in (data.get("labels") or {}).items()},
            phases={_str(name): PhaseExplanation.from_json(phase) for name, phase in data["phases"].items()},
            timeline=Timeline.from_json(data.get("timeline") or {}),
            folded=_sizes(folded) if isinstance(folded, Mapping) else None,
            format=_str(data.get("format", FORMAT)),
        )


@dataclass(frozen=True)
class RanksExplanation:
    """The explained ranks of a distributed run as parts of the test's explanation: each rank's phases as
    `phase@rankN`, each phase's worst rank as `phase`, the worst rank's whole run as `call` (None when
    not explained)."""

    phases: dict[str, PhaseExplanation]
    folded: dict[str, int]
    call: PhaseExplanation | None


@dataclass(frozen=True)
class PhaseComposition:
    """What a baseline keeps of a phase's explanation: the growth by category (sums to the peak, with
    `unattributed`), the category x module-group parts, and how many blocks each folded group has (None in
    compositions made before folding, which keep only their largest cells)."""

    categories: dict[str, int]
    cells: list[Cell]
    folded: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "categories": dict(self.categories),
            "cells": [[cell.category, cell.module, cell.size] for cell in self.cells],
        }
        if self.folded is not None:
            data["folded"] = dict(self.folded)
        return data


Composition = dict[str, PhaseComposition]
"""A test's composition: per phase name."""


def composition_to_json(composition: Mapping[str, PhaseComposition]) -> dict[str, Any]:
    return {name: phase.to_json() for name, phase in composition.items()}
