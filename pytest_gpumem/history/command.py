"""``pytest-gpumem history [FILE]``: the memory of every test across the commits of the baseline file,
and a growth gate (``--since REF --max-growth PCT``).

Exit status: 0 shown (nothing grew beyond ``--max-growth``), 1 a phase grew beyond it, 2 git cannot
answer (no git, not a repository, a file never committed; one line). Files are written through the
``write`` the caller passes (the CLI's atomic writer), lines printed through its ``say``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pytest_gpumem.constants import DEFAULT_FILENAME
from pytest_gpumem.history.git import GitError, Repo, Version
from pytest_gpumem.history.series import Series, build, offenders, read
from pytest_gpumem.history.table import json_text, markdown_text, table

__all__ = ["GitError", "add_parser", "run"]

Write = Callable[[Path, str], None]
Say = Callable[[str], None]

_FILE_HELP = f"the committed baseline file (default: {DEFAULT_FILENAME})"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2})?)?$")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The ``history`` subcommand's options; the caller sets what it runs."""
    h = commands.add_parser("history", help="every test's memory across the commits of the baseline file")
    h.add_argument("file", type=Path, nargs="?", default=Path(DEFAULT_FILENAME), metavar="FILE", help=_FILE_HELP)
    h.add_argument("--since", default=None, metavar="REF", help="a commit, branch, tag or date (2026-11-01)")
    h.add_argument("--max-growth", type=percent, default=None, metavar="PCT", help="exit 1 above this growth")
    spark = h.add_mutually_exclusive_group()
    spark.add_argument("--sparklines", action="store_true", default=None, help="draw each series (default: on a tty)")
    spark.add_argument("--no-sparklines", dest="sparklines", action="store_false")
    h.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every series as JSON")
    h.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="write the top growers as Markdown")
    h.add_argument("--top", type=positive, default=10, metavar="N", help="growers in --markdown (default 10)")
    return h


def percent(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage like 10, got {value!r}") from None
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, got {value!r}")
    return number


def positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


def run(args: argparse.Namespace, write: Write, say: Say) -> int:
    repo = Repo(args.file)
    versions = repo.versions()
    if not versions:
        raise GitError(f"{args.file}: never committed (history reads its committed versions)")
    shallow = repo.shallow()
    if shallow is not None:
        _note(
            f"shallow clone: the history goes back to {shallow.date} ({shallow.short}); "
            "run `git fetch --unshallow` to read all of it"
        )
    if args.since is not None:
        versions = _since(repo, versions, args.since)
    parsed = read(versions)
    for line in parsed.skipped:
        _note(line)
    series = build(parsed.stores)
    sparklines = args.sparklines if args.sparklines is not None else sys.stdout.isatty()
    say(table(series, sparklines) if series else f"{args.file}: no baselines in its committed versions")
    if args.json is not None:
        write(args.json, json_text(series, parsed.skipped))
    if args.markdown is not None:
        write(args.markdown, markdown_text(series, args.top))
    return _gate(series, args.max_growth, args.since, say)


def _since(repo: Repo, versions: list[Version], since: str) -> list[Version]:
    """The version as it was at ``since`` (the newest before the range), then the versions in it: a ref
    is the range ``REF..HEAD``, a date ``git log --since``."""
    if repo.is_ref(since):
        revisions = [f"{since}..HEAD"]
    elif _DATE.match(since):  # a day alone starts at midnight (git would take the time of day now)
        revisions = [f"--since={since if len(since) > 10 else since + ' 00:00:00'}"]
    else:
        raise GitError(f"--since {since}: neither a commit, branch or tag nor a date like 2026-11-01")
    inside = {commit.sha for commit, _, _ in repo.commits(revisions)}
    before = [v for v in versions if v.commit.sha not in inside]
    return [*before[-1:], *(v for v in versions if v.commit.sha in inside)]


def _gate(series: Sequence[Series], max_growth: float | None, since: str | None, say: Say) -> int:
    if max_growth is None:
        return 0
    lines = offenders(series, max_growth)
    where = f" since {since}" if since is not None else ""
    if not lines:
        say(f"no phase grew more than {max_growth:g}%{where}")
        return 0
    for line in lines:
        say(f"grew{where}: {line}")
    return 1


def _note(line: str) -> None:
    print(f"pytest-gpumem history: {line}", file=sys.stderr, flush=True)
