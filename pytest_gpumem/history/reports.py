"""``history --reports DIR``: the ``--gpumem-json`` reports in a folder, each at the commit it records, as
figures that join the history in series of their own (a GPU runner's, say, that are never committed).

A file that is not a report, a report that records no commit, one made with uncommitted changes and one
at a commit outside the history read are each named in one line and skipped. Each test's identity is
the one its report recorded for it (or for the tests measured with its backend and device), its figures
those of the run; a test that ran out of memory, errored or was an expected failure adds none."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cuda_allocator_model import ModelError
from pytest_gpumem.baselines.schema import paused_gc
from pytest_gpumem.errors import first_line
from pytest_gpumem.history.git import Commit, GitError
from pytest_gpumem.results import TestResult
from pytest_gpumem.results.baseline import DeviceIdentity, Entry
from pytest_gpumem.results.report_file import MadeAt, read_report

__all__ = ["Reports", "read_reports"]

_NO_FIGURES = frozenset({"OUT OF MEMORY", "error", "xfailed"})
"""The statuses of a test whose figures are not those of a whole call."""

Entries = dict[str, dict[str, Entry]]


class _Refused(Exception):
    """Why a file cannot join, in a few words."""


@dataclass
class Reports:
    """Per commit, in the history's order: the reports' entries; a line for each file skipped; and the
    history's commits (their hashes, oldest first), where the reports' commits take their place."""

    stores: list[tuple[Commit, Entries]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Report:
    path: Path
    commit: MadeAt | None
    entries: Entries


def read_reports(folder: Path, history: Sequence[Commit]) -> Reports:
    """Every ``*.json`` in ``folder`` (not below it) that is a report made at a commit of ``history``
    (oldest first, its first commit the oldest read); raises ``GitError`` when ``folder`` is no folder."""
    if not folder.is_dir():
        raise GitError(f"--reports {folder}: not a folder")
    order = {c.sha: i for i, c in enumerate(history)}
    by_sha = {c.sha: c for c in history}
    found = Reports(order=list(order))
    at: dict[str, list[_Report]] = {}
    for path in sorted(p for p in folder.glob("*.json") if p.is_file()):
        try:
            with paused_gc():  # the entries of the reports read so far would be walked again after each one
                report = _load(path)
        except _Refused as exc:
            found.skipped.append(f"skipped {path}: {exc}")
            continue
        problem = _misplaced(report, by_sha, history)
        if problem is not None:
            found.skipped.append(f"skipped {path}: {problem}")
            continue
        assert report.commit is not None
        at.setdefault(report.commit.sha, []).append(report)
    for sha in sorted(at, key=order.__getitem__):
        found.stores.append((by_sha[sha], _merged(at[sha], by_sha[sha], found.skipped)))
    return found


def _misplaced(report: _Report, by_sha: dict[str, Commit], history: Sequence[Commit]) -> str | None:
    made = report.commit
    if made is None:
        return "it records no commit (made outside a git work tree, or by an older pytest-gpumem)"
    if made.sha not in by_sha:
        since = f"{history[0].short} to HEAD" if history else "none"
        return f"made at {made.sha[:12]}, which is not in the history read (its commits: {since})"
    if made.dirty:
        return f"made at {by_sha[made.sha].short} with uncommitted changes (its figures are not that commit's)"
    return None


def _merged(reports: list[_Report], commit: Commit, skipped: list[str]) -> Entries:
    """The entries of the reports made at one commit; where two disagree on a test, the first file's."""
    merged: Entries = {}
    for report in reports:
        differ = 0
        for nodeid, per_key in report.entries.items():
            for key, entry in per_key.items():
                kept = merged.setdefault(nodeid, {}).setdefault(key, entry)
                differ += kept is not entry and (kept.peak_bytes, kept.phases) != (entry.peak_bytes, entry.phases)
        if differ:
            first = reports[0].path.name
            tests = f"{differ} test{'' if differ == 1 else 's'}"
            skipped.append(
                f"{report.path}: other figures than {first} for {tests} at {commit.short}; {first}'s are kept"
            )
    return merged


def _load(path: Path) -> _Report:
    try:
        report = read_report(path)
    except ModelError as exc:
        raise _Refused(str(exc).removeprefix(f"{path}: ")) from None
    return _Report(path, report.commit, {} if report.commit is None else _entries(report.tests))


def _entries(tests: Sequence[TestResult]) -> Entries:
    """The report's tests with figures, by node id and identity key: each test's identity is the one its
    record holds (a passing test's has one), else that of the first record of a test measured where it
    was (a failing test has none), else its backend and device alone."""
    recorded: dict[tuple[str, str], DeviceIdentity] = {}
    for test in tests:
        if test.baseline_entry is not None:
            recorded.setdefault((test.backend, test.device), test.baseline_entry.identity)
    entries: Entries = {}
    for test in tests:
        if test.status.value in _NO_FIGURES or test.call is None:
            continue
        where = (test.backend, test.device)
        own = None if test.baseline_entry is None else test.baseline_entry.identity
        identity = own or recorded.get(where) or _measured_on(test, where)
        phases = {name: phase.peak_bytes for name, phase in test.phases.items()}
        entries.setdefault(test.nodeid, {})[identity.key] = Entry(identity, test.call.peak_bytes, phases, None, None)
    return entries


def _measured_on(test: TestResult, where: tuple[str, str]) -> DeviceIdentity:
    try:
        return DeviceIdentity(*where)
    except ValueError as exc:
        raise _Refused(f"{test.nodeid}: {first_line(exc)}") from None
