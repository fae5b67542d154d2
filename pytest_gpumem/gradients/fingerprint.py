"""Gradient fingerprints: a few numbers per parameter that catch a changed gradient, small enough for JSON.

A memory-saving strategy must not change what it computes. Storing every gradient is out of the question
(a baseline file is reviewed in pull requests), so each gradient is reduced to a fingerprint, computed in
float64 on the CPU:

* ``l2`` -- the Euclidean norm, ``l1`` -- the sum of absolute values, ``sum`` -- the plain sum,
  ``max_abs`` -- the largest absolute value;
* ``proj`` -- ``NUM_PROJECTIONS`` (8) random projections ``<g, r_k>`` with ``r_k ~ N(0, 1)`` drawn (as
  float32, then widened) from a ``torch.Generator`` seeded from the parameter's name and shape. For any
  change ``d`` of the gradient, ``<d, r_k>`` is normal with standard deviation ``||d||``, so the
  projections catch changes that leave the norms alone (a permutation, a sign flip, noise). They are
  never compared one by one against their own (possibly near-zero) values: the RMS of the 8 differences,
  divided by the gradient's L2 norm, estimates the relative change ``||d|| / ||g||`` of the whole
  gradient vector, and that is what ``rtol`` bounds.

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

Statistics are computed in float64, the L2 norm with a running scale (as LAPACK's ``dnrm2``), so it is
finite whenever the values are (float64 values of 1e200 do not overflow, nor 1e-200 underflow).

``rtol`` defaults depend on the gradient's dtype (``DEFAULT_RTOL``). Low-precision types get several unit
roundoffs (bfloat16 ``u = 2**-8``: 2.5e-2 ~ 6u; float16 ``u = 2**-11``: 5e-3 ~ 10u), so rounding noise
passes while a real change fails (bfloat16: a 5 % rescale always, a random 5 % change of the gradient
~98 % of the time per parameter, a 1 % change never). float32 (1e-4) and float64 (1e-8) are bounded
below by run-to-run nondeterminism of GPU reductions (atomics, split-K matmuls, ~1e-6 relative in
float32), not by roundoff; float32 still catches a 0.1 % change. Override with ``rtol``/``atol``.

JSON form (stored under ``"gradients"`` in a baseline entry)::

    {"method": "torch-randn-f32/8/<hash>",
     "params": {"fc.weight": {"shape": [4, 3], "dtype": "float32",
                              "grad": {"l2": 1.5, "l1": 3.2, "sum": -0.1, "max_abs": 0.9,
                                       "proj": [0.3, -1.2, 0.8, 2.0, 1.1, -0.4, 0.0, 1.7]}},
                "fc.bias": {"shape": [4], "dtype": "float32", "grad": null}}}

``"grad": null`` records a parameter without a gradient. Non-finite statistics are stored as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` (JSON has no such numbers). ``method`` names the projection generator
and hashes a probe of torch's random stream: should a torch release change its normal sampler, the
projections of old and new fingerprints are not compared (a note says so) and the other statistics still
are.

torch is imported only inside :func:`fingerprint`; comparing stored fingerprints needs no torch at all.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "FALLBACK_RTOL",
    "NUM_PROJECTIONS",
    "Fingerprint",
    "GradStats",
    "GradientComparison",
    "Mismatch",
    "ParamFingerprint",
    "compare_fingerprints",
    "fingerprint",
    "rtol_for",
]

NUM_PROJECTIONS = 8
"""Random projections per parameter."""

_CHUNK = 1 << 18
"""Elements per float64 chunk (projection vectors are drawn chunk by chunk: part of the method)."""

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

_STATS = ("l2", "l1", "sum", "max_abs")
_STAT_NAMES = {"l2": "L2 norm", "l1": "L1 norm", "sum": "sum", "max_abs": "max-abs", "proj": "projections"}
SUMMARY_WORST = 3
"""Parameters named in the one-line summary of a gradient change (the rest go to the report section)."""
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass(frozen=True, slots=True)
class GradStats:
    """The fingerprint of one gradient tensor (float64 statistics)."""

    l2: float
    l1: float
    sum: float
    max_abs: float
    proj: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "l2": _float_to_json(self.l2),
            "l1": _float_to_json(self.l1),
            "sum": _float_to_json(self.sum),
            "max_abs": _float_to_json(self.max_abs),
            "proj": [_float_to_json(p) for p in self.proj],
        }

    @classmethod
    def from_json(cls, obj: object, where: str) -> GradStats:
        d = _exact_keys(obj, where, ("l2", "l1", "sum", "max_abs", "proj"))
        proj = d["proj"]
        if not isinstance(proj, list) or not proj:
            raise ValueError(f"{where}.proj: expected a non-empty list of numbers, got {_short(proj)}")
        return cls(
            l2=_float_from_json(d["l2"], f"{where}.l2"),
            l1=_float_from_json(d["l1"], f"{where}.l1"),
            sum=_float_from_json(d["sum"], f"{where}.sum"),
            max_abs=_float_from_json(d["max_abs"], f"{where}.max_abs"),
            proj=tuple(_float_from_json(p, f"{where}.proj[{i}]") for i, p in enumerate(proj)),
        )


@dataclass(frozen=True, slots=True)
class ParamFingerprint:
    """Shape and dtype of a parameter's gradient (of the parameter when it has none) and its statistics.

    ``shape``/``dtype`` are ``None`` only for a ``None`` value passed with ``of="value"``.
    """

    shape: tuple[int, ...] | None
    dtype: str | None
    grad: GradStats | None

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": None if self.shape is None else list(self.shape),
            "dtype": self.dtype,
            "grad": None if self.grad is None else self.grad.to_json(),
        }

    @classmethod
    def from_json(cls, obj: object, where: str) -> ParamFingerprint:
        d = _exact_keys(obj, where, ("shape", "dtype", "grad"))
        shape = d["shape"]
        if shape is not None and (
            not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 2**63 for s in shape)
        ):
            raise ValueError(f"{where}.shape: expected a list of integers 0 <= n < 2**63 or null, got {_short(shape)}")
        dtype = d["dtype"]
        if dtype is not None and (not isinstance(dtype, str) or not dtype):
            raise ValueError(f"{where}.dtype: expected a dtype name or null, got {_short(dtype)}")
        grad = d["grad"]
        return cls(
            shape=None if shape is None else tuple(shape),
            dtype=dtype,
            grad=None if grad is None else GradStats.from_json(grad, f"{where}.grad"),
        )


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Fingerprints of named gradients, plus the projection method that produced them."""

    params: Mapping[str, ParamFingerprint]
    method: str

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "params": {k: v.to_json() for k, v in self.params.items()}}

    @classmethod
    def from_json(cls, obj: object, where: str = "gradients") -> Fingerprint:
        """Validate and build; a ``ValueError`` names the offending location (``where`` is its prefix)."""
        d = _exact_keys(obj, where, ("method", "params"))
        method = d["method"]
        if not isinstance(method, str) or not method:
            raise ValueError(f"{where}.method: expected a non-empty string, got {_short(method)}")
        params = d["params"]
        if not isinstance(params, dict):
            raise ValueError(f"{where}.params: expected an object, got {_short(params)}")
        out: dict[str, ParamFingerprint] = {}
        for name, value in params.items():
            out[name] = ParamFingerprint.from_json(value, f"{where}.params[{_key(name)}]")
        return cls(params=out, method=method)


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
        parts = ", ".join(f"gradient {_short(m.param, 40)} {m.short or m.statistic}" for m in worst)
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


