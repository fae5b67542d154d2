"""The report's table: its columns from the results, fitted to a terminal's width (Markdown renders the
same columns unfitted, `report/markdown.py`), and the run's one-line counts.

The short form has fixed columns (test, call peak, baseline, change, budget, status; those empty in every
row left out), a column for each phase that most tests share, and one cell for every other phase
("forward 4.0 MiB · backward 8.0 MiB", the largest where not all fit); per-rank phases (`phase@rankN`)
fold into the worst rank ("28.0 MiB @rank1", no rank where all ranks agree). Test ids too long for their
column lose whole leading parts ("…test_x[a]") before they are cut in the middle. The long form has one
row per test and phase.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from pytest_gpumem.explain.text import summary
from pytest_gpumem.results import PhaseResult, Status, TestResult, rank_phase, split_rank
from pytest_gpumem.sizes import format_size

DEFAULT_WIDTH = 120  # when pytest writes to no terminal
GAP = "  "
JOIN = " · "
ELLIPSIS = "…"
# how narrow a column may get (narrowed in this order): first while phases keep their own columns, then
# (when nothing else fits) at the last resort; a test id keeps this share of the width before phases fold
_ID_SHARE = 0.35
_FLOORS = ({"test": 0, "made of": 20, "other phases": 12}, {"other phases": 8, "made of": 10, "test": 16, "budget": 12})


def one_line(text: str) -> str:
    """A table cell on one line: line breaks (a phase named "a\\nb") become spaces, or a row would split."""
    return " ".join(text.splitlines()) if text else text


def elide(text: str, width: int) -> str:
    """`text` cut in the middle to `width` characters, the end kept (where parametrized ids differ)."""
    return _cut(text, width, (width - 1) // 2) if width >= 2 or len(text) <= width else ELLIPSIS[:width]


def elide_apart(texts: Sequence[str], width: int) -> list[str]:
    """Each of `texts` cut in the middle to `width`, at the same place for all, chosen so that texts that
    differ stay different (two parametrized ids must not both read "test_a…sequences]")."""
    if all(len(text) <= width for text in texts) or width < 2:
        return [elide(text, width) for text in texts]
    distinct = len(set(texts))
    balanced = (width - 1) // 2
    for head in [balanced, *range(balanced - 1, -1, -1), *range(balanced + 1, width)]:
        cut = [_cut(text, width, head) for text in texts]
        if len(set(cut)) == distinct:
            return cut
    return [elide(text, width) for text in texts]


def _cut(text: str, width: int, head: int) -> str:
    return text if len(text) <= width else text[:head] + ELLIPSIS + text[len(text) - (width - 1 - head) :]


def truncate(text: str, width: int) -> str:
    """`text` cut at the end to `width` characters."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + ELLIPSIS[:width]


def join_fitting(parts: Sequence[str], width: int, rank: Sequence[int] | None = None) -> str:
    """`parts` joined by " · ", as many as fit in `width`, then how many more there are ("+3 more"): each
    part taken in turn (their own order, or `rank`'s, lowest first) where it still fits, all shown in
    their own order."""
    if len(JOIN.join(parts)) <= width:
        return JOIN.join(parts)
    chosen: list[int] = []
    for i in sorted(range(len(parts)), key=lambda i: i if rank is None else rank[i]):
        if len(_shown(parts, [*chosen, i])) <= width:
            chosen.append(i)
    shown = _shown(parts, chosen)
    return shown if len(shown) <= width else truncate(shown, width)


def _shown(parts: Sequence[str], chosen: Sequence[int]) -> str:
    return JOIN.join([*(parts[i] for i in sorted(chosen)), f"+{len(parts) - len(chosen)} more"])


def cell_rank(names: Sequence[str], sizes: Sequence[int]) -> list[int]:
    """Which phases a cell too narrow for all shows first: the largest of each group (phases named
    `group.phase`, as a distributed test's strategies name theirs), then the others, the larger first."""
    groups = [name.rpartition(".")[0] or name for name in names]
    top = {g: max(s for g2, s in zip(groups, sizes, strict=True) if g2 == g) for g in groups}
    firsts = {g: next(i for i, g2 in enumerate(groups) if g2 == g and sizes[i] == top[g]) for g in top}
    first = set(firsts.values())
    order = sorted(range(len(names)), key=lambda i: (i not in first, -sizes[i], i))
    return [order.index(i) for i in range(len(names))]


