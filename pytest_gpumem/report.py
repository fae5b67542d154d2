"""Pure functions from results to the report table and the JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from pytest_gpumem.results import TestResult
from pytest_gpumem.sizes import format_size

JSON_VERSION = 1


def phase_names(results: Sequence[TestResult]) -> list[str]:
    """Every phase name, in the order first seen."""
    names: dict[str, None] = {}
    for result in results:
        names.update(dict.fromkeys(result.phases))
    return list(names)


def _cell(n: int | None) -> str:
    return "" if n is None else format_size(n)


def table(results: Sequence[TestResult]) -> str:
    """The `--gpumem-report` table: one row a test, a column for each phase and for the whole call."""
    phases = phase_names(results)
    headers = ["test", "backend", "device", *phases, "call peak", "budget", "status"]
    rows = [
        [
            r.nodeid,
            r.backend,
            r.device,
            *(_cell(r.phases[p].peak_bytes) if p in r.phases else "" for p in phases),
            _cell(r.peak_bytes),
            r.budget_text or "",
            r.status,
        ]
        for r in results
    ]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def document(results: Sequence[TestResult], backend: str | None, device: str | None) -> dict[str, Any]:
    """The `--gpumem-json` document."""
    return {
        "version": JSON_VERSION,
        "backend": backend,
        "device": device,
        "tests": [r.to_dict() for r in results],
    }
