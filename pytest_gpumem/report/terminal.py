"""The report's table: its columns from the results, fitted to a terminal's width (Markdown renders the
same columns unfitted, `report/markdown.py`), and the run's one-line counts.

The short form has fixed columns (test, call peak, baseline, change, budget, status; those empty in every
row left out), a column for each phase that most tests share, and one cell for every other phase
("forward 4.0 MiB · backward 8.0 MiB", the largest where not all fit); per-rank phases (`phase@rankN`)
fold into the worst rank ("28.0 MiB @rank1", no rank where all ranks agree). The long form has one row
per test and phase.

Widths are screen columns (`report/width.py`: 日本 takes four). Where the table is too wide, the test's
name keeps its room longest: the ids lose their leading parts first ("…::test_x[a]"), then the budget and
the cells of detail are cut and the budget left out, then the parameters are cut in the middle
("test_x[bf1…2048]") and phases leave their own columns for the cell of the others; a function's name is
never cut in the middle, only at its end where it alone does not fit (`_fit` has the whole order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cuda_allocator_model import format_size
from pytest_gpumem.baselines.compare import change_text
from pytest_gpumem.explain.text import summary
from pytest_gpumem.report.ids import TestFloors, common_prefix, elide, elide_apart, shorten_ids
from pytest_gpumem.report.width import display_width, flatten, pad, truncate
from pytest_gpumem.results import PhaseResult, Status, TestResult, rank_phase, split_rank
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison

DEFAULT_WIDTH = 120  # when pytest writes to no terminal
_GAP = "  "
_JOIN = " · "
# how narrow a column may get, narrowed in this order (after the test ids' leading parts, `_fit`), and at
# the last resort ("phase": the long form's phase names, which are cut only then)
_FLOORS = (("made of", 24), ("change", 16), ("other phases", 24), ("budget", 16))
# only once what the peak is made of is left out: a composition cut to a dozen characters says nothing, and
# neither does "+3 more" beside it
_LOW_FLOORS = (("budget", 8), ("other phases", 8))
_LAST_FLOORS = (("backend", 6), ("change", 8), ("phase", 16), ("test", 8), ("phase", 10), ("status", 10))
_LEFT_OUT = ("made of", "budget", "other phases", "reserved")  # left out in this order where cutting them is not enough


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


def cell_rank(names: Sequence[str], sizes: Sequence[int]) -> list[int]:
    """Which phases a cell too narrow for all shows first: the largest of each group (phases named
    `group.phase`, as a distributed test's strategies name theirs), then the others, the larger first."""
    groups = [name.rpartition(".")[0] or name for name in names]
    top = {g: max(s for g2, s in zip(groups, sizes, strict=True) if g2 == g) for g in groups}
    firsts = {g: next(i for i, g2 in enumerate(groups) if g2 == g and sizes[i] == top[g]) for g in top}
    first = set(firsts.values())
    order = sorted(range(len(names)), key=lambda i: (i not in first, -sizes[i], i))
    return [order.index(i) for i in range(len(names))]


def fold_ranks(phases: Mapping[str, PhaseResult]) -> dict[str, PhaseResult]:
    """The phases with each `name@rankN` folded into `name`: the worst rank's figures, its rank kept
    unless every rank has the same peak (the distributed run records that phase already; a lone per-rank
    phase is folded here)."""
    bases: dict[str, list[PhaseResult]] = {}
    for name, phase in phases.items():
        base, rank = split_rank(name)
        bases.setdefault(base, [])
        if rank is not None:
            bases[base].append(phase if phase.rank is not None else replace(phase, rank=rank))
    folded = {}
    for base, ranks in bases.items():
        worst = phases[base] if base in phases else max(ranks, key=lambda p: (p.peak_bytes, -(p.rank or 0)))
        agree = len(ranks) > 1 and len({p.peak_bytes for p in ranks}) == 1
        folded[base] = replace(worst, rank=None) if agree and worst.rank is not None else worst
    return folded


def _peak_cell(phase: PhaseResult | None) -> str:
    """A peak, with the rank it is from: "28.0 MiB @rank1"."""
    if phase is None:
        return ""
    return format_size(phase.peak_bytes) + ("" if phase.rank is None else f" @rank{phase.rank}")


def shared_phases(folded: Sequence[Mapping[str, PhaseResult]]) -> list[str]:
    """The phases that more than half of the tests have, most shared first (then in the order first seen)."""
    counts: dict[str, int] = {}
    for phases in folded:
        for name in phases:
            counts[name] = counts.get(name, 0) + 1
    shared = [name for name, count in counts.items() if 2 * count > len(folded)]
    return sorted(shared, key=lambda name: -counts[name])


@dataclass
class _Column:
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
    _cache: tuple[int, list[str]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.key = self.key or self.header
        self.header = flatten(self.header)
        self.cells = [[flatten(part) for part in cell] for cell in self.cells]
        self.width = self.natural

    @property
    def natural(self) -> int:
        return max([display_width(self.header), *(display_width(_JOIN.join(cell)) for cell in self.cells)])

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


def render(columns: Sequence[_Column], rows: int) -> list[str]:
    """The columns as pytest-benchmark-style text: headers, a rule, rows; cells two spaces apart."""

    def line(cells: Sequence[str]) -> str:
        return _GAP.join(pad(c, col.width, col.right) for c, col in zip(cells, columns, strict=True)).rstrip()

    lines = [line([col.head() for col in columns]), _GAP.join("-" * col.width for col in columns)]
    return lines + [line([col.text(row) for col in columns]) for row in range(rows)]


def _total_width(columns: Sequence[_Column]) -> int:
    return sum(col.width for col in columns) + len(_GAP) * (len(columns) - 1)


def shrink(columns: Sequence[_Column], width: int, floors: Sequence[tuple[str, int]]) -> bool:
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


_OPTIONAL = frozenset(("reserved", "baseline", "change", "budget"))  # fixed columns left out when empty in every row


def _run_phase(result: TestResult) -> str | None:
    """The phase of the distributed run that the call's figures are taken from (the call peak column
    shows it), or None."""
    call = result.call
    if call is None or call.rank is None:
        return None
    same = [name for name, p in result.phases.items() if (p.peak_bytes, p.rank) == (call.peak_bytes, call.rank)]
    return next((name for name in same if rank_phase(name, call.rank) in result.phases), None)


def _call(result: TestResult, folded: Mapping[str, PhaseResult], run: str | None) -> PhaseResult | None:
    """The call, without the rank it is from where every rank of the run it is taken from agrees."""
    call = result.call
    agree = call is not None and run is not None and run in folded and folded[run].rank is None
    return replace(call, rank=None) if agree and call is not None else call


def _baseline(result: TestResult, phase: str | None) -> tuple[str, str, str]:
    """A region's baseline, change and verdict cells ("call" is None)."""
    comparisons = () if result.verdict is None else result.verdict.comparisons
    found = next((c for c in comparisons if c.phase == phase), None)
    if found is None:
        return "", "", ""
    return ("" if found.baseline is None else format_size(found.baseline), _change(found), found.status)


def _change(found: PhaseComparison) -> str:
    if found.baseline is None or found.current is None:
        return ""
    return change_text(found.baseline, found.current)


def largest_change(result: TestResult) -> str:
    """The short form's change cell: the largest change in bytes of the regions that regressed (else
    improved), with its phase unless it is the call's ("+281.5% forward"); else the call's change."""
    comparisons = [c for c in (() if result.verdict is None else result.verdict.comparisons) if _change(c)]
    for status in (BaselineStatus.REGRESSED, BaselineStatus.IMPROVED):
        found = [c for c in comparisons if c.status == status]
        if found:
            largest = max(found, key=lambda c: (abs((c.current or 0) - (c.baseline or 0)), c.phase is None))
            return _change(largest) + ("" if largest.phase is None else f" {largest.phase}")
    return next((_change(c) for c in comparisons if c.phase is None), "")


def _devices(results: Sequence[TestResult]) -> _Column | None:
    """Where each test was measured, when that is not the same for all (the header names it then): the
    device alone where every test has the same backend ("meta" beside "cpu"), the backend alone where
    every test has the same device, else both ("tracker meta")."""
    where = [f"{r.backend} {r.device}".strip() for r in results]
    if len(set(where)) < 2:
        return None
    if len({r.backend for r in results}) == 1:
        return _Column("device", [[r.device] for r in results], key="backend")
    if len({r.device for r in results}) == 1:
        return _Column("backend", [[r.backend] for r in results])
    return _Column("backend", [[w] for w in where])


def _ids(results: Sequence[TestResult], shorten: bool) -> tuple[str, list[str]]:
    nodeids = [r.nodeid for r in results]
    prefix = common_prefix(nodeids) if shorten else ""
    return prefix, [nodeid[len(prefix) :] for nodeid in nodeids]


def short_columns(
    results: Sequence[TestResult], shared: int | None = None, ids: Sequence[str] | None = None,
    links: Callable[[str], str] | None = None,
) -> list[_Column]:  # fmt: skip
    """The short form's columns, with the first `shared` of the shared phases (all by default) in their
    own columns and the others in one cell; `links` makes Markdown links of the pictures."""
    folded = [fold_ranks(r.phases) for r in results]
    own = shared_phases(folded)[:shared]
    runs = [_run_phase(r) for r in results]
    calls = [_call(r, phases, run) for r, phases, run in zip(results, folded, runs, strict=True)]
    rest = [
        [(name, p) for name, p in phases.items() if name not in own and name != run]
        for phases, run in zip(folded, runs, strict=True)
    ]
    others = [[f"{name} {_peak_cell(p)}" for name, p in phases] for phases in rest]
    columns = [_Column("test", [[i] for i in (ids or [r.nodeid for r in results])], ids=True)]
    where = _devices(results)
    columns += [] if where is None else [where]
    columns += [
        _Column(name, [[_peak_cell(phases.get(name))] for phases in folded], right=True, key=f"phase:{name}")
        for name in own
    ]
    columns.append(_Column("call peak", [[_peak_cell(call)] for call in calls], right=True))
    if all(call is not None and call.reserved_peak_bytes is not None for call in calls):  # else -v shows it
        columns.append(_Column("reserved", [[_reserved(call)] for call in calls], right=True))
    columns.append(_Column("baseline", [[_baseline(r, None)[0]] for r in results], right=True))
    columns.append(_Column("change", [[largest_change(r)] for r in results], right=True))
    columns.append(_Column("budget", [[r.budget_text or ""] for r in results]))
    columns = [col for col in columns if col.header not in _OPTIONAL or any(any(cell) for cell in col.cells)]
    columns.append(_Column("status", [[r.status] for r in results]))
    if any(others):
        rank = [cell_rank([name for name, _ in phases], [p.peak_bytes for _, p in phases]) for phases in rest]
        header = "other phases" if own else "phases"
        columns.append(_Column(header, others, parts=True, key="other phases", rank=rank, brief="others"))
    if any(r.explanation is not None for r in results):
        made = [[summary(r.explanation) if r.explanation else ""] for r in results]
        columns.append(_Column("call peak made of", made, key="made of", brief="made of"))
    if links is not None and any(r.html_path for r in results):
        pictures = [[f"[picture](<{links(r.html_path)}>)" if r.html_path else ""] for r in results]
        columns.append(_Column("picture", pictures))
    return columns


def long_columns(
    results: Sequence[TestResult], ids: Sequence[str] | None = None, links: Callable[[str], str] | None = None
) -> tuple[list[_Column], int]:
    """The long form: for each test a row for the whole call, then one for each phase (ranks apart)."""
    names = ids or [r.nodeid for r in results]
    rows: list[dict[str, str]] = []
    for nodeid, r in zip(names, results, strict=True):
        base, change, _ = _baseline(r, None)
        rows.append(
            {"test": nodeid, "phase": "call", "peak": _peak_cell(r.call), "reserved": _reserved(r.call),
             "net": _net(r.call), "baseline": base,
             "change": change, "budget": r.budget_text or "", "status": r.status,
             "made of": summary(r.explanation) if r.explanation else "",
             "picture": f"[picture](<{links(r.html_path)}>)" if links and r.html_path else ""}
        )  # fmt: skip
        for name, phase in r.phases.items():
            base, change, verdict = _baseline(r, name)
            made = summary(r.explanation, name) if r.explanation else ""
            peak = format_size(phase.peak_bytes) if split_rank(name)[1] is not None else _peak_cell(phase)
            rows.append(
                {"test": "", "phase": name, "peak": peak, "reserved": _reserved(phase), "net": _net(phase),
                 "baseline": base,
                 "change": change, "status": verdict, "made of": made}
            )  # fmt: skip
    headers = ["test", "phase", "peak", "reserved", "net", "baseline", "change", "budget", "status", "made of"]
    headers.append("picture")
    optional = {"reserved", "baseline", "change", "budget", "made of", "picture"}
    figures = {"peak", "reserved", "net", "baseline", "change"}
    columns = [
        _Column(h, [[row.get(h, "")] for row in rows], right=h in figures, ids=h == "test", middle=h == "phase", key=h)
        for h in headers
        if h not in optional or any(row.get(h) for row in rows)
    ]
    return columns, len(rows)


def _reserved(phase: PhaseResult | None) -> str:
    """The allocator's reserved peak (absolute), where the backend has one (cuda, the tracker's model)."""
    return "" if phase is None or phase.reserved_peak_bytes is None else format_size(phase.reserved_peak_bytes)


def _net(phase: PhaseResult | None) -> str:
    return "" if phase is None else format_size(phase.net_bytes)


def table(results: Sequence[TestResult], width: int | None = DEFAULT_WIDTH, long: bool = False) -> str:
    """The `--gpumem-report` table, every line at most `width` screen columns (no limit for None)."""
    return "\n".join(table_lines(results, width, long))


def table_lines(results: Sequence[TestResult], width: int | None = DEFAULT_WIDTH, long: bool = False) -> list[str]:
    """The table's lines, each at most `width` screen columns (no limit for None), the worst status first."""
    results = ordered(results)
    prefix, ids = _ids(results, shorten=True)
    caption = [_caption(prefix, width)] if prefix else []
    if long:
        count = long_columns(results, ids)[1]
        columns, left_out = _fit(lambda _: long_columns(results, ids)[0], 0, ids, width)
    else:
        every = len(shared_phases([fold_ranks(r.phases) for r in results]))
        columns, left_out = _fit(lambda shared: short_columns(results, shared, ids), every, ids, width)
        count = len(results)
    said = f"left out to fit {width} columns: {', '.join(left_out)}"
    return caption + render(columns, count) + ([truncate(said, width or len(said))] if left_out else [])


def _caption(prefix: str, width: int | None) -> str:
    """The line naming the prefix the ids were shown without; where too long, the prefix cut in the middle."""
    said = "test ids without their common prefix "
    if width is None or display_width(said + prefix) <= width:
        return said + prefix
    room = width - display_width(said)
    return said + elide(prefix, room) if room >= 12 else truncate(said + prefix, width)


def _fit(
    build: Callable[[int], list[_Column]], every: int, ids: Sequence[str], width: int | None
) -> tuple[list[_Column], list[str]]:
    """The columns `build(shared)` makes (`shared` phases in their own columns, of `every`) fitted to
    `width`, and the headers of those left out. Tried in this order until the table fits:

    1. the test ids without their leading parts, their names and parameters whole; the cells of detail,
       the change's phase name and the budget cut to their floors (`_FLOORS`);
    2. what the peak is made of left out, the budget and the other phases cut further (`_LOW_FLOORS`);
       then the budget left out;
    3. for each count of phases in their own columns, from all of them down to none: the ids' parameters
       whole, then cut in the middle to `ids.PARAMS_KEPT` columns (`TestFloors.kept`);
    4. the parameters cut to `ids.PARAMS_LAST` columns; then the cell of other phases left out;
    5. the last resort (`_LAST_FLOORS`): the function names cut at their end.

    The room left goes back to the ids' names and parameters first, then to what was cut, then to the
    ids' leading parts."""
    if width is None:
        return build(every), []
    essential = [col for col in build(0) if col.key not in (*_LEFT_OUT, "test")]
    test = TestFloors.of(ids, width - _total_width(essential) - len(_GAP))
    counts = range(every, -1, -1)
    tries = [(every, test.whole, 0), (every, test.whole, 1)]
    tries += [*((n, floor, 2) for n in counts for floor in (test.whole, test.kept))]
    tries += [*((n, test.named, 2) for n in counts), (0, test.named, 3)]
    columns, left_out = build(0), []
    for shared, floor, dropped in tries:
        columns = build(shared)
        left_out = [col.header for col in columns if col.key in _LEFT_OUT[:dropped]]
        columns = [col for col in columns if col.header not in left_out]
        floors = [*_FLOORS, *(_LOW_FLOORS if dropped else ())]
        if shrink(columns, width, [("test", test.whole), *floors, ("test", floor)]):
            return _room_given_back(columns, width, test.whole), left_out
    shrink(columns, width, _LAST_FLOORS)
    return _room_given_back(columns, width, test.whole), left_out


def _room_given_back(columns: list[_Column], width: int, whole: int) -> list[_Column]:
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


# the terminal summary's counts, in this order, under these names; any other status is counted by name
_COUNTED = (
    (Status.OUT_OF_MEMORY, "out of memory"),
    (Status.OVER_BUDGET, "over budget"),
    (Status.LEAKED, "leaked"),
    (Status.REGRESSED, "regressed"),
    (Status.GRADIENTS_CHANGED, "gradients changed"),
    (Status.MISSING_BASELINE, "missing baseline"),
    (Status.ERROR, "unmeasurable or failed"),
    (Status.IMPROVED, "improved"),
    (Status.NEW, "new"),
    (Status.OK, "ok"),
)


# the order of the table's rows: what failed, the worst first, then what passed
_ORDER = {
    status: n
    for n, status in enumerate(
        (Status.OUT_OF_MEMORY, Status.OVER_BUDGET, Status.LEAKED, Status.REGRESSED, Status.GRADIENTS_CHANGED,
         Status.MISSING_BASELINE, Status.ERROR, Status.XPASS, Status.XFAILED, Status.IMPROVED, Status.NEW, Status.OK)
    )
}  # fmt: skip


def ordered(results: Sequence[TestResult]) -> list[TestResult]:
    """The results by status (those that failed first, the worst first) and, within one, by test id: the
    same order however xdist's workers finished."""
    return sorted(results, key=lambda r: (_ORDER.get(r.status, len(_ORDER)), r.nodeid))


def counts_line(results: Sequence[TestResult]) -> str:
    """One line for the end of a run: how many measured tests had each status, the worst first."""
    statuses = [result.status for result in results]
    known = dict(_COUNTED)
    parts = [f"{statuses.count(status)} {word}" for status, word in _COUNTED if status in statuses]
    parts += [f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses) if s not in known]
    return f"{len(results)} measured: " + ", ".join(parts) if results else "no test measured"