def common_prefix(nodeids: Sequence[str]) -> str:
    """What every id starts with, up to a "/" or "::" (pytest's own separators) and never into
    parameters; empty for fewer than two ids or when an id would be left empty."""
    if len(nodeids) < 2:
        return ""
    low, high = min(nodeids), max(nodeids)  # what these two share, every id between them shares
    same = next((i for i, (a, b) in enumerate(zip(low, high, strict=False)) if a != b), len(low))
    prefix = low[:same].split("[")[0]
    cut = max(prefix.rfind("/") + 1, prefix.rfind("::") + 2 if "::" in prefix else 0)
    prefix = prefix[:cut]
    return prefix if all(len(nodeid) > len(prefix) for nodeid in nodeids) else ""


def shorten_ids(ids: Sequence[str], width: int) -> list[str]:
    """Each id in `width`: first without whole leading parts (up to a "/" or "::" before the parameters,
    "…" in their place), the test's name and parameters kept; where even those do not fit, or two ids
    would read the same, cut in the middle as `elide_apart` does."""
    cut = [_without_leading_parts(nodeid, width) for nodeid in ids]
    if len(set(cut)) != len(set(ids)):
        return elide_apart(ids, width)
    long = [i for i, text in enumerate(cut) if len(text) > width]
    names = elide_apart([_last_part(ids[i]) for i in long], width)
    for i, name in zip(long, names, strict=True):
        cut[i] = name
    return cut if len(set(cut)) == len(set(ids)) else elide_apart(ids, width)


def _without_leading_parts(nodeid: str, width: int) -> str:
    if len(nodeid) <= width:
        return nodeid
    starts = _part_starts(nodeid)
    return next((ELLIPSIS + nodeid[start:] for start in starts if len(nodeid) - start < width), nodeid)


def _last_part(nodeid: str) -> str:
    starts = _part_starts(nodeid)
    return nodeid[starts[-1] :] if starts else nodeid


def _part_starts(nodeid: str) -> list[int]:
    """Where each part after the first begins: after a "/" or "::" that comes before the parameters."""
    names = nodeid.split("[", 1)[0]
    starts = [i + 1 for i, char in enumerate(names) if char == "/"]
    starts += [i + 2 for i in range(len(names) - 1) if names.startswith("::", i)]
    return sorted(start for start in set(starts) if start < len(names))


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


def peak_cell(phase: PhaseResult | None) -> str:
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
class Column:
    """One column: a header and, for each row, its parts (one, or several joined by " · ")."""

    header: str
    cells: list[list[str]]
    right: bool = False  # figures align right
    middle: bool = False  # test ids: shortened by `shorten_ids`, not cut at the end
    parts: bool = False  # cut between parts, saying how many more ("+3 more"), never inside one
    rank: list[list[int]] | None = None  # for parts: which `join_fitting` shows first
    key: str = ""  # what `shrink` calls it: the header, or "phase:NAME" for a phase's own column
    width: int = field(default=0)
    _cache: tuple[int, list[str]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.key = self.key or self.header
        self.header = one_line(self.header)
        self.cells = [[one_line(part) for part in cell] for cell in self.cells]
        self.width = self.natural

    @property
    def natural(self) -> int:
        return max([len(self.header), *(len(JOIN.join(cell)) for cell in self.cells)])

    def text(self, row: int) -> str:
        parts = self.cells[row]
        if self.parts:
            return join_fitting(parts, self.width, None if self.rank is None else self.rank[row])
        if self.middle:
            return self._elided()[row]
        return truncate(parts[0] if parts else "", self.width)

    def _elided(self) -> list[str]:
        if self._cache is None or self._cache[0] != self.width:
            texts = [cell[0] if cell else "" for cell in self.cells]
            self._cache = self.width, shorten_ids(texts, self.width)
        return self._cache[1]

    def head(self) -> str:
        return truncate(self.header, self.width)


def render(columns: Sequence[Column], rows: int) -> list[str]:
    """The columns as pytest-benchmark-style text: headers, a rule, rows; cells two spaces apart."""

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(col.width) if col.right else c.ljust(col.width) for c, col in zip(cells, columns, strict=True)
        ]
        return GAP.join(padded).rstrip()

    lines = [line([col.head() for col in columns]), GAP.join("-" * col.width for col in columns)]
    return lines + [line([col.text(row) for col in columns]) for row in range(rows)]


