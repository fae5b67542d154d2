"""pytest-gpumem's error for bad input and its warning, and the one way an exception becomes a line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cuda_allocator_model import ModelError, exception_text


class GpuMemError(ModelError):
    """Bad input to the plugin or the fixture; its message is a single line naming the bad value."""


class GpuMemWarning(UserWarning):
    """A measurement that ran but could not see everything (e.g. threads the test started)."""


@contextmanager
def from_the_model() -> Iterator[None]:
    """Within it, an error of the allocator's model (a bad size, card or setting given to the plugin) is
    raised as a GpuMemError with the same line: users of the plugin catch one type."""
    try:
        yield
    except GpuMemError:
        raise
    except ModelError as exc:
        raise GpuMemError(str(exc)) from None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (`nested too deeply` for a recursion), else its type's name."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    lines = exception_text(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, or `Type` alone where there is no message."""
    lines = exception_text(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__