# --------------------------------------------------------------------------------------------- computing


def fingerprint(
    tensors: Mapping[str, torch.Tensor | None] | nn.Module,
    *,
    of: Literal["auto", "grad", "value"] = "auto",
) -> Fingerprint:
    """Fingerprint gradients.

    ``tensors`` is a module (its ``named_parameters()``) or a mapping of names to tensors. With
    ``of="grad"`` each tensor's ``.grad`` is fingerprinted, and a parameter whose ``.grad`` is ``None`` is
    recorded as such (with the parameter's shape and dtype). With ``of="value"`` the mapping's values are
    the gradients themselves (e.g. from ``torch.autograd.grad``), ``None`` allowed. ``of="auto"`` (the
    default) reads a module's ``.grad``, and for a mapping decides per value: a leaf tensor that requires
    a gradient (a parameter) or has one stands for its ``.grad``; any other tensor is a gradient itself.

    A tensor on the ``meta`` device has no values: ``ValueError``, naming it.

    Statistics are computed in float64 on the CPU, chunk by chunk: a device gradient is copied to host
    memory in its own dtype and cast there. A contiguous (or sparse) device gradient allocates nothing on
    the device; a non-contiguous one may be made contiguous there by the copy, so fingerprint outside a
    measured region. Cost: about 0.04 s of CPU per million elements.
    """
    import torch

    if of not in ("auto", "grad", "value"):
        raise ValueError(f"fingerprint(of=...) must be 'auto', 'grad' or 'value', got {of!r}")
    items = _items(torch, tensors, of)
    mode = "grad" if isinstance(tensors, torch.nn.Module) else of  # a module's parameters: their .grad
    method = _method(torch)
    params: dict[str, ParamFingerprint] = {}
    with torch.no_grad():
        for name, tensor in items:
            params[name] = _param_fingerprint(torch, name, tensor, mode)
    return Fingerprint(params=params, method=method)