def total_width(columns: Sequence[Column]) -> int:
    return sum(col.width for col in columns) + len(GAP) * (len(columns) - 1)


def shrink(columns: Sequence[Column], width: int, floors: Mapping[str, int]) -> bool:
    """Narrow the columns named in `floors` (in that order, each at most to its floor) until the table
    fits in `width`; whether it does."""
    for name, floor in floors.items():
        excess = total_width(columns) - width
        if excess <= 0:
            break
        for col in columns:
            if col.key == name and col.width > floor:
                col.width -= min(excess, col.width - floor)
    return total_width(columns) <= width


_OPTIONAL = frozenset(("baseline", "change", "budget"))  # fixed columns left out when empty in every row


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
    comparisons = () if result.baseline is None else result.baseline.comparisons
    found = next((c for c in comparisons if c.phase == phase), None)
    if found is None:
        return "", "", ""
    base, change = found.baseline, found.change_percent
    return ("" if base is None else format_size(base), "" if change is None else f"{change:+.1f}%", found.status)


def _devices(results: Sequence[TestResult]) -> list[str] | None:
    """Each test's backend and device, when they are not the same for all (the header names them then)."""
    where = [f"{r.backend} {r.device}".strip() for r in results]
    return where if len(set(where)) > 1 else None


def _ids(results: Sequence[TestResult], shorten: bool) -> tuple[str, list[str]]:
    nodeids = [r.nodeid for r in results]
    prefix = common_prefix(nodeids) if shorten else ""
    return prefix, [nodeid[len(prefix) :] for nodeid in nodeids]


def short_columns(
    results: Sequence[TestResult], shared: int | None = None, ids: Sequence[str] | None = None,
    links: Callable[[str], str] | None = None,
) -> list[Column]:  # fmt: skip
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
    others = [[f"{name} {peak_cell(p)}" for name, p in phases] for phases in rest]
    columns = [Column("test", [[i] for i in (ids or [r.nodeid for r in results])], middle=True)]
    where = _devices(results)
    columns += [] if where is None else [Column("backend", [[w] for w in where])]
    columns += [
        Column(name, [[peak_cell(phases.get(name))] for phases in folded], right=True, key=f"phase:{name}")
        for name in own
    ]
    columns.append(Column("call peak", [[peak_cell(call)] for call in calls], right=True))
    compared = [_baseline(r, None) for r in results]
    columns.append(Column("baseline", [[base] for base, _, _ in compared], right=True))
    columns.append(Column("change", [[change] for _, change, _ in compared], right=True))
    columns.append(Column("budget", [[r.budget_text or ""] for r in results]))
    columns = [col for col in columns if col.header not in _OPTIONAL or any(any(cell) for cell in col.cells)]
    columns.append(Column("status", [[r.status] for r in results]))
    if any(others):
        rank = [cell_rank([name for name, _ in phases], [p.peak_bytes for _, p in phases]) for phases in rest]
        columns.append(Column("other phases" if own else "phases", others, parts=True, key="other phases", rank=rank))
    if any(r.explanation is not None for r in results):
        made = [[summary(r.explanation) if r.explanation else ""] for r in results]
        columns.append(Column("call peak made of", made, key="made of"))
    if links is not None and any(r.html for r in results):
        columns.append(Column("picture", [[f"[picture](<{links(r.html)}>)" if r.html else ""] for r in results]))
    return columns


def long_columns(
    results: Sequence[TestResult], ids: Sequence[str] | None = None, links: Callable[[str], str] | None = None
) -> tuple[list[Column], int]:
    """The long form: for each test a row for the whole call, then one for each phase (ranks apart)."""
    names = ids or [r.nodeid for r in results]
    rows: list[dict[str, str]] = []
    for nodeid, r in zip(names, results, strict=True):
        base, change, _ = _baseline(r, None)
        rows.append(
            {"test": nodeid, "phase": "call", "peak": peak_cell(r.call), "net": _net(r.call), "baseline": base,
             "change": change, "budget": r.budget_text or "", "status": r.status,
             "made of": summary(r.explanation) if r.explanation else "",
             "picture": f"[picture](<{links(r.html)}>)" if links and r.html else ""}
        )  # fmt: skip
        for name, phase in r.phases.items():
            base, change, verdict = _baseline(r, name)
            made = summary(r.explanation, name) if r.explanation else ""
            peak = format_size(phase.peak_bytes) if split_rank(name)[1] is not None else peak_cell(phase)
            rows.append(
                {"test": "", "phase": name, "peak": peak, "net": _net(phase), "baseline": base,
                 "change": change, "status": verdict, "made of": made}
            )  # fmt: skip
    headers = ["test", "phase", "peak", "net", "baseline", "change", "budget", "status", "made of", "picture"]
    optional = {"baseline", "change", "budget", "made of", "picture"}
    figures = {"peak", "net", "baseline", "change"}
    columns = [
        Column(h, [[row.get(h, "")] for row in rows], right=h in figures, middle=h in ("test", "phase"), key=h)
        for h in headers
        if h not in optional or any(row.get(h) for row in rows)
    ]
    return columns, len(rows)


