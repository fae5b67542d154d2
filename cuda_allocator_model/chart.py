"""What the pages that chart memory share (the explanation's, the history's and the replay's): round
steps, byte axes labelled in the largest binary unit they reach, and where a value falls in a plot area.
Each page draws its own marks; where they fall and what the axes say is decided here, once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PlotArea", "byte_range", "byte_ticks", "nice_step"]

_UNITS = ((1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB"), (1, "B"))
_TICKS_FROM_ZERO = 5  # about how many steps an axis from 0 has
_STEPS_AROUND = 4  # about how many steps an axis around a range of figures has
_MIN_SPAN = 0.05
"""The least an axis around figures spans, as a share of its top figure: a change of a few bytes stays flat."""


def nice_step(raw: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) at least `raw`."""
    power = 10.0 ** math.floor(math.log10(raw))
    ratio = raw / power
    return (1 if ratio <= 1 else 2 if ratio <= 2 else 5 if ratio <= 5 else 10) * power


def _unit(top: float) -> tuple[int, str]:
    """The largest binary unit `top` reaches (B below 1 KiB): its bytes and its name."""
    return next((size, name) for size, name in _UNITS if top >= size or size == 1)


def byte_ticks(top: float) -> list[list[Any]]:
    """An axis from 0 up to `top` bytes: about five round steps in the largest unit `top` reaches, as
    [bytes, label] pairs ("0 MiB", "0.5 MiB", ...)."""
    unit, name = _unit(top)
    step = max(nice_step(top / unit / _TICKS_FROM_ZERO), 1 if unit == 1 else 0)
    ticks: list[list[Any]] = []
    value = 0.0
    while value * unit <= top:
        ticks.append([value * unit, f"{_short_number(round(value * 1000) / 1000)} {name}"])
        value += step
    return ticks


def _short_number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def byte_range(low: int, high: int) -> tuple[float, float, list[tuple[float, str]]]:
    """An axis around figures `low`..`high`, widened to span `_MIN_SPAN` of the top figure at least: its
    ends, round values a step outside the figures (never below 0), and the marks between them (about
    five), each labelled in the unit of the top with the step's decimals ("7 MiB", "2.5 KiB")."""
    unit, name = _unit(high)
    widen = max(0.0, high * _MIN_SPAN - (high - low)) / 2
    span = (high - low + 2 * widen) / unit or max(high / unit / 10, 1.0)
    step = max(nice_step(span / _STEPS_AROUND), 1.0 if unit == 1 else 0.0)
    bottom = max(0.0, (math.ceil((low - widen) / unit / step) - 1) * step)
    top = (math.floor((high + widen) / unit / step) + 1) * step
    decimals = max(0, -math.floor(math.log10(step)))
    marks = [(bottom + i * step) * unit for i in range(round((top - bottom) / step) + 1)]
    return bottom * unit, top * unit, [(mark, f"{mark / unit:.{decimals}f} {name}") for mark in marks]


@dataclass(frozen=True)
class PlotArea:
    """Where a chart plots, in its SVG's pixels: from `left` to `right`, values from `bottom` up to `top`."""

    left: float
    right: float
    top: float
    bottom: float

    def x(self, share: float) -> float:
        """The pixel a `share` of the way across (0 the left edge, 1 the right)."""
        return self.left + share * (self.right - self.left)

    def y(self, value: float, low: float, high: float) -> float:
        """The pixel of `value` on an axis from `low` (the bottom edge) to `high` (the top edge)."""
        return self.top + (high - value) / (high - low) * (self.bottom - self.top)
