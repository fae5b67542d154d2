from __future__ import annotations


class GpuMemError(Exception):
    """The one error type of pytest-gpumem; its message is a single line naming the bad value."""