def _net(phase: PhaseResult | None) -> str:
    return "" if phase is None else format_size(phase.net_bytes)


def table(results: Sequence[TestResult], width: int | None = DEFAULT_WIDTH, long: bool = False) -> str:
    """The `--gpumem-report` table, every line at most `width` characters (no limit for None)."""
    return "\n".join(table_lines(results, width, long))


def table_lines(results: Sequence[TestResult], width: int | None = DEFAULT_WIDTH, long: bool = False) -> list[str]:
    prefix, ids = _ids(results, shorten=True)
    caption = [truncate(f"test ids without their common prefix {prefix}", width or len(prefix) + 40)] if prefix else []
    if long:
        columns, count = long_columns(results, ids)
        if width is not None:
            shrink(columns, width, {"made of": 20, "test": 24, "phase": 16, "budget": 12})
            shrink(columns, width, {"made of": 8, "test": 12, "phase": 10, "budget": 8})
        return caption + render(columns, count)
    return caption + render(_fitted(results, ids, width), len(results))


def _fitted(results: Sequence[TestResult], ids: Sequence[str], width: int | None) -> list[Column]:
    """The short form in `width`: as many of the shared phases in their own columns as fit (the least
    shared leave theirs for the cell of the others first), test ids cut to their test names and
    parameters (up to half the width) or else to a share of it; of those, the first whose cell shows a
    phase in each row. When nothing fits, everything is cut to its last floor."""
    every = len(shared_phases([fold_ranks(r.phases) for r in results]))
    columns = short_columns(results, ids=ids)
    if width is None:
        return columns
    names = max(len(_last_part(i)) + len(ELLIPSIS) for i in ids)
    share = max(_FLOORS[1]["test"], int(width * _ID_SHARE))
    for shared in range(every, -1, -1):
        fits = []
        for test in dict.fromkeys((max(share, min(names, width // 2)), share)):
            columns = short_columns(results, shared, ids)
            if shrink(columns, width, {**_FLOORS[0], "test": test}):
                fits.append(columns)
        if fits:
            return _settled(next((c for c in fits if _shows_a_phase(c)), fits[0]), width)
    for shared in range(every, -1, -1):
        columns = short_columns(results, shared, ids)
        if shrink(columns, width, _FLOORS[1]):
            return _settled(columns, width)
    return columns


def _shows_a_phase(columns: Sequence[Column]) -> bool:
    """Whether the cell of other phases shows at least one of them in each row that has any."""
    cell = next((col for col in columns if col.parts), None)
    rows = [] if cell is None else [row for row, parts in enumerate(cell.cells) if parts]
    return cell is None or all(not cell.text(row).startswith("+") for row in rows)


def _settled(columns: list[Column], width: int) -> list[Column]:
    """The cell of other phases as wide as what it shows, the room it leaves back to the test ids."""
    for col in columns:
        if col.parts:
            col.width = max([len(col.header), *(len(col.text(row)) for row in range(len(col.cells)))])
    test = columns[0]
    test.width = min(test.natural, test.width + width - total_width(columns))
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


def counts_line(results: Sequence[TestResult]) -> str:
    """One line for the end of a run: how many measured tests had each status, the worst first."""
    statuses = [result.status for result in results]
    known = dict(_COUNTED)
    parts = [f"{statuses.count(status)} {word}" for status, word in _COUNTED if status in statuses]
    parts += [f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses) if s not in known]
    return f"{len(results)} measured: " + ", ".join(parts) if results else "no test measured"
