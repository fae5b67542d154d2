"""The one error type and the one warning of pytest-gpumem."""

from __future__ import annotations


class GpuMemError(Exception):
    """The one error type of pytest-gpumem; its message is a single line naming the bad value."""


class GpuMemWarning(UserWarning):
    """A measurement that ran but could not see everything (e.g. threads the test started)."""
