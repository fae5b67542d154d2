"""The report's table: its columns from the results, fitted to a terminal's width (Markdown renders the
same columns unfitted, `report/markdown.py`), and the run's one-line counts.

The short form has fixed columns (test, call peak, baseline, change, budget, status; those empty in every
row left out), a column for each phase that most tests share, and one cell for every other phase
("forward 4.0 MiB · backward 8.0 MiB", the largest where not all fit); per-rank phases (`phase@rankN`)
fold into the worst rank ("28.0 MiB @rank1", no rank where all ranks agree). The long form has one row
per test and phase. Each form's columns are a table of small functions (`_SHORT`, `_LONG`), each under the
name `--gpumem-columns` chooses it by (constants.COLUMNS).

Widths are screen columns; how the table is fitted to a terminal's is `report/fitting.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain

from cuda_allocator_model import format_size
from pytest_gpumem.baselines.compare import change_text
from pytest_gpumem.constants import COLUMNS
from pytest_gpumem.explain.text import summary
from pytest_gpumem.report.fitting import Column, fit, render
from pytest_gpumem.report.ids import common_prefix, elide
from pytest_gpumem.report.width import display_width, truncate
from pytest_gpumem.results import PhaseResult, Status, TestResult, rank_phase, split_rank
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison

DEFAULT_WIDTH = 120  # when pytest writes to no terminal


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


def _devices(results: Sequence[TestResult]) -> Column | None:
    """Where each test was measured, when that is not the same for all (the header names it then): the
    device alone where every test has the same backend ("meta" beside "cpu"), the backend alone where
    every test has the same device, else both ("tracker meta")."""
    where = [f"{r.backend} {r.device}".strip() for r in results]
    if len(set(where)) < 2:
        return None
    if len({r.backend for r in results}) == 1:
        return Column("device", [[r.device] for r in results], key="backend")
    if len({r.device for r in results}) == 1:
        return Column("backend", [[r.backend] for r in results])
    return Column("backend", [[w] for w in where])


def _ids(results: Sequence[TestResult], shorten: bool) -> tuple[str, list[str]]:
    nodeids = [r.nodeid for r in results]
    prefix = common_prefix(nodeids) if shorten else ""
    return prefix, [nodeid[len(prefix) :] for nodeid in nodeids]


@dataclass(frozen=True)
class _ShortRows:
    """What the short form's columns are made of, one item per test: its id as shown, its phases with the
    ranks folded, its call (`_call`), and its phases that have no column of their own."""

    results: Sequence[TestResult]
    ids: Sequence[str]
    folded: list[dict[str, PhaseResult]]
    own: list[str]  # the shared phases that have a column of their own
    calls: list[PhaseResult | None]
    rest: list[list[tuple[str, PhaseResult]]]
    links: Callable[[str], str] | None

    @classmethod
    def of(
        cls, results: Sequence[TestResult], shared: int | None, ids: Sequence[str] | None,
        links: Callable[[str], str] | None,
    ) -> _ShortRows:  # fmt: skip
        folded = [fold_ranks(r.phases) for r in results]
        own = shared_phases(folded)[:shared]
        runs = [_run_phase(r) for r in results]
        calls = [_call(r, phases, run) for r, phases, run in zip(results, folded, runs, strict=True)]
        rest = [
            [(name, p) for name, p in phases.items() if name not in own and name != run]
            for phases, run in zip(folded, runs, strict=True)
        ]
        return cls(results, ids or [r.nodeid for r in results], folded, own, calls, rest, links)


def short_columns(
    results: Sequence[TestResult], shared: int | None = None, ids: Sequence[str] | None = None,
    links: Callable[[str], str] | None = None, columns: Collection[str] = COLUMNS,
) -> list[Column]:  # fmt: skip
    """The short form's columns, with the first `shared` of the shared phases (all by default) in their
    own columns and the others in one cell; `links` makes Markdown links of the pictures. Each column is
    made by one of `_SHORT`, in the table's order, where `columns` names it (the test and the picture
    always); a fixed column empty in every row is left out."""
    rows = _ShortRows.of(results, shared, ids, links)
    made = [make(rows) for name, make in _SHORT if name in columns or name in _ALWAYS]
    return [col for col in chain.from_iterable(made) if col.header not in _OPTIONAL or any(map(any, col.cells))]


def _test_column(rows: _ShortRows) -> list[Column]:
    return [Column("test", [[i] for i in rows.ids], ids=True)]


def _device_column(rows: _ShortRows) -> list[Column]:
    where = _devices(rows.results)
    return [] if where is None else [where]


def _own_phase_columns(rows: _ShortRows) -> list[Column]:
    return [
        Column(name, [[_peak_cell(phases.get(name))] for phases in rows.folded], right=True, key=f"phase:{name}")
        for name in rows.own
    ]


def _peak_column(rows: _ShortRows) -> list[Column]:
    return [Column("call peak", [[_peak_cell(call)] for call in rows.calls], right=True)]


def _reserved_column(rows: _ShortRows) -> list[Column]:
    """The call's reserved peak where every test has one (else -v shows it)."""
    if any(call is None or call.reserved_peak_bytes is None for call in rows.calls):
        return []
    return [Column("reserved", [[_reserved(call)] for call in rows.calls], right=True)]


