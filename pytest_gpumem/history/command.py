"""``pytest-gpumem history [FILE]``: the memory of every test across the commits of the baseline file,
along the first-parent line of the branch checked out, and a growth gate (``--since REF --max-growth PCT``,
with the baseline gate's byte slack, ``--slack SIZE``).

``--reports DIR`` joins the ``--gpumem-json`` reports in DIR at the commits they record, as series of
their own; ``--html PATH`` writes the page (a chart per test for the top growers, a table of the rest).

Exit status: 0 shown (nothing grew beyond ``--max-growth`` and ``--slack``), 1 a phase grew beyond them,
2 git cannot answer (no git, not a repository, a file never committed), or an input or output that
cannot be used (one line: an impossible date, two outputs on one path). Files are written through the
``write`` the caller passes (the CLI's atomic writer), lines printed through its ``say``.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cuda_allocator_model import ModelError, format_size, parse_size
from pytest_gpumem.baselines.compare import Tolerance
from pytest_gpumem.baselines.schema import paused_gc
from pytest_gpumem.constants import DEFAULT_FILENAME, DEFAULT_SLACK_BYTES
from pytest_gpumem.history.git import Commit, GitError, Repo, Version
from pytest_gpumem.history.reports import Reports, read_reports
from pytest_gpumem.history.series import Gate, Series, build, gate_first, offenders, read
from pytest_gpumem.history.table import json_text, markdown_text, table

__all__ = ["GitError", "add_parser", "run"]

Write = Callable[[Path, str], None]
Say = Callable[[str], None]

_FILE_HELP = f"the committed baseline file (default: {DEFAULT_FILENAME})"
_REPORTS_HELP = "join the --gpumem-json reports in DIR at their commits"
_SLACK_HELP = f"bytes a phase may grow beyond --max-growth (default {format_size(DEFAULT_SLACK_BYTES)}, as baselines)"
_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?:[ T](\d{2}):(\d{2})(?::(\d{2}))?)?$")
_OUTPUTS = ("--json", "--markdown", "--html")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The ``history`` subcommand's options; the caller sets what it runs."""
    h = commands.add_parser("history", help="every test's memory across the commits of the baseline file")
    h.add_argument("file", type=Path, nargs="?", default=Path(DEFAULT_FILENAME), metavar="FILE", help=_FILE_HELP)
    h.add_argument("--since", default=None, metavar="REF", help="a commit, branch, tag or date (2026-11-01)")
    h.add_argument("--max-growth", type=percent, default=None, metavar="PCT", help="exit 1 above this growth")
    h.add_argument("--slack", type=slack, default=DEFAULT_SLACK_BYTES, metavar="SIZE", help=_SLACK_HELP)
    spark = h.add_mutually_exclusive_group()
    spark.add_argument("--sparklines", action="store_true", default=None, help="draw each series (default: on a tty)")
    spark.add_argument("--no-sparklines", dest="sparklines", action="store_false")
    h.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every series as JSON")
    h.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="write the top growers as Markdown")
    h.add_argument("--html", type=Path, default=None, metavar="PATH", help="write a page with a chart per top grower")
    h.add_argument("--top", type=positive, default=10, metavar="N", help="growers in --markdown, --html (default 10)")
    h.add_argument("--reports", type=Path, default=None, metavar="DIR", help=_REPORTS_HELP)
    return h


