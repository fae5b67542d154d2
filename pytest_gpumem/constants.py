"""Defaults shared by the options and the modules behind them (kept apart so that start-up stays cheap)."""

from __future__ import annotations

ROUNDINGS = ("auto", "none", "cuda")  # auto: cuda on meta (a prediction of a GPU), none on cpu
PATHS = ("cpu", "gpu")  # whose code paths the tracker runs: the CPU's, or a GPU's (foreach, fused attention)
COLUMNS = ("device", "phases", "peak", "reserved", "net", "baseline", "change", "budget", "status", "made-of")
"""The report table's columns a user may choose (--gpumem-columns), in the table's order; the test is always shown."""
ID_FORMS = ("short", "long")  # the report table's test ids: without the prefix they all share, or whole
DEFAULT_FILENAME = "gpumem-baselines.json"
DEFAULT_TOLERANCE_PERCENT = 5.0
DEFAULT_SLACK_BYTES = 1 << 20
WORKSPACES_AT_ZERO = "cuDNN workspaces counted at 0 B"  # how the tracker's note on them begins
DEFAULT_DIST_TIMEOUT = 120.0  # seconds the ranks may run the function, once all have joined the process group
