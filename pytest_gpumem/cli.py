"""`pytest-gpumem compare OLD.json NEW.json` and `pytest-gpumem merge A.json B.json -o ALL.json`, over the
reports that `--gpumem-json` writes; `history`, over the baseline file's git versions; `replay`, a torch
memory snapshot through the allocator's model. The verdicts use the baselines' own tolerance arithmetic,
so a comparison in CI and on a laptop cannot disagree.

Exit status: 0 nothing regressed (or merged), 1 something regressed, 2 bad input (one line naming it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda_allocator_model import ModelError, format_size
from cuda_allocator_model.snapshots import add_replay_parser, run_replay
from pytest_gpumem.baselines.compare import Tolerance, change_text, compare_peak, with_growth
from pytest_gpumem.constants import DEFAULT_SLACK_BYTES, DEFAULT_TOLERANCE_PERCENT
from pytest_gpumem.explain.growth import compact
from pytest_gpumem.history import command as history
from pytest_gpumem.report.markdown import markdown_table
from pytest_gpumem.results import Status, TestResult
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison, sound_composition
from pytest_gpumem.results.codec import encode
from pytest_gpumem.results.explanation import Composition
from pytest_gpumem.results.report_file import REPORT_VERSION, MadeAt, ReportFile, read_report
from pytest_gpumem.run.outputs import why, write_file
from pytest_gpumem.values import slack, tolerance

_Tests = dict[str, TestResult]


class _CommandError(Exception):
    """A command that cannot go on; the message names the file or the flag."""


def _load_report(path: Path) -> _Tests:
    """The tests of a `--gpumem-json` report, by node id."""
    return {test.nodeid: test for test in read_report(path).tests}


_PASSING = frozenset({*(status for status in Status if status.passing), Status.XFAILED})
"""The statuses of a test that did not fail (an expected failure did not either)."""


@dataclass
class Comparison:
    rows: list[tuple[str, PhaseComparison]]
    added: list[str]
    removed: list[str]
    failed: list[tuple[str, str]]  # tests of the new run whose own status is a failure
    mixed: list[str]  # tests measured on another backend or device than before

    @property
    def regressed(self) -> list[tuple[str, PhaseComparison]]:
        return [(nodeid, c) for nodeid, c in self.rows if c.status == BaselineStatus.REGRESSED]


def _compare_reports(old: _Tests, new: _Tests, tol: Tolerance) -> Comparison:
    rows: list[tuple[str, PhaseComparison]] = []
    for nodeid in (n for n in new if n in old):
        before, after = _peaks(old[nodeid]), _peaks(new[nodeid])
        for phase in dict.fromkeys([*before, *after]):
            stored, current = before.get(phase), after.get(phase)
            if stored is None and current is None:
                continue
            compared = compare_peak(phase, stored, current, tol, format_size)
            rows.append((nodeid, with_growth(compared, _composition(old[nodeid]), _composition(new[nodeid]))))
    failed = [(n, t.status.value) for n, t in new.items() if t.status not in _PASSING]
    mixed = [n for n in new if n in old and _where(old[n]) != _where(new[n])]
    return Comparison(rows, [n for n in new if n not in old], [n for n in old if n not in new], failed, mixed)


def _peaks(test: TestResult) -> dict[str | None, int | None]:
    """The whole call's peak (None) and each phase's."""
    return {None: test.peak_bytes, **{name: phase.peak_bytes for name, phase in test.phases.items()}}


def _composition(test: TestResult) -> Composition | None:
    if test.explanation is None:
        return None
    composition = compact(test.explanation)
    return composition if sound_composition(composition) else None


def _where(test: TestResult) -> tuple[object, object]:
    return test.backend, test.device


_HEADERS = ("test", "phase", "old", "new", "change", "status")


def _table_rows(rows: Sequence[tuple[str, PhaseComparison]]) -> list[list[str]]:
    def size(n: int | None) -> str:
        return "-" if n is None else format_size(n)

    def change(c: PhaseComparison) -> str:
        return "" if c.baseline is None or c.current is None else change_text(c.baseline, c.current)

    return [[nodeid, c.label, size(c.baseline), size(c.current), change(c), c.status] for nodeid, c in rows]


def _unchanged(c: PhaseComparison) -> bool:
    """The same peak in both reports (within the tolerance and not a byte apart)."""
    return c.status == BaselineStatus.OK and c.baseline == c.current


def summary(comparison: Comparison) -> str:
    statuses = [c.status for _, c in comparison.rows]
    tests = len({nodeid for nodeid, _ in comparison.rows})
    shown = (BaselineStatus.REGRESSED, BaselineStatus.IMPROVED)
    counts = ", ".join(f"{statuses.count(s)} {s.value.lower()}" for s in shown if s in statuses)
    failed = f", {len(comparison.failed)} failed in the new run" if comparison.failed else ""
    return (
        f"{tests} tests compared ({len(comparison.rows)} peaks){': ' + counts if counts else ''}; "
        f"{len(comparison.added)} added, {len(comparison.removed)} removed{failed}"
    )


def _text(comparison: Comparison) -> str:
    from tabulate import tabulate

    rows = _table_rows(comparison.rows)
    lines = [tabulate(rows, headers=list(_HEADERS), tablefmt="simple", disable_numparse=True)]
    lines += [f"added: {nodeid}" for nodeid in comparison.added]
    lines += [f"removed: {nodeid}" for nodeid in comparison.removed]
    lines += [f"regressed: {nodeid}: {c.message}" for nodeid, c in comparison.regressed]
    lines += [f"failed in the new run: {nodeid} ({status})" for nodeid, status in comparison.failed]
    lines += [f"warning: {nodeid} was measured on another backend or device than before" for nodeid in comparison.mixed]
    return "\n".join([*lines, summary(comparison)])


def _markdown(comparison: Comparison) -> str:
    """The changed peaks only (a step summary is read for what moved), one line saying how many were
    left out, the lists, the summary: blocks apart, so that no line joins the table."""
    changed = [(nodeid, c) for nodeid, c in comparison.rows if not _unchanged(c)]
    blocks = [markdown_table(_HEADERS, _table_rows(changed))] if changed else []
    left_out = len(comparison.rows) - len(changed)
    if left_out:
        peaks = "peak" if left_out == 1 else "peaks"
        blocks.append(f"{left_out} unchanged {peaks} (the same bytes in both reports) not listed\n")
    extra = [f"- added: `{n}`" for n in comparison.added] + [f"- removed: `{n}`" for n in comparison.removed]
    extra += [f"- regressed: `{n}`: {c.message}" for n, c in comparison.regressed]
    extra += [f"- failed in the new run: `{n}` ({status})" for n, status in comparison.failed]
    if extra:
        blocks.append("\n".join(extra) + "\n")
    return "\n".join([*blocks, f"{summary(comparison)}\n"])


def _run_compare(args: argparse.Namespace) -> int:
    if args.markdown is not None:
        _not_an_input(args.markdown, "--markdown", [args.old, args.new])
    old, new = _load_report(args.old), _load_report(args.new)
    comparison = _compare_reports(old, new, Tolerance(args.tolerance, args.slack))
    _say(_text(comparison))
    if args.markdown is not None:
        _write(args.markdown, _markdown(comparison))
    return 1 if comparison.regressed or comparison.failed else 0


def _merge_reports(reports: Sequence[ReportFile]) -> dict[str, Any]:
    """One report of a suite split across machines; a test in two reports must have the same figures."""
    merged: _Tests = {}
    source: dict[str, Path] = {}
    for report in reports:
        for test in report.tests:
            nodeid = test.nodeid
            if nodeid in merged and merged[nodeid] != test:
                raise _CommandError(f"{nodeid} is in {source[nodeid]} and in {report.path} with different figures")
            merged.setdefault(nodeid, test)
            source.setdefault(nodeid, report.path)
    backends = {t.backend for t in merged.values()}
    devices = {t.device for t in merged.values()}
    return {
        "version": REPORT_VERSION,
        "backend": backends.pop() if len(backends) == 1 else None,
        "device": devices.pop() if len(devices) == 1 else None,
        "tests": [t.to_json() for t in merged.values()],
    }


def _run_merge(args: argparse.Namespace) -> int:
    _not_an_input(args.output, "-o", args.reports)
    reports = [read_report(path) for path in args.reports]
    doc = _merge_reports(reports)
    made_at = _shared_commit(reports, args.output)
    doc["commit"] = encode(made_at, MadeAt | None)
    _write(args.output, json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n")
    _say(f"merged {len(args.reports)} reports, {len(doc['tests'])} tests, into {args.output}")
    return 0


def _shared_commit(reports: Sequence[ReportFile], output: Path) -> MadeAt | None:
    """The commit every report was made at; None, said in one line, where two differ."""
    first = reports[0]
    other = next((report for report in reports[1:] if report.commit != first.commit), None)
    if other is None:
        return first.commit
    print(
        f"pytest-gpumem merge: {first.path} was made {_made_at(first.commit)}, {other.path} "
        f"{_made_at(other.commit)}: {output} records no commit",
        file=sys.stderr,
    )
    return None


def _made_at(commit: MadeAt | None) -> str:
    if commit is None:
        return "with no commit recorded"
    return f"at {commit.sha[:7]}" + (" with uncommitted changes" if commit.dirty else "")


def _run_history(args: argparse.Namespace) -> int:
    try:
        return history.run(args, _write, _say)
    except history.GitError as exc:
        raise _CommandError(str(exc)) from None


def _run_replay(args: argparse.Namespace) -> int:
    try:
        return run_replay(args, _write, _say)
    except ModelError as exc:
        raise _CommandError(str(exc)) from None


def _not_an_input(output: Path, flag: str, inputs: Sequence[Path]) -> None:
    """Writing onto a report being read would lose it: refuse before reading anything."""
    for path in inputs:
        try:
            same = output.resolve() == path.resolve() or (output.exists() and output.samefile(path))
        except (OSError, RuntimeError):  # a link loop, a path that cannot be resolved: not an input
            same = False
        if same:
            raise _CommandError(f"{flag} {output} is one of the input reports; write the output elsewhere")


def _write(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder, so that a failure leaves the old file whole (a
    device or a pipe directly); a write that fails is an error naming the file and the OS's reason."""
    try:
        write_file(path, text)
    except (OSError, ValueError) as exc:
        raise _CommandError(f"{path}: cannot write: {why(exc)}") from None