def _baseline_column(rows: _ShortRows) -> list[Column]:
    return [Column("baseline", [[_baseline(r, None)[0]] for r in rows.results], right=True)]


def _change_column(rows: _ShortRows) -> list[Column]:
    return [Column("change", [[largest_change(r)] for r in rows.results], right=True)]


def _budget_column(rows: _ShortRows) -> list[Column]:
    return [Column("budget", [[r.budget_text or ""] for r in rows.results])]


def _status_column(rows: _ShortRows) -> list[Column]:
    return [Column("status", [[r.status] for r in rows.results])]


def _other_phases_column(rows: _ShortRows) -> list[Column]:
    others = [[f"{name} {_peak_cell(p)}" for name, p in phases] for phases in rows.rest]
    if not any(others):
        return []
    rank = [cell_rank([name for name, _ in phases], [p.peak_bytes for _, p in phases]) for phases in rows.rest]
    header = "other phases" if rows.own else "phases"
    return [Column(header, others, parts=True, key="other phases", rank=rank, brief="others")]


def _made_of_column(rows: _ShortRows) -> list[Column]:
    if all(r.explanation is None for r in rows.results):
        return []
    made = [[summary(r.explanation) if r.explanation else ""] for r in rows.results]
    return [Column("call peak made of", made, key="made of", brief="made of")]


def _picture_column(rows: _ShortRows) -> list[Column]:
    links = rows.links
    if links is None or not any(r.html_path for r in rows.results):
        return []
    return [Column("picture", [[f"[picture](<{links(r.html_path)}>)" if r.html_path else ""] for r in rows.results])]


_SHORT: tuple[tuple[str, Callable[[_ShortRows], list[Column]]], ...] = (
    ("test", _test_column),
    ("device", _device_column),
    ("phases", _own_phase_columns),
    ("peak", _peak_column),
    ("reserved", _reserved_column),
    ("baseline", _baseline_column),
    ("change", _change_column),
    ("budget", _budget_column),
    ("status", _status_column),
    ("phases", _other_phases_column),
    ("made-of", _made_of_column),
    ("picture", _picture_column),
)
"""The short form's columns, in the table's order, by the name `--gpumem-columns` gives them (constants.COLUMNS)."""
_ALWAYS = ("test", "picture")  # shown whatever the columns chosen (the picture only in Markdown, which shows all)


@dataclass(frozen=True)
class _LongRow:
    """A row of the long form: a test's whole call (`name` None), or one of its phases, with its figures
    and its baseline, change and verdict cells."""

    result: TestResult
    shown: str  # the test's id as shown
    name: str | None
    links: Callable[[str], str] | None
    phase: PhaseResult | None
    compared: tuple[str, str, str]

    @classmethod
    def of(cls, result: TestResult, shown: str, name: str | None, links: Callable[[str], str] | None) -> _LongRow:
        phase = result.call if name is None else result.phases[name]
        return cls(result, shown, name, links, phase, _baseline(result, name))


def _long_peak(row: _LongRow) -> str:
    """A rank's own phase without its rank again ("fwd@rank1": "28.0 MiB"), any other with it."""
    ranked = row.name is not None and split_rank(row.name)[1] is not None
    return format_size(row.phase.peak_bytes) if ranked and row.phase else _peak_cell(row.phase)


def _long_made_of(row: _LongRow) -> str:
    explanation = row.result.explanation
    return "" if explanation is None else summary(explanation, row.name or "call")


def _long_picture(row: _LongRow) -> str:
    html, links = row.result.html_path, row.links
    return f"[picture](<{links(html)}>)" if links and html and row.name is None else ""


