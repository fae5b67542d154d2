"""The model's one error: bad input (a setting, a card, a size, a snapshot file), said in one line; and the
text of any exception, whose own `__str__` may raise."""

from __future__ import annotations


class ModelError(Exception):
    """Bad input to the allocator's model; its message is a single line naming the bad value."""


def exception_text(exc: BaseException) -> str:
    """`str(exc)`, or `<Type.__str__ raised>` where the exception's own `__str__` raises."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}.__str__ raised>"
