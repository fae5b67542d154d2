"""The `--gpumem-json` document: its version, the run's backend and device, the commit it was made at,
and each test's result."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpumem.results import TestResult

JSON_VERSION = 1


def document(
    results: Sequence[TestResult], backend: str | None, device: str | None, commit: Mapping[str, object] | None = None
) -> dict[str, Any]:
    """The `--gpumem-json` document; `commit` is the work tree's (`{"sha": ..., "dirty": ...}`), None
    outside git."""
    return {
        "version": JSON_VERSION,
        "backend": backend,
        "device": device,
        "commit": None if commit is None else dict(commit),
        "tests": [r.to_json() for r in results],
    }
