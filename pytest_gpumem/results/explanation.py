"""What made each peak, as typed data: the explanation of a test call (per phase its peak, its growth by
category and module, the largest tensors alive at it, when it ran; the call's timeline) and the compact
composition a baseline stores. Each type declares its JSON for the codec (`results/codec.py`; a phase
writes its own layout); the JSON is the report's `explanation` and the baseline's `composition`, in the
shape and key order they have always had.

`Explanation.from_json` reads explanations made by earlier versions too (0.1.0's): without `groups` and `folded`
(before repeated blocks were folded), without the timeline's `unmeasured` spans (before the page folded advise's
runs), without a phase's `reserved_at_peak` (before the allocator's model was explained).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pytest_gpumem.results.checks import signed_bytes
from pytest_gpumem.results.codec import EMPTY, Spec, Wording, decode, encode, read

_FORMAT = "pytest-gpumem explanation 1"
_TEXT = Spec(expected="a string")  # a string or null, said as a report always has


_INDEX = Annotated[int | None, Spec(expected="an integer")]
_OBJECT = Spec(expected="an object")  # or null, said as a report always has


@dataclass(frozen=True)
class Cell:
    """The growth of one category in one module (or module group) over a phase, in bytes."""

    category: str
    module: str
    size: Annotated[int, Spec(key="bytes")]


@dataclass(frozen=True)
class Tensor:
    """A storage alive at a phase's peak: its bytes, what made it and where, what it is used for."""

    size: Annotated[int, Spec(key="bytes")]
    dtype: Annotated[str | None, _TEXT]
    shape: tuple[int, ...] | None
    op: str
    where: Annotated[str | None, _TEXT]
    module: str
    category: str


@dataclass(frozen=True)
class ReservedAtPeak:
    """The allocator model's memory at a phase's peak, as a card would hold it: `reserved` (its segments,
    all of the call's), `unallocated` of it in no block, and `inactive_split` of that in free blocks of
    segments that still hold a live block (what no retry or `empty_cache()` can give back)."""

    reserved: Annotated[int, Spec(key="reserved_bytes")]
    unallocated: Annotated[int, Spec(key="unallocated_bytes")]
    inactive_split: Annotated[int, Spec(key="inactive_split_bytes")]


@dataclass(frozen=True)
class PhaseExplanation:
    """One phase's peak explained. `categories`, `modules`, `cells` and `groups` are the growth from the
    phase's start to its peak (they add up to it); `live` is what was alive at the peak by category;
    `groups` are the category x module-group parts with repeated blocks folded. A rank's phase (`rank`
    set) has no spans on the test's timeline; `rank_peak_index` is where its peak was on the rank's own.
    `reserved_at_peak` is there where the allocator's model served the call (`--gpumem-round=cuda`)."""

    __json_open__ = True  # read as written before `groups` or `reserved_at_peak`, and a rank's phase

    peak_bytes: int
    categories: dict[str, int]
    modules: dict[str, int]
    cells: list[Cell]
    tensors: list[Tensor]
    live: dict[str, int] = field(kw_only=True)
    entries: int = field(kw_only=True)  # how many times the phase was entered (`spans` holds the first ones)
    start_bytes: int = 0
    groups: Annotated[list[Cell] | None, Spec(expected="a list")] = None
    peak_index: _INDEX = None
    spans: list[Annotated[tuple[int, int], Spec(expected="[first event, last event]")]] = field(default_factory=list)
    unattributed_bytes: int = 0
    rank: _INDEX = None
    rank_peak_index: _INDEX = None
    reserved_at_peak: Annotated[ReservedAtPeak | None, _OBJECT] = None

    @property
    def parts(self) -> list[Cell]:
        """The category x module parts: the folded groups, or the largest cells of an explanation made
        before folding."""
        return self.cells if self.groups is None else self.groups

    def to_json(self) -> dict[str, Any]:
        """The phase's JSON: a rank's phase has no `peak_index`, and its `spans` and `rank_peak_index` last."""
        data: dict[str, Any] = {"categories": dict(self.categories), "live": dict(self.live)}
        data["modules"] = dict(self.modules)
        data["cells"] = encode(self.cells, list[Cell])
        if self.groups is not None:
            data["groups"] = encode(self.groups, list[Cell])
        data["tensors"] = encode(self.tensors, list[Tensor])
        data["peak_bytes"] = self.peak_bytes
        data["start_bytes"] = self.start_bytes
        if self.rank is None:
            data["peak_index"] = self.peak_index
            data["spans"] = [list(span) for span in self.spans]
        data["entries"] = self.entries
        data["unattributed_bytes"] = self.unattributed_bytes
        if self.reserved_at_peak is not None:
            data["reserved_at_peak"] = encode(self.reserved_at_peak)
        if self.rank is not None:
            data.update(rank=self.rank, spans=[list(span) for span in self.spans], rank_peak_index=self.rank_peak_index)
        return data