def _say(text: str) -> None:
    """Print `text`; a standard output that cannot take it (a full disk, a closed pipe) is an error too."""
    try:
        print(text, flush=True)
    except OSError as exc:
        # what is left in the buffer would fail again at exit, with a traceback: it goes nowhere instead
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise _CommandError(f"standard output: cannot write: {why(exc)}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pytest-gpumem",
        description="Read what pytest-gpumem measured: its reports, the baseline file's history, torch snapshots.",
        epilog="Each command's options: pytest-gpumem COMMAND --help.",
    )
    commands = p.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    c = commands.add_parser("compare", help="per-test and per-phase change from OLD to NEW; exit 1 on regression")
    c.add_argument("old", type=Path, metavar="OLD.json")
    c.add_argument("new", type=Path, metavar="NEW.json")
    c.add_argument("--tolerance", type=tolerance, default=DEFAULT_TOLERANCE_PERCENT, metavar="PCT")
    c.add_argument("--slack", type=slack, default=DEFAULT_SLACK_BYTES, metavar="SIZE")
    c.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as Markdown")
    c.set_defaults(run=_run_compare)
    m = commands.add_parser("merge", help="join the reports of a suite split across machines")
    m.add_argument("reports", type=Path, nargs="+", metavar="REPORT.json")
    m.add_argument("-o", "--output", type=Path, required=True, metavar="ALL.json")
    m.set_defaults(run=_run_merge)
    history.add_parser(commands).set_defaults(run=_run_history)
    add_replay_parser(commands).set_defaults(run=_run_replay)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result: int = args.run(args)
    except (_CommandError, ModelError) as exc:
        print(f"pytest-gpumem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return result