def _items(torch: Any, tensors: object, of: str) -> list[tuple[str, torch.Tensor | None]]:
    if isinstance(tensors, torch.nn.Module):
        if of == "value":
            raise ValueError("fingerprint(module) reads the parameters' .grad; of='value' needs a mapping")
        return list(tensors.named_parameters())
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    raise TypeError(f"fingerprint() takes an nn.Module or a mapping of names to tensors, got {type(tensors).__name__}")


def _param_fingerprint(torch: Any, name: object, tensor: object, of: str) -> ParamFingerprint:
    if not isinstance(name, str):
        raise TypeError(f"fingerprint(): names must be strings, got {_short(name)}")
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fingerprint(): {_short(name)} is a {type(tensor).__name__}, not a tensor")
    if tensor is None:
        if of == "grad":
            raise TypeError(f"fingerprint(): {_short(name)} is None; of='grad' needs the parameter tensor")
        return ParamFingerprint(shape=None, dtype=None, grad=None)
    reads_grad = of == "grad" or (of == "auto" and tensor.is_leaf and (tensor.requires_grad or tensor.grad is not None))
    grad = tensor.grad if reads_grad else tensor
    for t in (tensor, grad):
        if t is not None and t.is_meta:
            raise ValueError(
                f"fingerprint(): {_short(name)} is on the meta device, which holds shapes but no values: "
                "there is nothing to fingerprint (check gradients on a real device)"
            )
    source = tensor if grad is None else grad
    shape = tuple(source.shape)
    stats = None if grad is None else _stats(torch, grad, _seed(name, shape))
    return ParamFingerprint(shape=shape, dtype=_dtype_name(source.dtype), grad=stats)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _seed(name: str, shape: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{name}|{list(shape)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_METHOD_CACHE: dict[str, str] = {}


def _method(torch: Any) -> str:
    """Name of the projection method, with a hash of a probe of torch's float64 normal stream."""
    version = str(torch.__version__)
    cached = _METHOD_CACHE.get(version)
    if cached is None:
        gen = torch.Generator(device="cpu").manual_seed(20240607)
        probe = torch.randn((NUM_PROJECTIONS, 37), generator=gen, dtype=torch.float32)
        text = ",".join(float(v).hex() for v in probe.reshape(-1).tolist())
        cached = f"torch-randn-f32/{NUM_PROJECTIONS}/{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        _METHOD_CACHE[version] = cached
    return cached


def _stats(torch: Any, grad: torch.Tensor, seed: int) -> GradStats:
    t = grad.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")  # same dtype: no cast on the device; densify (below) on the host
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    n = flat.numel()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    norm = _Norm()
    l1 = 0.0
    total = 0.0
    max_abs = 0.0
    proj = torch.zeros(NUM_PROJECTIONS, dtype=torch.float64)
    for start in range(0, n, _CHUNK):
        chunk = flat[start : start + _CHUNK].to(torch.float64)
        absval = chunk.abs()
        l1 += float(absval.sum())
        total += float(chunk.sum())
        chunk_max = float(absval.max())
        norm.add(torch, chunk, chunk_max)
        max_abs = math.nan if math.isnan(chunk_max) or math.isnan(max_abs) else max(max_abs, chunk_max)
        # float32 normals (4x faster to draw than float64), exactly widened: products and sums in float64
        vectors = torch.randn((NUM_PROJECTIONS, chunk.numel()), generator=gen, dtype=torch.float32)
        proj += vectors.to(torch.float64) @ chunk
    return GradStats(l2=norm.value(), l1=l1, sum=total, max_abs=max_abs, proj=tuple(float(p) for p in proj.tolist()))


@dataclass(slots=True)
class _Norm:
    """A running L2 norm kept as ``scale * sqrt(ssq)`` with ``scale`` the largest magnitude so far (as
    LAPACK's ``dnrm2``): squares of huge values (1e200) cannot overflow, nor those of tiny ones (1e-200)
    underflow, so the norm is finite whenever the values are. ``special`` holds inf or nan once seen."""

    scale: float = 0.0
    ssq: float = 0.0
    special: float = 0.0

    def add(self, torch: Any, chunk: torch.Tensor, chunk_max: float) -> None:
        if not math.isfinite(chunk_max):
            self.special = math.nan if math.isnan(chunk_max) or math.isnan(self.special) else math.inf
            return
        if chunk_max == 0.0:
            return
        scaled = chunk / chunk_max
        part = float(torch.dot(scaled, scaled))
        if chunk_max > self.scale:
            self.ssq = self.ssq * (self.scale / chunk_max) ** 2 + part
            self.scale = chunk_max
        else:
            self.ssq += part * (chunk_max / self.scale) ** 2

    def value(self) -> float:
        return self.special if self.special != 0.0 else self.scale * math.sqrt(self.ssq)


# -------------------------------------------------------------------------------------------- comparing


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


# ----------------------------------------------------------------------------------------- JSON helpers


def _float_to_json(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _float_from_json(v: object, where: str) -> float:
    if type(v) is float or type(v) is int:
        number = float(v) if type(v) is float or abs(v) < _FLOAT_INT_LIMIT else math.inf
        if math.isfinite(number):
            return number
        raise ValueError(f'{where}: a number beyond the float range ({_short(v)}); write "inf" or "-inf" if meant')
    if isinstance(v, str) and v in _NONFINITE:
        return _NONFINITE[v]
    raise ValueError(f'{where}: expected a number (or "nan", "inf", "-inf"), got {_short(v)}')


_FLOAT_INT_LIMIT = 2**1024
"""An integer at least this large has no float (``float()`` raises ``OverflowError``)."""


def _exact_keys(obj: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {_short(obj)}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    extra = [k for k in obj if k not in keys]
    if extra:
        raise ValueError(f"{where}: unknown key {extra[0]!r}")
    return obj


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def _short(v: object, limit: int = 60) -> str:
    if type(v) is int and v.bit_length() > 200:
        return f"an integer of {math.floor(math.log10(abs(v))) + 1:,} digits"  # str() raises past 4,300
    try:
        text = repr(v)
    except Exception:
        text = f"<a {type(v).__name__} whose repr raised>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