def _read_phases(value: Any, where: str | None, wording: Wording) -> dict[str, PhaseExplanation]:
    return read(dict[str, PhaseExplanation], value, where, wording)  # type: ignore[no-any-return]


def _write_phases(phases: dict[str, PhaseExplanation]) -> dict[str, Any]:
    return {name: phase.to_json() for name, phase in phases.items()}


@dataclass(frozen=True)
class Point:
    """Live bytes by category (in the explanation's category order) after event `index` of the call."""

    index: int
    sizes: list[int]

    @property
    def total(self) -> int:
        return sum(self.sizes)


def _read_point(value: Any, where: str | None, wording: Wording) -> Point:
    index, sizes = read(_POINT_JSON, value, where, wording)
    return Point(index, sizes)


_POINT_JSON = Annotated[tuple[int, list[int]], Spec(expected="[event index, [bytes per category]]")]
_POINT = Spec(via=(_read_point, lambda point: [point.index, list(point.sizes)]))


@dataclass(frozen=True)
class UnmeasuredSpan:
    """Events [start, end] of the call that no phase measures: what gpumem.advise or
    gpumem.check_gradients (`by`) ran inside the test."""

    by: str
    start: int
    end: int


@dataclass(frozen=True)
class SampledTimeline:
    """How many events the call had, the sampled moments a chart draws, and the spans not measured."""

    events: int
    points: list[Annotated[Point, _POINT]]
    unmeasured: Annotated[list[UnmeasuredSpan], Spec(omit=EMPTY)] = field(default_factory=list)


@dataclass(frozen=True)
class Explanation:
    """What made the peaks of one test call, phase by phase (`call` is the whole call). `categories`
    are in stacking order with their `labels`; `folded` names each group of repeated blocks (`h.*`)
    with how many blocks it has (None in explanations made before folding)."""

    __json_keys__ = ("format", "nodeid", "backend", "categories", "labels", "folded", "phases", "timeline")

    nodeid: str
    backend: str
    categories: list[str]
    labels: dict[str, str]
    phases: Annotated[dict[str, PhaseExplanation], Spec(via=(_read_phases, _write_phases))]
    timeline: SampledTimeline
    folded: Annotated[dict[str, int] | None, Spec(omit=None)] = None
    format: str = _FORMAT

    def label(self, category: str) -> str:
        return self.labels.get(category, category)

    def blocks(self, group: str) -> int | None:
        """How many blocks a folded group has, None for any other module."""
        return None if self.folded is None else self.folded.get(group)

    def to_json(self) -> dict[str, Any]:
        """A test's `explanation` in the report (`results/__init__.py`, `report/html.py` write it so)."""
        written: dict[str, Any] = encode(self)
        return written

    @classmethod
    def from_json(cls, data: Any, where: str = "explanation") -> Explanation:
        """The explanation `to_json` wrote; `OffShape` names the first value that is not as written."""
        return decode(cls, data, where)


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


def _read_cells(value: Any, where: str | None, wording: Wording) -> list[Cell]:
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
