"""The report as GitHub Markdown, for CI step summaries: the table's columns, every cell on one line."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from tabulate import tabulate

from pytest_gpumem.report.terminal import long_columns, one_line, short_columns
from pytest_gpumem.results import TestResult


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
    """GitHub Markdown, each cell on one line with its pipes escaped."""
    cells = [[_escape_pipes(one_line(cell)) for cell in row] for row in body]
    heads = [_escape_pipes(one_line(h)) for h in headers]
    return tabulate(cells, headers=heads, tablefmt="github", disable_numparse=True) + "\n"


def _escape_pipes(cell: str) -> str:
    return cell.replace("|", "\\|")