_LONG: tuple[tuple[str, str, Callable[[_LongRow], str]], ...] = (
    ("test", "test", lambda row: row.shown if row.name is None else ""),
    ("phases", "phase", lambda row: row.name or "call"),
    ("peak", "peak", _long_peak),
    ("reserved", "reserved", lambda row: _reserved(row.phase)),
    ("net", "net", lambda row: _net(row.phase)),
    ("baseline", "baseline", lambda row: row.compared[0]),
    ("change", "change", lambda row: row.compared[1]),
    ("budget", "budget", lambda row: (row.result.budget_text or "") if row.name is None else ""),
    ("status", "status", lambda row: row.result.status if row.name is None else row.compared[2]),
    ("made-of", "made of", _long_made_of),
    ("picture", "picture", _long_picture),
)
"""The long form's columns, in the table's order: the name `--gpumem-columns` gives each, its header, its cell."""
_LONG_OPTIONAL = frozenset(("reserved", "baseline", "change", "budget", "made of", "picture"))  # left out when empty
_FIGURES = frozenset(("peak", "reserved", "net", "baseline", "change"))  # aligned right


def long_columns(
    results: Sequence[TestResult], ids: Sequence[str] | None = None, links: Callable[[str], str] | None = None,
    columns: Collection[str] = COLUMNS,
) -> tuple[list[Column], int]:  # fmt: skip
    """The long form: for each test a row for the whole call, then one for each phase (ranks apart) where
    `columns` has the phases; a column for each of `_LONG` that `columns` names (the test always)."""
    names = ids or [r.nodeid for r in results]
    phases = "phases" in columns
    rows = [
        _LongRow.of(r, shown, name, links)
        for r, shown in zip(results, names, strict=True)
        for name in (None, *(r.phases if phases else ()))
    ]
    made = [(header, [cell(row) for row in rows]) for name, header, cell in _LONG if name in columns or name in _ALWAYS]
    return [
        Column(h, [[c] for c in cells], right=h in _FIGURES, ids=h == "test", middle=h == "phase", key=h)
        for h, cells in made
        if h not in _LONG_OPTIONAL or any(cells)
    ], len(rows)


def _reserved(phase: PhaseResult | None) -> str:
    """The allocator's reserved peak (absolute), where the backend has one (cuda, the tracker's model)."""
    return "" if phase is None or phase.reserved_peak_bytes is None else format_size(phase.reserved_peak_bytes)


def _net(phase: PhaseResult | None) -> str:
    return "" if phase is None else format_size(phase.net_bytes)


def table(results: Sequence[TestResult], width: int | None = DEFAULT_WIDTH, long: bool = False) -> str:
    """The `--gpumem-report` table, every line at most `width` screen columns (no limit for None)."""
    return "\n".join(table_lines(results, width, long))


def table_lines(
    results: Sequence[TestResult], width: int | None = DEFAULT_WIDTH, long: bool = False,
    columns: Collection[str] = COLUMNS, id_form: str = "short",
) -> list[str]:  # fmt: skip
    """The table's lines, each at most `width` screen columns (no limit for None), the worst status first:
    `columns` (constants.COLUMNS) beside the test's id, without the prefix all share (`id_form` short,
    said above the table) or whole (long)."""
    results = ordered(results)
    prefix, ids = _ids(results, shorten=id_form == "short")
    caption = [_caption(prefix, width)] if prefix else []
    if long:
        count = long_columns(results, ids, columns=columns)[1]
        shown, left_out = fit(lambda _: long_columns(results, ids, columns=columns)[0], 0, ids, width)
    else:
        every = len(shared_phases([fold_ranks(r.phases) for r in results])) if "phases" in columns else 0
        shown, left_out = fit(lambda shared: short_columns(results, shared, ids, columns=columns), every, ids, width)
        count = len(results)
    said = f"left out to fit {width} columns: {', '.join(left_out)}"
    return caption + render(shown, count) + ([truncate(said, width or len(said))] if left_out else [])


def _caption(prefix: str, width: int | None) -> str:
    """The line naming the prefix the ids were shown without; where too long, the prefix cut in the middle."""
    said = "test ids without their common prefix "
    if width is None or display_width(said + prefix) <= width:
        return said + prefix
    room = width - display_width(said)
    return said + elide(prefix, room) if room >= 12 else truncate(said + prefix, width)


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
    """One line for the end of a run: how many measured tests had each status, the worst first (the same
    order whichever xdist worker reported first)."""
    statuses = [result.status for result in results]
    known = dict(_COUNTED)
    parts = [f"{statuses.count(status)} {word}" for status, word in _COUNTED if status in statuses]
    parts += [f"{statuses.count(s)} {s}" for s in Status if s in statuses and s not in known]  # xfailed, XPASS
    return f"{len(results)} measured: " + ", ".join(parts) if results else "no test measured"
