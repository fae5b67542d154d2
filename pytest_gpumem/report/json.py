"""The `--gpumem-json` document: its version, the run's backend and device, the commit it was made at,
and each test's result, written at the end of a run. `pytest_gpumem.results.report_file.read_report` is
its one reader (`pytest-gpumem compare`, `merge` and `history --reports`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_gpumem.report.commit import Head
from pytest_gpumem.results import TestResult
from pytest_gpumem.results.report_file import REPORT_VERSION


def document(
    results: Sequence[TestResult], backend: str | None, device: str | None, commit: Head | None = None
) -> dict[str, Any]:
    """The `--gpumem-json` document; `commit` is the work tree's, None outside git."""
    return {
        "version": REPORT_VERSION,
        "backend": backend,
        "device": device,
        "commit": None if commit is None else commit.to_json(),
        "tests": [r.to_json() for r in results],
    }
