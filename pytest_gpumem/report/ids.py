"""Test ids in a width of screen columns: each id shortened ("…::test_x[a]"), kept apart from the
ids it would read the same as, and how narrow the report's test column may get (`TestFloors`).

An id loses its leading parts first, then its parameters are cut in the middle; its function's name is
never cut in the middle, only at its end: where it alone does not fit, or where it leaves its parameters
no room and the rows would read the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytest_gpumem.report.width import ELLIPSIS, cut, display_width, truncate

PARAMS_KEPT = 10  # columns of a test's parameters kept before a phase leaves its column ("[bf1…2048]")
PARAMS_LAST = 5  # and at the last resort ("[b…8]")
ID_LEAST = 8  # columns of its name and parameters an id keeps at the least ("test_a_…", "t[s…x]")


def elide(text: str, width: int) -> str:
    """`text` cut in the middle to `width` columns, the end kept (where parametrized ids differ)."""
    return cut(text, width, (width - 1) // 2)


def elide_apart(texts: Sequence[str], width: int) -> list[str]:
    """Each of `texts` cut in the middle to `width` columns, at the same place for all, chosen so that
    texts that differ stay different (two phases must not both read "ddp.ba…rank1")."""
    if width < 2 or all(display_width(text) <= width for text in texts):
        return [elide(text, width) for text in texts]
    distinct = len(set(texts))
    balanced = (width - 1) // 2
    for start in [balanced, *range(balanced - 1, -1, -1), *range(balanced + 1, width)]:
        shown = [cut(text, width, start) for text in texts]
        if len(set(shown)) == distinct:
            return shown
    return [elide(text, width) for text in texts]


def common_prefix(nodeids: Sequence[str]) -> str:
    """What every id starts with, up to a "/" or "::" (pytest's own separators) and never into
    parameters; empty for fewer than two ids or when an id would be left empty."""
    if len(nodeids) < 2:
        return ""
    low, high = min(nodeids), max(nodeids)  # what these two share, every id between them shares
    same = next((i for i, (a, b) in enumerate(zip(low, high, strict=False)) if a != b), len(low))
    prefix = low[:same].split("[")[0]
    cut_at = max(prefix.rfind("/") + 1, prefix.rfind("::") + 2 if "::" in prefix else 0)
    prefix = prefix[:cut_at]
    return prefix if all(len(nodeid) > len(prefix) for nodeid in nodeids) else ""


@dataclass(frozen=True)
class TestId:
    """A test id in its parts: what leads to the test ("a/t.py::TestC::", with its last separator), the
    function's name, its parameters ("[a-b]" or "")."""

    __test__ = False  # not a test class for pytest

    lead: str
    name: str
    params: str

    @classmethod
    def of(cls, nodeid: str) -> TestId:
        names = nodeid.split("[", 1)[0]
        starts = _part_starts(nodeid)
        last = starts[-1] if starts else 0
        return cls(nodeid[:last], names[last:], nodeid[len(names) :])

    @property
    def rest(self) -> str:
        return self.name + self.params


def shorten_id(nodeid: str, width: int) -> str:
    """`nodeid` in `width` columns: whole, else without whole leading parts ("…::test_x[a]", "…/t.py::"
    kept where it fits), else the name and parameters alone, else the name whole and its parameters cut
    in the middle ("test_x[sma…ces]"), and only where the name alone does not fit, cut at its end."""
    if display_width(nodeid) <= width:
        return nodeid
    for start in _part_starts(nodeid):
        sep = "::" if nodeid[:start].endswith("::") else "/"
        shown = ELLIPSIS + sep + nodeid[start:]
        if display_width(shown) <= width:
            return shown
    parts = TestId.of(nodeid)
    return _name_and_cut_params(parts, width, parts.params)


def _name_and_cut_params(parts: TestId, width: int, params: str) -> str:
    """The name whole and `params` (its parameters, maybe cut already) in `width`, else cut at the end."""
    room = width - display_width(parts.name)
    if display_width(parts.rest) <= width:
        return parts.rest
    if parts.params and room >= 3:
        return parts.name + (params if display_width(params) <= room else elide(parts.params, room))
    return truncate(parts.rest, width)


def shorten_ids(ids: Sequence[str], width: int) -> list[str]:
    """Each id as `shorten_id` shows it in `width` columns, kept apart where that makes two ids read
    the same: those that differ in what leads to the test have that cut in the middle where they differ
    ("a…::test_x", "b…::test_x"), those that differ in parameters their parameters; never the name."""
    shown = [shorten_id(nodeid, width) for nodeid in ids]
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(shown):
        groups.setdefault(text, []).append(i)
    for rows in groups.values():
        originals = list(dict.fromkeys(ids[i] for i in rows))
        if len(originals) < 2:
            continue
        apart = _apart([TestId.of(nodeid) for nodeid in originals], width)
        if apart is not None:
            for i in rows:
                shown[i] = apart[originals.index(ids[i])]
    return shown


def _apart(parts: Sequence[TestId], width: int) -> list[str] | None:
    """Ids that would read the same shown apart in `width`, the name whole; None where they cannot be."""
    rests, names = {p.rest for p in parts}, {p.name for p in parts}
    if len(rests) == 1:
        room = width - display_width(parts[0].rest)
        leads = elide_apart([p.lead for p in parts], room) if room >= 2 else []
        shown = [lead + p.rest for lead, p in zip(leads, parts, strict=True)] if leads else []
    elif len(names) == 1 and width - display_width(parts[0].name) >= 3:
        room = width - display_width(parts[0].name)
        params = elide_apart([p.params for p in parts], room)
        shown = [_name_and_cut_params(p, width, cut_params) for p, cut_params in zip(parts, params, strict=True)]
    elif len(names) == 1 and width >= 6:
        # the name leaves its parameters no room: its end gives way, rather than rows that read the same
        name = truncate(parts[0].name, width - min(PARAMS_KEPT, width // 2))
        shown = [name + params for params in elide_apart([p.params for p in parts], width - display_width(name))]
    else:
        return None
    return shown if len(set(shown)) == len(parts) else None


def _part_starts(nodeid: str) -> list[int]:
    """Where each part after the first begins: after a "/" or "::" that comes before the parameters."""
    names = nodeid.split("[", 1)[0]
    starts = [i + 1 for i, char in enumerate(names) if char == "/"]
    starts += [i + 2 for i in range(len(names) - 1) if names.startswith("::", i)]
    return sorted(start for start in set(starts) if start < len(names))


@dataclass(frozen=True)
class TestFloors:
    """How narrow the test column may get: `whole`, every test's name and parameters whole (before
    anything but the budget is cut); `kept`, the names whole and the parameters cut in the middle to
    `PARAMS_KEPT` columns where the ids stay apart (before a phase leaves its column); `named`, the names
    whole and a few columns of their parameters (at the last resort, before names are cut). A name longer
    than `room` (what the table has for the test column at the last resort) is cut at its end whatever
    the column's width: it counts for none of these. None is under `least` (`least_width`)."""

    __test__ = False  # not a test class for pytest

    whole: int
    kept: int
    named: int

    @classmethod
    def of(cls, ids: Sequence[str], room: int | None = None, least: int = 0) -> TestFloors:
        counted = [
            nodeid for nodeid in ids if nodeid and (room is None or display_width(TestId.of(nodeid).name) <= room)
        ]
        parts = [TestId.of(nodeid) for nodeid in counted]
        if not parts:
            return cls(*(3 * [max(room or 0, least)]))
        whole = max(display_width(p.rest) for p in parts)

        def floor(params: int) -> int:
            return max(display_width(p.name) + min(display_width(p.params), params) for p in parts)

        kept, named = floor(PARAMS_KEPT), floor(PARAMS_LAST)
        step, distinct = max(1, (whole - kept) // 8), len(set(counted))
        kept = next((w for w in range(kept, whole, step) if len(set(shorten_ids(counted, w))) == distinct), whole)
        return cls(max(whole, least), max(kept, least), max(named, least))


def least_width(ids: Sequence[str]) -> int:
    """How narrow the test column may get at all: `ID_LEAST` columns, or the widest id's name and
    parameters where narrower ("…::t" needs one)."""
    return min(ID_LEAST, max((display_width(TestId.of(nodeid).rest) for nodeid in ids), default=0))
