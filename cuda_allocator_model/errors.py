"""The model's one error: bad input (a setting, a card, a size, a snapshot file), said in one line."""

from __future__ import annotations


class ModelError(Exception):
    """Bad input to the allocator's model; its message is a single line naming the bad value."""
