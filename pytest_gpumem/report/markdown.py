"""The report as GitHub Markdown, for CI step summaries: the table's columns, every cell on one line."""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from tabulate import tabulate

from pytest_gpumem.report.terminal import long_columns, one_line, short_columns
from pytest_gpumem.results import TestResult

_JOINERS = "\u200c\u200d"  # zero-width (non-)joiners: parts of emoji and of words in some scripts, kept


def markdown(
    results: Sequence[TestResult], long: bool = False, root: Path | None = None, folder: Path | None = None
) -> str:
    """The table in GitHub Markdown, for CI step summaries: the short form (all phases in their columns
    or one cell) or the long one. Pictures link relative to `folder` (the file's), their paths being
    relative to `root`."""
    if not results:
        return "No test was measured.\n"

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
    return "".join(map(_cell_character, one_line(text)))


def _cell_character(char: str) -> str:
    if char in "\\|":
        return "\\" + char
    if unicodedata.category(char)[0] != "C" or char in _JOINERS:
        return char
    return "\\" + char.encode("unicode_escape", "backslashreplace").decode("ascii")
