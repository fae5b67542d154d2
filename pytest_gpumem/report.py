"""Pure functions from results to the report table (text or Markdown) and the JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from pytest_gpumem.explain import summary
from pytest_gpumem.results import TestResult
from pytest_gpumem.sizes import format_size

JSON_VERSION = 1


def phase_names(results: Sequence[TestResult]) -> list[str]:
    """Every phase name, in the order first seen."""
    names: dict[str, None] = {}
    for result in results:
        names.update(dict.fromkeys(result.phases))
    return list(names)


def one_line(text: str) -> str:
    """A table cell on one line: line breaks (a phase named "a\\nb") become spaces, or a row would split."""
    return " ".join(text.splitlines()) if text else text


def _cell(n: int | None) -> str:
    return "" if n is None else format_size(n)


def _baseline_cells(result: TestResult) -> list[str]:
    comparison = result.call_comparison()
    if comparison is None:
        return ["", ""]
    change = comparison.get("change_percent")
    return [_cell(comparison.get("baseline")), "" if change is None else f"{change:+.1f}%"]


def rows(results: Sequence[TestResult], links: bool = False) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: test, backend, device, each phase, the whole call, [baseline, change,] budget,
    status, [what the call's peak was made of, [its picture (Markdown `links`)]].

    Every header and cell is one line (see `one_line`)."""
    phases = phase_names(results)
    with_baselines = any(r.baseline is not None for r in results)
    explained = any(r.explanation is not None for r in results)
    pictures = links and any(r.html for r in results)
    headers = ["test", "backend", "device", *phases, "call peak"]
    headers += ["baseline", "change"] if with_baselines else []
    headers += ["budget", "status"]
    headers += ["call peak made of"] if explained else []
    headers += ["picture"] if pictures else []
    body = []
    for r in results:
        row = [r.nodeid, r.backend, r.device, *(_cell(r.phases[p].peak_bytes) if p in r.phases else "" for p in phases)]
        row.append(_cell(r.peak_bytes))
        row += _baseline_cells(r) if with_baselines else []
        row += [r.budget_text or "", r.status]
        row += [summary(r.explanation) if r.explanation else ""] if explained else []
        row += [f"[picture](<{r.html}>)" if r.html else ""] if pictures else []
        body.append([one_line(cell) for cell in row])
    return [one_line(h) for h in headers], body


def table(results: Sequence[TestResult]) -> str:
    """The `--gpumem-report` table: one row a test, a column for each phase and for the whole call."""
    headers, body = rows(results)
    return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)


def markdown(results: Sequence[TestResult]) -> str:
    """The same table in GitHub Markdown, for CI step summaries."""
    if not results:
        return "No test was measured.\n"
    return markdown_table(*rows(results, links=True))


def markdown_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """GitHub Markdown, each cell on one line with its pipes escaped."""
    cells = [[_escape_pipes(one_line(cell)) for cell in row] for row in body]
    heads = [_escape_pipes(one_line(h)) for h in headers]
    return tabulate(cells, headers=heads, tablefmt="github", disable_numparse=True) + "\n"


def _escape_pipes(cell: str) -> str:
    return cell.replace("|", "\\|")


def document(results: Sequence[TestResult], backend: str | None, device: str | None) -> dict[str, Any]:
    """The `--gpumem-json` document."""
    return {
        "version": JSON_VERSION,
        "backend": backend,
        "device": device,
        "tests": [r.to_dict() for r in results],
    }


# the terminal summary's counts, in this order, under these names; any other status is counted by name
_COUNTED = (
    ("OUT OF MEMORY", "out of memory"),
    ("OVER BUDGET", "over budget"),
    ("LEAKED", "leaked"),
    ("REGRESSED", "regressed"),
    ("GRADIENTS CHANGED", "gradients changed"),
    ("MISSING BASELINE", "missing baseline"),
    ("error", "unmeasurable or failed"),
    ("IMPROVED", "improved"),
    ("NEW", "new"),
    ("ok", "ok"),
)


def counts_line(results: Sequence[TestResult]) -> str:
    """One line for the end of a run: how many measured tests had each status, the worst first."""
    statuses = [result.status for result in results]
    known = dict(_COUNTED)
    parts = [f"{statuses.count(status)} {word}" for status, word in _COUNTED if status in statuses]
    parts += [f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses) if s not in known]
    return f"{len(results)} measured: " + ", ".join(parts) if results else "no test measured"
