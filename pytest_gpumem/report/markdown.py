"""The report as GitHub Markdown, for CI step summaries: a headline of counts, each failed test with its
failure line (and what grew), the command that records the missing baselines, then the table's columns,
every cell on one line."""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from tabulate import tabulate

from pytest_gpumem.report.failures import ALSO
from pytest_gpumem.report.terminal import counts_line, long_columns, ordered, short_columns
from pytest_gpumem.report.width import flatten
from pytest_gpumem.results import Status, TestResult

_JOINERS = "\u200c\u200d"  # zero-width (non-)joiners: parts of emoji and of words in some scripts, kept
_MARKUP = "`*_[]<>~"  # what starts emphasis, a link, a tag, code or strikethrough in GitHub's Markdown


def markdown(
    results: Sequence[TestResult],
    long: bool = False,
    root: Path | None = None,
    folder: Path | None = None,
    record: str | None = None,
) -> str:
    """The run in GitHub Markdown, for CI step summaries: the counts, the failures with their lines, how
    to record what has no baseline (`record`, the command, when baselines are in use), then the table in
    the short form (all phases in their columns or one cell) or the long one, the worst status first.
    Pictures link relative to `folder` (the file's), their paths being relative to `root`."""
    if not results:
        return "No test was measured.\n"
    results = ordered(results)
    blocks = [headline(results), *failures(results), *_recording(results, record)]
    return "\n".join([*blocks, _table(results, long, root, folder)])


def headline(results: Sequence[TestResult]) -> str:
    """'**gpumem: 1 failed, 4 passed** (5 measured: 1 regressed, 1 new, 3 ok)'."""
    failed = sum(1 for r in results if _failed(r))
    counts = counts_line(results)
    return f"**gpumem: {failed} failed, {len(results) - failed} passed** ({cell(counts)})\n"


def failures(results: Sequence[TestResult]) -> list[str]:
    """The failed tests as a list, each with its status and failure line; what the line left out to fit a
    terminal (its section's `also:` lines) and a problem with its baseline it did not say (what grew, another
    phase) each on a line of its own below it."""
    items = []
    for result in (r for r in results if _failed(r)):
        message = result.message or ""
        items.append(f"- {code_span(result.nodeid)} {result.status}: {prose(message)}")
        items += [f"  - {prose(line.removeprefix(ALSO))}" for line in result.detail if line.startswith(ALSO)]
        problems = () if result.verdict is None else result.verdict.problems
        items += [f"  - {prose(problem)}" for problem in problems if problem not in message]
    return ["**Failed**\n\n" + "\n".join(items) + "\n"] if items else []


def _failed(result: TestResult) -> bool:
    """Whether the measurement failed the test (a regression an update accepted did not)."""
    return result.message is not None and not result.status.passing and result.status != Status.XFAILED


def _recording(results: Sequence[TestResult], record: str | None) -> list[str]:
    without = sum(1 for r in results if r.status in (Status.NEW, Status.MISSING_BASELINE))
    if record is None or not without:
        return []
    tests = "test" if without == 1 else "tests"
    fence = _fence(record, 3)
    said = f"Record the baselines of the {without} {tests} without one, measuring what this run measures:"
    return [f"{said}\n\n{fence}\n{_shown(record)}\n{fence}\n"]


def prose(text: str) -> str:
    """`text` as Markdown that shows it as it is, on one line: what would start emphasis, a link, a tag or
    code escaped too (`h.* +1.5 MiB` is no emphasis)."""
    return "".join("\\" + char if char in _MARKUP else char for char in cell(text))


def code_span(text: str) -> str:
    """`text` as a code span, on one line: fenced by more backticks than it has in a row."""
    shown = _shown(text)
    fence = _fence(shown, 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def _fence(text: str, least: int) -> str:
    runs = [len(run) for run in re.findall("`+", text)]
    return "`" * max(least, max(runs, default=0) + 1)


def _shown(text: str) -> str:
    """`text` on one line, its control and format characters written as escapes (code shows the rest)."""
    return "".join(map(_escaped, flatten(text)))


def _table(results: Sequence[TestResult], long: bool, root: Path | None, folder: Path | None) -> str:

    def link(html: str) -> str:
        if root is None or folder is None:
            return link_target(html)
        target = Path(root, html)
        try:
            return link_target(Path(os.path.relpath(target, folder)).as_posix())
        except ValueError:  # another drive (Windows)
            return target.as_uri()

    if long:
        columns, count = long_columns(results, links=link)
    else:
        columns, count = short_columns(results, links=link), len(results)
    body = [[col.text(row) for col in columns] for row in range(count)]
    return markdown_table([col.header for col in columns], body)


def link_target(path: str) -> str:
    """A relative POSIX `path` as a link's destination that any Markdown reads as that path: every
    character but letters, digits, `/` and `_.-~` percent-encoded (a space, `<`, `>`, parentheses, `|`, `#`,
    `%`, a backslash, a colon that would read as a scheme), in UTF-8 (a name's undecodable bytes as they were)."""
    return quote(path, safe="/", errors="surrogateescape")


def markdown_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """GitHub Markdown, each cell on one line (`cell`)."""
    cells = [[cell(text) for text in row] for row in body]
    return tabulate(cells, headers=[cell(h) for h in headers], tablefmt="github", disable_numparse=True) + "\n"


def cell(text: str) -> str:
    """`text` as a table cell that shows it as it is: on one line, a backslash and a pipe escaped (a
    backslash before a pipe would escape the pipe's own escape and end the cell), and every control or
    format character (an escape sequence, NUL, a right-to-left override) written as its Python escape."""
    return "".join(map(_cell_character, flatten(text)))


def _cell_character(char: str) -> str:
    return "\\" + char if char in "\\|" else _escaped(char)


def _escaped(char: str) -> str:
    if unicodedata.category(char)[0] != "C" or char in _JOINERS:
        return char
    return "\\" + char.encode("unicode_escape", "backslashreplace").decode("ascii")
