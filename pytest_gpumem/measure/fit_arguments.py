"""A fit's arguments and its measure's samples checked: what cannot be is refused in one line."""

from __future__ import annotations

import inspect
import operator

from cuda_allocator_model import shorten
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.fit import MAX_BATCH, Sample


def check_step(step: object) -> None:
    """A step is called as step(n): refuse, in one line, what cannot be (a signature torch or C code does not
    tell is taken as it is)."""
    if not callable(step):
        raise GpuMemError(f"fit step must be a function of the batch size, called as step(n), got {shorten(step)}")
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(1)
    except TypeError:
        name = getattr(step, "__qualname__", type(step).__name__)
        raise GpuMemError(
            f"fit step must take the batch size as its one argument, called as step(n); {name}{signature} cannot be"
        ) from None


def check_sizes(sizes: object) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise GpuMemError(f"fit sizes must be a list of positive integers, got {shorten(sizes)}")
    values: list[object] = list(sizes)
    checked = []
    for n in values:
        try:
            if isinstance(n, bool):
                raise TypeError
            size = operator.index(n)  # type: ignore[arg-type]  # int, numpy and torch integers
        except TypeError:
            raise GpuMemError(f"fit sizes must be positive integers, got {shorten(n)} in {shorten(values)}") from None
        if size <= 0 or size > MAX_BATCH:
            raise GpuMemError(
                f"fit sizes must be integers from 1 to {MAX_BATCH:,}, got {shorten(size, 32)} in {shorten(values)}"
            )
        checked.append(size)
    if len(set(checked)) < 2:
        raise GpuMemError(f"fit needs at least 2 distinct sizes (3 to check the lines), got {shorten(values)}")
    return checked


def check_sample(sample: object, n: int) -> Sample:
    if not isinstance(sample, Sample):
        raise GpuMemError(f"fit: measuring size {n:,} must give a Sample, got {shorten(sample)}")
    for value in (sample.start, sample.peak, sample.end):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GpuMemError(f"fit: the measured bytes at size {n:,} must be ints >= 0, got {shorten(value)}")
    return sample


def check_tolerance(tolerance: float, slack: int) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < float("inf"):
        raise GpuMemError(f"fit tolerance must be a finite number >= 0, got {shorten(tolerance)}")
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise GpuMemError(f"fit slack must be an int >= 0 (bytes), got {shorten(slack)}")
