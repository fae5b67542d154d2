"""Gradient fingerprints as stored and compared: their JSON form (``"gradients"`` in a baseline entry) and
the outcome of a comparison. No torch here; ``gradients.fingerprint`` makes them, ``gradients.mismatches``
compares them.

JSON form::

    {"method": "torch-randn-f32/8/<hash>",
     "params": {"fc.weight": {"shape": [4, 3], "dtype": "float32",
                              "grad": {"l2": 1.5, "l1": 3.2, "sum": -0.1, "max_abs": 0.9,
                                       "proj": [0.3, -1.2, 0.8, 2.0, 1.1, -0.4, 0.0, 1.7]}},
                "fc.bias": {"shape": [4], "dtype": "float32", "grad": null}}}

``"grad": null`` records a parameter without a gradient. Non-finite statistics are stored as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` (JSON has no such numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.results.checks import short
from pytest_gpumem.results.codec import Spec, Wording

__all__ = ["SUMMARY_WORST", "Fingerprint", "GradStats", "GradientComparison", "Mismatch", "ParamFingerprint"]

SUMMARY_WORST = 3
"""Parameters named in the one-line summary of a gradient change (the rest go to the report section)."""
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _float_from_json(value: Any, where: str | None, wording: Wording) -> float:
    """A statistic: a number (an integer stays one: it is written back as read), or "nan", "inf", "-inf"."""
    if type(value) is float or type(value) is int:
        if math.isfinite(value if type(value) is float else 0.0) and abs(value) < _FLOAT_INT_LIMIT:
            return value  # past the float range, JSON's 1e400 is read as inf
        raise wording.says(where, f'a number beyond the float range ({short(value)}); write "inf" or "-inf" if meant')
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    raise wording.refuse(where, 'a number (or "nan", "inf", "-inf")', value)


def _float_to_json(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


_STATISTIC = Spec(via=(_float_from_json, _float_to_json))


@dataclass(frozen=True, slots=True)
class GradStats:
    """The fingerprint of one gradient tensor (float64 statistics)."""

    l2: Annotated[float, _STATISTIC]
    l1: Annotated[float, _STATISTIC]
    sum: Annotated[float, _STATISTIC]
    max_abs: Annotated[float, _STATISTIC]
    proj: Annotated[tuple[Annotated[float, _STATISTIC], ...], Spec(expected="a non-empty list of numbers", check=bool)]


def _shape(value: list[Any]) -> bool:
    return all(type(s) is int and 0 <= s <= MAX_BYTES for s in value)


@dataclass(frozen=True, slots=True)
class ParamFingerprint:
    """Shape and dtype of a parameter's gradient (of the parameter when it has none) and its statistics.

    ``shape``/``dtype`` are ``None`` only for a ``None`` value passed with ``of="value"``.
    """

    shape: Annotated[tuple[int, ...] | None, Spec(expected="a list of integers 0 <= n < 2**63 or null", check=_shape)]
    dtype: Annotated[str | None, Spec(expected="a dtype name or null", check=bool)]
    grad: Annotated[GradStats | None, Spec(expected="an object")]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Fingerprints of named gradients, plus the projection method that produced them (``"gradients"``
    in a baseline entry, read and written by ``results.codec``)."""

    method: Annotated[str, Spec(expected="a non-empty string", check=bool)]
    params: Mapping[str, ParamFingerprint]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One parameter whose gradient no longer matches its fingerprint.

    ``statistic`` is one of ``"param"`` (added or missing), ``"grad"`` (became / stopped being None),
    ``"shape"``, ``"dtype"``, ``"l2"``, ``"l1"``, ``"sum"``, ``"max_abs"``, ``"proj"`` (the projections'
    RMS difference); ``rel_error`` (``abs(change)``) and ``rtol`` are set for the numeric statistics.
    ``change`` is the signed change relative to the baseline (see the module docstring), the same figure
    for every statistic; ``short`` is the few words the one-line summary shows for this parameter.
    """

    param: str
    statistic: str
    message: str
    rel_error: float | None = None
    rtol: float | None = None
    change: float | None = None
    short: str = ""

    @property
    def severity(self) -> float:
        """How bad, to sort the worst first: a structural change (no figure) or a non-finite one first."""
        return math.inf if self.rel_error is None else self.rel_error


@dataclass(frozen=True, slots=True)
class GradientComparison:
    """Result of :func:`compare_fingerprints`: mismatches fail, notes only inform.

    ``messages`` is one line for a failure report (a count and the worst few parameters); ``details``
    has one line per changed parameter, and ``notes`` are ``method_notes`` followed by those details
    (the lines for a report section).
    """

    mismatches: tuple[Mismatch, ...]
    method_notes: tuple[str, ...] = ()
    compared: int = 0
    """How many parameters were compared (those of the baseline and the current fingerprint together)."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def summary(self) -> str | None:
        """``gradients changed in 28 of 28 parameters; worst: gradient 'a' L2 norm +100.0%, ...``."""
        if not self.mismatches:
            return None
        total = max(self.compared, len(self.mismatches))
        head = f"gradients changed in {len(self.mismatches)} of {total} parameters"
        # figures equal to the digits shown (a uniform change) keep the parameters' order
        worst = sorted(self.mismatches, key=lambda m: -float(f"{m.severity:.4g}"))[:SUMMARY_WORST]
        parts = ", ".join(f"gradient {short(m.param, 40)} {m.short or m.statistic}" for m in worst)
        if len(self.mismatches) == 1:
            return f"{head}: {parts}"
        more = len(self.mismatches) - len(worst)
        tail = f"; {more} more in the report section" if more else ""
        return f"{head}; worst: {parts}{tail}"

    @property
    def messages(self) -> tuple[str, ...]:
        """The failure line (empty when nothing changed)."""
        summary = self.summary
        return () if summary is None else (summary,)

    @property
    def details(self) -> tuple[str, ...]:
        """One line per changed parameter, in parameter order."""
        return tuple(m.message for m in self.mismatches)

    @property
    def notes(self) -> tuple[str, ...]:
        return self.method_notes + self.details


_FLOAT_INT_LIMIT = 2**1024
"""An integer at least this large has no float (``float()`` raises ``OverflowError``)."""
