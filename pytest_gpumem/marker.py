"""The `max_memory` marker's name and its signature, as `pytest --markers` lists it (every run registers it;
reading a marker into a `Budget` is `budget.py`'s, imported only where a test is measured)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

MARKER = "max_memory"


def max_memory(
    limit: object = None,
    *,
    tolerance: object = None,
    capacity: object = None,
    leak: object = None,
    device: object = None,
    explain: bool = False,
    **phase_limits: object,
) -> None:
    """The marker's signature, which its line in `pytest --markers` is written from (`budget_from_marker`
    reads the marker's arguments)."""


def _written(function: Callable[..., object]) -> str:
    """`name(a=None, *, b=False, **rest)`: a signature as a user writes the call."""
    parts: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            parts.append(f"**{parameter.name}")
        else:
            parts.append(f"{parameter.name}={parameter.default!r}")
    return f"{function.__name__}({', '.join(parts)})"


MARKER_SIGNATURE = (
    f"{_written(max_memory)}: fail the test when the peak memory of its call (limit) or of a named gpumem phase "
    "(e.g. forward='20 MB') exceeds the size given, when it leaves more than leak= allocated, or (capacity=) run "
    "it on a device of that size or a card such as 'H100-80GB'; device='meta' makes it a prediction on the meta "
    "device; explain=True says what each peak is made of; sizes are bytes or strings like '64 MiB', '1.5 GB'."
)