def percent(value: str) -> float:
    try:
        number = float(value.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage like 10 or 10%, got {value!r}") from None
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, got {value!r}")
    return number


def slack(value: str) -> int:
    try:
        return parse_size(value.strip())
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None  # it names the value


def positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


def run(args: argparse.Namespace, write: Write, say: Say) -> int:
    with paused_gc():  # millions of points and steps, none in a cycle
        return _run(args, write, say)


def _run(args: argparse.Namespace, write: Write, say: Say) -> int:
    _outputs_apart(args)
    repo = Repo(args.file)
    versions = _versions(repo, args.file, args.since)
    parsed = read(versions)
    reports = _reports(repo, args.reports, versions[0].commit) if args.reports is not None else None
    skipped = [*parsed.skipped, *(reports.skipped if reports else [])]
    for line in skipped:
        _note(line)
    gate = None if args.max_growth is None else Gate(Tolerance(args.max_growth, args.slack), args.since)
    series = gate_first(build(parsed.stores, reports.stores if reports else ()), gate)
    sparklines = args.sparklines if args.sparklines is not None else sys.stdout.isatty()
    say(table(series, sparklines) if series else f"{args.file}: no baselines in its committed versions")
    commits = _axis([c for c, _ in parsed.stores], reports)
    if args.json is not None:
        write(args.json, json_text(series, commits, skipped))
    if args.markdown is not None:
        write(args.markdown, markdown_text(series, args.top, gate))
    if args.html is not None:
        from pytest_gpumem.history.page import render  # jinja2 only when a page is asked for

        write(args.html, render(str(args.file), series, commits, skipped, args.top, gate))
    return _gate(series, gate, say)


def _versions(repo: Repo, file: Path, since: str | None) -> list[Version]:
    versions = repo.versions()
    if not versions:
        raise GitError(f"{file}: never committed (history reads its committed versions)")
    shallow = repo.shallow()
    if shallow is not None:
        _note(
            f"shallow clone: the history goes back to {shallow.date} ({shallow.short}); "
            "run `git fetch --unshallow` to read all of it"
        )
    return versions if since is None else _since(repo, versions, since)


def _reports(repo: Repo, folder: Path, oldest: Commit) -> Reports:
    """The reports in ``folder`` made at a commit from the oldest version read to HEAD."""
    history = repo.since(oldest) if folder.is_dir() else []
    return read_reports(folder, history)


def _axis(versions: list[Commit], reports: Reports | None) -> list[Commit]:
    """Every commit a point is at, oldest first: the versions', and the reports' in their place."""
    if reports is None or not reports.stores:
        return versions
    joined = {c.sha: c for c in versions} | {c.sha: c for c, _ in reports.stores}
    order = {sha: i for i, sha in enumerate(reports.order)}
    return sorted(joined.values(), key=lambda c: order.get(c.sha, -1))


def _outputs_apart(args: argparse.Namespace) -> None:
    """An output aimed at the baseline file would replace what history reads, two outputs on one path
    would leave only the last: each refused before anything is read."""
    given = [(flag, path) for flag, path in zip(_OUTPUTS, (args.json, args.markdown, args.html), strict=True) if path]
    for at, (flag, path) in enumerate(given):
        if _same(path, args.file):
            raise GitError(f"{flag} {path} is the baseline file history reads; write the output elsewhere")
        earlier = next((other for other, before in given[:at] if _same(path, before)), None)
        if earlier is not None:
            raise GitError(f"{flag} {path} is also the {earlier} output; give each output its own path")


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except (OSError, RuntimeError):
        return False


def _since(repo: Repo, versions: list[Version], since: str) -> list[Version]:
    """The version as it was at ``since``, then the versions in the range: a ref is the range ``REF..HEAD``
    and the file as REF holds it (also a tag off the first-parent line, on a release branch merged since),
    a date ``git rev-list --since`` and the newest version before it (both along the first-parent line)."""
    at = None
    if repo.is_ref(since):
        revisions = [f"{since}..HEAD"]
        at = repo.at(since)
    elif (when := _date(since)) is not None:
        revisions = [f"--since={when}", "HEAD"]
    else:
        raise GitError(f"--since {since}: neither a commit, branch or tag nor a date like 2026-11-01")
    inside = repo.inside(revisions)
    before = [v for v in versions if v.commit.sha not in inside]
    first = [at] if at is not None else before[-1:]
    return [*first, *(v for v in versions if v.commit.sha in inside)]


def _date(since: str) -> str | None:
    """``since`` as git reads a date (a day alone from its midnight: git would take the time of day now),
    None when it is not written as one; one that no calendar holds (the 31st of November, which git
    would read as some other day) raises ``GitError``."""
    match = _DATE.fullmatch(since)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(part) for part in match.groups(default="0"))
    try:
        when = datetime.datetime(year, month, day, hour, minute, second)  # git reads it in local time
    except ValueError as exc:
        raise GitError(f"--since {since}: no such date ({exc})") from None
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _gate(series: Sequence[Series], gate: Gate | None, say: Say) -> int:
    if gate is None:
        return 0
    lines = offenders(series, gate)
    where = f" since {gate.since}" if gate.since is not None else ""
    if not lines:
        say(f"no phase grew more than {gate.describe()}")
        return 0
    for line in lines:
        say(f"grew{where}: {line}")
    return 1


def _note(line: str) -> None:
    print(f"pytest-gpumem history: {line}", file=sys.stderr, flush=True)
