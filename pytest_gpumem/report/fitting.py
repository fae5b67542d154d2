"""A table fitted to a terminal's width: its columns (`Column`: a header and each row's parts), narrowed
in a fixed order until the table fits (`fit`), and drawn as text (`render`). What the columns show is
`report/terminal.py`'s.

Widths are screen columns (`report/width.py`: 日本 takes four). Where the table is too wide, the test's
name keeps its room longest: the ids lose their leading parts first ("…::test_x[a]"), then the budget and
the cells of detail are cut and the budget left out, then the parameters are cut in the middle
("test_x[bf1…2048]") and phases leave their own columns for the cell of the others; a function's name is
never cut in the middle, only at its end where it alone does not fit; at the last, the columns a test can
do without are left out one by one, reserved first (`fit` has the whole order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pytest_gpumem.report.ids import TestFloors, elide_apart, least_width, shorten_ids
from pytest_gpumem.report.width import display_width, flatten, pad, truncate

_GAP = "  "
_JOIN = " · "
# how narrow a column may get, narrowed in this order (after the test ids' leading parts, `fit`), and at
# the last resort ("phase": the long form's phase names, which are cut only then)
_FLOORS = (("made of", 24), ("change", 16), ("other phases", 24), ("budget", 16))
# only once what the peak is made of is left out: a composition cut to a dozen characters says nothing, and
# neither does "+3 more" beside it
_LOW_FLOORS = (("budget", 8), ("other phases", 8))
_LAST_FLOORS = (("backend", 6), ("change", 8), ("phase", 16), ("test", 8), ("phase", 10), ("status", 10))
# left out in this order where cutting them is not enough (`fit`); "backend" is the device column's key too
_LEFT_OUT = ("made of", "budget", "other phases", "reserved", "net", "baseline", "change", "backend")


def join_fitting(parts: Sequence[str], width: int, rank: Sequence[int] | None = None) -> str:
    """`parts` joined by " · ", as many as fit in `width` columns, then how many more there are ("+3
    more"): each part taken in turn (their own order, or `rank`'s, lowest first) where it still fits, all
    shown in their own order."""
    if display_width(_JOIN.join(parts)) <= width:
        return _JOIN.join(parts)
    chosen: list[int] = []
    for i in sorted(range(len(parts)), key=lambda i: i if rank is None else rank[i]):
        if display_width(_shown(parts, [*chosen, i])) <= width:
            chosen.append(i)
    shown = _shown(parts, chosen)
    return shown if display_width(shown) <= width else truncate(shown, width)


def _shown(parts: Sequence[str], chosen: Sequence[int]) -> str:
    return _JOIN.join([*(parts[i] for i in sorted(chosen)), f"+{len(parts) - len(chosen)} more"])


@dataclass
class Column:
    """One column: a header and, for each row, its parts (one, or several joined by " · ")."""

    header: str
    cells: list[list[str]]
    right: bool = False  # figures align right
    ids: bool = False  # test ids: shortened by `shorten_ids`, the name kept whole
    middle: bool = False  # cut in the middle (phase names, whose rank is at their end), kept apart
    parts: bool = False  # cut between parts, saying how many more ("+3 more"), never inside one
    rank: list[list[int]] | None = None  # for parts: which `join_fitting` shows first
    key: str = ""  # what `shrink` calls it: the header, or "phase:NAME" for a phase's own column
    brief: str = ""  # the header where the whole one does not fit ("others" for "other phases")
    width: int = field(default=0)
    natural: int = field(default=0, init=False)  # the width that shows every cell whole
    _cache: tuple[int, list[str]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.key = self.key or self.header
        self.header = flatten(self.header)
        self.cells = [[flatten(part) for part in cell] for cell in self.cells]
        self.natural = max([display_width(self.header), *(display_width(_JOIN.join(cell)) for cell in self.cells)])
        self.width = self.natural

    def text(self, row: int) -> str:
        parts = self.cells[row]
        if self.parts:
            return join_fitting(parts, self.width, None if self.rank is None else self.rank[row])
        if self.ids or self.middle:
            return self._shortened()[row]
        return truncate(parts[0] if parts else "", self.width)

    def shown_width(self) -> int:
        """The columns what it shows at its width takes (a cell of phases may show less)."""
        return max([display_width(self.head()), *(display_width(self.text(row)) for row in range(len(self.cells)))])

    def _shortened(self) -> list[str]:
        if self._cache is None or self._cache[0] != self.width:
            texts = [cell[0] if cell else "" for cell in self.cells]
            self._cache = self.width, (shorten_ids if self.ids else elide_apart)(texts, self.width)
        return self._cache[1]

    def head(self) -> str:
        fits = self.brief and display_width(self.header) > self.width >= display_width(self.brief)
        return self.brief if fits else truncate(self.header, self.width)


def render(columns: Sequence[Column], rows: int) -> list[str]:
    """The columns as pytest-benchmark-style text: headers, a rule, rows; cells two spaces apart."""

    def line(cells: Sequence[str]) -> str:
        return _GAP.join(pad(c, col.width, col.right) for c, col in zip(cells, columns, strict=True)).rstrip()

    lines = [line([col.head() for col in columns]), _GAP.join("-" * col.width for col in columns)]
    return lines + [line([col.text(row) for col in columns]) for row in range(rows)]


def _total_width(columns: Sequence[Column]) -> int:
    return sum(col.width for col in columns) + len(_GAP) * (len(columns) - 1)


def shrink(columns: Sequence[Column], width: int, floors: Sequence[tuple[str, int]]) -> bool:
    """Narrow the columns named in `floors` (in that order, each at most to its floor; a column may come
    back with a lower floor) until the table fits in `width`; whether it does."""
    for name, floor in floors:
        excess = _total_width(columns) - width
        if excess <= 0:
            break
        for col in columns:
            if col.key == name and col.width > floor:
                col.width -= min(excess, col.width - floor)
    return _total_width(columns) <= width


def fit(
    build: Callable[[int], list[Column]], every: int, ids: Sequence[str], width: int | None
) -> tuple[list[Column], list[str]]:
    """The columns `build(shared)` makes (`shared` phases in their own columns, of `every`) fitted to
    `width`, and the headers of those left out. Tried in this order until the table fits:

    1. the test ids without their leading parts, their names and parameters whole; the cells of detail,
       the change's phase name and the budget cut to their floors (`_FLOORS`);
    2. what the peak is made of left out, the budget and the other phases cut further (`_LOW_FLOORS`);
       then the budget left out;
    3. for each count of phases in their own columns, from all of them down to none: the ids' parameters
       whole, then cut in the middle to `ids.PARAMS_KEPT` columns (`TestFloors.kept`);
    4. the parameters cut to `ids.PARAMS_LAST` columns; then the cell of other phases left out;
    5. the last resort (`_LAST_FLOORS`): the function names cut at their end, the status and the long
       form's phase names cut;
    6. the next column of `_LEFT_OUT` left out (reserved, net, baseline, change, backend), and steps 3
       and 4 again without it, until only the test, its phases, its peak and its status are left;
    7. the last resort again, with each of those left out in turn.

    A table whose ids end narrower than `ids.least_width` is not taken. With all of `_LEFT_OUT` left out,
    a table takes about 51 columns at the least in the long form and 39 in the short (8 of ids, a peak
    with its rank, the status and the phase names cut to 10): below that it is wider than `width`, its
    figures never cut. The room left goes back to the ids' names and parameters first, then to what was
    cut, then to the ids' leading parts."""
    if width is None:
        return build(every), []
    columns: list[Column] = []
    left_out: list[str] = []
    least = least_width(ids)
    fresh = _Built(build)
    for level, last in _LEVELS:
        test = _test_floors(fresh(0), ids, width, level, least)
        for shared, floor, dropped in _tries(every, test, level, last):
            columns, left_out = _without(fresh(shared), dropped)
            floors = [*_FLOORS, *(_LOW_FLOORS if dropped else ())]
            if shrink(columns, width, [("test", test.whole), *floors, ("test", floor)]):
                columns = _room_given_back(columns, width, test.whole)
                if _ids_readable(columns, least):
                    return columns, left_out
        if last and shrink(columns, width, _LAST_FLOORS) and _ids_readable(columns, least):
            break
    return _room_given_back(columns, width, test.whole), left_out


class _Built:
    """`build(shared)` made once for each `shared`, given again at its natural widths (a try narrows them)."""

    def __init__(self, build: Callable[[int], list[Column]]) -> None:
        self.build = build
        self.made: dict[int, list[Column]] = {}

    def __call__(self, shared: int) -> list[Column]:
        if shared not in self.made:
            self.made[shared] = self.build(shared)
        for col in self.made[shared]:
            col.width = col.natural
        return list(self.made[shared])


def _ids_readable(columns: Sequence[Column], least: int) -> bool:
    """Whether the test column is at least `least` (`ids.least_width`) wide."""
    return all(col.width >= least for col in columns if col.key == "test")


_FIRST_LEVEL = 3  # steps 1 to 5 leave out this many of `_LEFT_OUT` at most; steps 6 and 7 one more each time
_MORE = range(_FIRST_LEVEL + 1, len(_LEFT_OUT) + 1)
# how many of `_LEFT_OUT` are left out, and whether the last resort is taken: steps 1 to 5, 6, 7
_LEVELS = ((_FIRST_LEVEL, True), *((level, False) for level in _MORE), *((level, True) for level in _MORE))


def _test_floors(columns: Sequence[Column], ids: Sequence[str], width: int, level: int, least: int) -> TestFloors:
    """How narrow the test column may get where `level` of `_LEFT_OUT` may be left out: the room is what
    the other columns leave at their widest (reckoned without reserved from the first level on); never
    under `least` after the first level (before it, a table whose ids end narrower is not taken)."""
    gone = _LEFT_OUT[: max(level, _FIRST_LEVEL + 1)]
    kept = [col for col in columns if col.key not in (*gone, "test")]
    return TestFloors.of(ids, width - _total_width(kept) - len(_GAP), least if level > _FIRST_LEVEL else 0)


def _tries(every: int, test: TestFloors, level: int, last: bool) -> list[tuple[int, int, int]]:
    """Steps 1 to 4 (`level` _FIRST_LEVEL), step 6's or step 7's (a later one, `last`): the count of
    phases in their own columns, the test column's floor, how many of `_LEFT_OUT` are left out."""
    if level > _FIRST_LEVEL:
        return (
            [(0, test.named, level)] if last else [(0, floor, level) for floor in (test.whole, test.kept, test.named)]
        )
    counts = range(every, -1, -1)
    tries = [(every, test.whole, 0), (every, test.whole, 1)]
    tries += [*((n, floor, 2) for n in counts for floor in (test.whole, test.kept))]
    return [*tries, *((n, test.named, 2) for n in counts), (0, test.named, 3)]


def _without(columns: list[Column], dropped: int) -> tuple[list[Column], list[str]]:
    """The columns without the first `dropped` of `_LEFT_OUT`, and the headers of those left out."""
    left_out = [col.header for col in columns if col.key in _LEFT_OUT[:dropped]]
    return [col for col in columns if col.header not in left_out], left_out


def _room_given_back(columns: list[Column], width: int, whole: int) -> list[Column]:
    """The test ids and the cell of other phases as wide as what they show; the room left back to the
    ids up to `whole` (their names and parameters), then to what else was cut (each up to what it would
    show whole), then to the ids' leading parts."""
    for col in columns:
        col.width = col.shown_width() if col.parts or col.ids else col.width
    for n, key in enumerate(("test", "phase", "budget", "change", "other phases", "made of", "test")):
        for col in columns:
            if col.key == key and _total_width(columns) < width:
                cap = min(col.natural, whole) if n == 0 else col.natural
                col.width = max(col.width, min(cap, col.width + width - _total_width(columns)))
                col.width = col.shown_width() if col.parts or col.ids else col.width
    return columns
