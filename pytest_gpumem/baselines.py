"""Backward-compatible names of the baseline store and the comparison, now in ``store`` and ``compare``.

``store.py`` holds the file (schema, load, merging atomic write, update, prune); ``compare.py`` holds the
judgement (tolerance, verdicts, version warnings). New code imports from those modules.
"""

from __future__ import annotations

from pytest_gpumem.compare import (
    GradientStatus,
    PhaseComparison,
    PhaseStatus,
    Status,
    Tolerance,
    Verdict,
    compare,
    environment_warnings,
    equivalent,
)
from pytest_gpumem.constants import DEFAULT_FILENAME, DEFAULT_SLACK_BYTES, DEFAULT_TOLERANCE_PERCENT
from pytest_gpumem.store import (
    MAX_BYTES,
    MAX_FILE_BYTES,
    SCHEMA,
    VERSION,
    BaselineError,
    BaselineStore,
    DeviceIdentity,
    Entry,
    Environment,
    UpdateSummary,
    dumps,
    load,
    loads,
    prune,
    unused,
    update,
    write,
)

__all__ = [
    "DEFAULT_FILENAME",
    "DEFAULT_SLACK_BYTES",
    "DEFAULT_TOLERANCE_PERCENT",
    "MAX_BYTES",
    "MAX_FILE_BYTES",
    "SCHEMA",
    "VERSION",
    "BaselineError",
    "BaselineStore",
    "DeviceIdentity",
    "Entry",
    "Environment",
    "GradientStatus",
    "PhaseComparison",
    "PhaseStatus",
    "Status",
    "Tolerance",
    "UpdateSummary",
    "Verdict",
    "compare",
    "dumps",
    "environment_warnings",
    "equivalent",
    "load",
    "loads",
    "prune",
    "unused",
    "update",
    "write",
]
