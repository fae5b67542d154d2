"""Comparing gradient fingerprints: per-dtype tolerances, one mismatch per changed parameter. No torch.

A fingerprint (``gradients.fingerprint``) holds, per parameter, its norms (``l2``, ``l1``, ``sum``,
``max_abs``) and random projections (``proj``) whose RMS difference over the L2 norm estimates the
relative change of the whole gradient vector.

Comparison: a statistic ``a`` (baseline) against ``b`` (current) passes when
``|a - b| <= atol + rtol * scale``, with ``scale`` taken from the baseline: ``|a|`` for ``l2``, ``l1``
and ``max_abs``, the baseline's ``l1`` for ``sum`` (``|sum| <= l1``, and a sum can cancel to ~0) and
its ``l2`` for the projections' RMS difference. The reported change is ``(b - a) / scale`` (signed; the
projections' RMS is unsigned), one definition for every statistic, so a gradient scaled by 2 reads
``+100.0%`` whichever statistic is shown. One mismatch per parameter: the norm statistic that changed
most, else (norms all within tolerance: a permutation, a sign flip, noise) the projections.

A failure is reported in one line, ``gradients changed in 3 of 28 parameters; worst: gradient 'a' L2
norm +100.0%, ...`` (:attr:`GradientComparison.messages`), and one line per changed parameter
(:attr:`GradientComparison.details`, also at the end of ``notes``) for the report section.

``rtol`` defaults depend on the gradient's dtype (``DEFAULT_RTOL``). Low-precision types get several unit
roundoffs (bfloat16 ``u = 2**-8``: 2.5e-2 ~ 6u; float16 ``u = 2**-11``: 5e-3 ~ 10u), so rounding noise
passes while a real change fails (bfloat16: a 5 % rescale always, a random 5 % change of the gradient
~98 % of the time per parameter, a 1 % change never). float32 (1e-4) and float64 (1e-8) are bounded
below by run-to-run nondeterminism of GPU reductions (atomics, split-K matmuls, ~1e-6 relative in
float32), not by roundoff; float32 still catches a 0.1 % change. Override with ``rtol``/``atol``.

Fingerprints are made by ``gradients.fingerprint``; their stored form is ``results.gradients``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pytest_gpumem.results.gradients import Fingerprint, GradientComparison, GradStats, Mismatch, ParamFingerprint

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "FALLBACK_RTOL", "compare_fingerprints", "rtol_for"]

DEFAULT_RTOL: Mapping[str, float] = {
    "float64": 1e-8,
    "complex128": 1e-8,
    "float32": 1e-4,
    "complex64": 1e-4,
    "float16": 5e-3,
    "complex32": 5e-3,
    "bfloat16": 2.5e-2,
    "float8_e4m3fn": 2.5e-1,
    "float8_e4m3fnuz": 2.5e-1,
    "float8_e5m2": 5e-1,
    "float8_e5m2fnuz": 5e-1,
}
"""Relative tolerance per gradient dtype (see the module docstring for the reasoning)."""

FALLBACK_RTOL = 1e-2
"""Relative tolerance for a dtype missing from ``DEFAULT_RTOL``."""

DEFAULT_ATOL = 0.0
"""Absolute tolerance: zero, so an exactly-zero gradient that becomes non-zero is a change."""

_STAT_NAMES = {"l2": "L2 norm", "l1": "L1 norm", "sum": "sum", "max_abs": "max-abs", "proj": "projections"}


def rtol_for(dtype: str | None, rtol: float | Mapping[str, float] | None = None) -> float:
    """The relative tolerance for a gradient dtype: ``rtol`` if a number, else its entry, else defaults."""
    if isinstance(rtol, (int, float)):
        return float(rtol)
    if rtol is not None and dtype is not None and dtype in rtol:
        return float(rtol[dtype])
    if dtype is None:
        return FALLBACK_RTOL
    return DEFAULT_RTOL.get(dtype, FALLBACK_RTOL)


def compare_fingerprints(
    baseline: Fingerprint,
    current: Fingerprint,
    *,
    rtol: float | Mapping[str, float] | None = None,
    atol: float | None = None,
) -> GradientComparison:
    """Compare current gradient fingerprints with stored ones.

    ``rtol`` overrides the per-dtype defaults, for every dtype (a number) or some (a mapping such as
    ``{"bfloat16": 0.05}``); ``atol`` (default ``DEFAULT_ATOL``) is added to every allowed difference.
    One :class:`Mismatch` per offending parameter (the statistic that changed most; the projections only
    when the norms all pass); a parameter added or missing, a gradient that appeared or vanished, a shape
    or a dtype change are mismatches of their own.
    """
    if isinstance(rtol, (int, float)) and not (rtol >= 0 and math.isfinite(rtol)):
        raise ValueError(f"gradient rtol must be a finite number >= 0, got {rtol!r}")
    if isinstance(rtol, Mapping):
        for key, value in rtol.items():
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"gradient rtol for {key!r} must be a finite number >= 0, got {value!r}")
    abs_tol = DEFAULT_ATOL if atol is None else float(atol)
    if not (abs_tol >= 0 and math.isfinite(abs_tol)):
        raise ValueError(f"gradient atol must be a finite number >= 0, got {atol!r}")
    compare_proj = baseline.method == current.method
    notes: list[str] = []
    if not compare_proj:
        notes.append(
            "gradient projections not compared: the baseline was recorded with another projection method "
            f"({baseline.method} vs {current.method}; torch's random stream changed?); norms still compared"
        )
    mismatches: list[Mismatch] = []
    for name, old in baseline.params.items():
        new = current.params.get(name)
        if new is None:
            message = f"gradient {name!r}: parameter missing (in baseline)"
            mismatches.append(Mismatch(name, "param", message, short="missing"))
            continue
        found = _compare_param(name, old, new, rtol, abs_tol, compare_proj)
        if found is not None:
            mismatches.append(found)
    added = [name for name in current.params if name not in baseline.params]
    for name in added:
        message = f"gradient {name!r}: new parameter (not in baseline)"
        mismatches.append(Mismatch(name, "param", message, short="new (not in baseline)"))
    return GradientComparison(tuple(mismatches), tuple(notes), len(baseline.params) + len(added))


def _compare_param(
    name: str,
    old: ParamFingerprint,
    new: ParamFingerprint,
    rtol: float | Mapping[str, float] | None,
    atol: float,
    compare_proj: bool,
) -> Mismatch | None:
    structural = _structural(name, old, new)
    if structural is not None or old.grad is None or new.grad is None:
        return structural
    tol = rtol_for(new.dtype, rtol)
    rtol_text = f"rtol {_pct(tol)} for {new.dtype}"
    a, b = old.grad, new.grad
    return _compare_norms(name, a, b, tol, atol, rtol_text) or (
        _compare_proj(name, a, b, tol, atol, rtol_text) if compare_proj else None
    )


def _structural(name: str, old: ParamFingerprint, new: ParamFingerprint) -> Mismatch | None:
    """A shape or dtype change, or a gradient that appeared or vanished."""
    if old.shape != new.shape:
        change = f"{_shape(old.shape)} to {_shape(new.shape)}"
        return Mismatch(name, "shape", f"gradient {name!r}: shape changed from {change}", short=f"shape {change}")
    if old.dtype != new.dtype:
        change = f"{old.dtype} to {new.dtype}"
        return Mismatch(name, "dtype", f"gradient {name!r}: dtype changed from {change}", short=f"dtype {change}")
    if (old.grad is None) == (new.grad is None):
        return None
    if new.grad is None:
        return Mismatch(name, "grad", f"gradient {name!r} is None (baseline has a gradient)", short="is None")
    return Mismatch(name, "grad", f"gradient {name!r} is present (baseline: None)", short="present (baseline None)")


def _compare_norms(name: str, a: GradStats, b: GradStats, tol: float, atol: float, rtol_text: str) -> Mismatch | None:
    """The norm statistic that changed most beyond ``atol + tol * |baseline|`` (the sum's scale is the
    baseline's L1 norm: a sum can cancel to ~0); its change is relative to that same scale."""
    checks = [("l2", a.l2, b.l2, abs(a.l2)), ("l1", a.l1, b.l1, abs(a.l1))]
    checks += [("sum", a.sum, b.sum, abs(a.l1)), ("max_abs", a.max_abs, b.max_abs, abs(a.max_abs))]
    worst: Mismatch | None = None
    for stat, va, vb, scale in checks:
        if va == vb or (math.isnan(va) and math.isnan(vb)):
            continue
        label = _STAT_NAMES[stat]
        if not (math.isfinite(va) and math.isfinite(vb) and math.isfinite(scale)):
            # inf - inf or a finite value becoming non-finite (or back): always a change
            message = f"gradient {name!r}: {label} is {vb!r} (baseline {va!r})"
            return Mismatch(name, stat, message, math.inf, tol, None, f"{label} {va!r} -> {vb!r}")
        if abs(vb - va) <= atol + tol * scale:
            continue
        change = (vb - va) / scale if scale > 0 else math.copysign(math.inf, vb - va)
        if worst is not None and worst.rel_error is not None and abs(change) <= worst.rel_error:
            continue
        of = " of the baseline's L1 norm" if stat == "sum" else ""
        figure = f"{label} {va:.3g} -> {vb:.3g}" if math.isinf(change) else f"{label} {_signed_pct(change)}{of}"
        message = f"gradient {name!r}: {figure} (baseline {va:.6g}, now {vb:.6g}; {rtol_text})"
        worst = Mismatch(name, stat, message, abs(change), tol, change, figure.removesuffix(of))
    return worst


def _compare_proj(name: str, a: GradStats, b: GradStats, tol: float, atol: float, rtol_text: str) -> Mismatch | None:
    """The projections: their RMS difference over the baseline's L2 norm estimates ``||d|| / ||g||``."""
    if len(a.proj) != len(b.proj):
        message = f"gradient {name!r}: {len(b.proj)} projections, baseline has {len(a.proj)}"
        return Mismatch(name, "proj", message, short="projections count changed")
    if not all(math.isfinite(p) for p in (*a.proj, *b.proj)):
        if all(pa == pb or (math.isnan(pa) and math.isnan(pb)) for pa, pb in zip(a.proj, b.proj, strict=True)):
            return None
        message = f"gradient {name!r}: random projections are {list(b.proj)!r} (baseline {list(a.proj)!r})"
        return Mismatch(name, "proj", message, math.inf, tol, None, "projections non-finite")
    rms = math.sqrt(sum((pa - pb) ** 2 for pa, pb in zip(a.proj, b.proj, strict=True)) / len(a.proj))
    scale = abs(a.l2)
    if rms <= atol + tol * scale:
        return None
    change = rms / scale if scale > 0 else math.inf
    message = (
        f"gradient {name!r} changed by about {_pct(change)} of its baseline L2 norm "
        f"(RMS of {len(a.proj)} random projections; {rtol_text})"
    )
    return Mismatch(name, "proj", message, change, tol, change, f"~{_pct(change)} (random projections)")


def _signed_pct(fraction: float) -> str:
    """'+100.0%', '-3.2%', '+0.0999%': one decimal, more for changes under 1% (tolerances are small)."""
    percent = fraction * 100
    return f"{percent:+.1f}%" if abs(percent) >= 1 else f"{percent:+.3g}%"


def _pct(fraction: float) -> str:
    if math.isinf(fraction):
        return "inf%"
    return f"{fraction * 100:.3g}%"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "None" if shape is None else str(list(shape))
