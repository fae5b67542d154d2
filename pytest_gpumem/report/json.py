"""The `--gpumem-json` document: its version, the run's backend and device, and each test's result."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_gpumem.results import TestResult

JSON_VERSION = 1


def document(results: Sequence[TestResult], backend: str | None, device: str | None) -> dict[str, Any]:
    """The `--gpumem-json` document."""
    return {
        "version": JSON_VERSION,
        "backend": backend,
        "device": device,
        "tests": [r.to_dict() for r in results],
    }
