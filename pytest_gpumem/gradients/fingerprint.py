"""Gradient fingerprints: a few numbers per parameter that catch a changed gradient, small enough for JSON,
made from a test's gradients (their stored form is ``results.gradients``, their comparison ``gradients.mismatches``).

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

Statistics are computed in float64, the L2 norm with a running scale (as LAPACK's ``dnrm2``), so it is
finite whenever the values are (float64 values of 1e200 do not overflow, nor 1e-200 underflow).

``method`` names the projection generator and hashes a probe of torch's random stream: should a torch
release change its normal sampler, the projections of old and new fingerprints are not compared (a note
says so) and the other statistics still are.

torch is imported only inside :func:`fingerprint`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pytest_gpumem.results.checks import short
from pytest_gpumem.results.gradients import Fingerprint, GradStats, ParamFingerprint

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["NUM_PROJECTIONS", "fingerprint"]

NUM_PROJECTIONS = 8
"""Random projections per parameter."""

_CHUNK = 1 << 18
"""Elements per float64 chunk (projection vectors are drawn chunk by chunk: part of the method)."""


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
        raise TypeError(f"fingerprint(): names must be strings, got {short(name)}")
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fingerprint(): {short(name)} is a {type(tensor).__name__}, not a tensor")
    if tensor is None:
        if of == "grad":
            raise TypeError(f"fingerprint(): {short(name)} is None; of='grad' needs the parameter tensor")
        return ParamFingerprint(shape=None, dtype=None, grad=None)
    reads_grad = of == "grad" or (of == "auto" and tensor.is_leaf and (tensor.requires_grad or tensor.grad is not None))
    grad = tensor.grad if reads_grad else tensor
    for t in (tensor, grad):
        if t is not None and t.is_meta:
            raise ValueError(
                f"fingerprint(): {short(name)} is on the meta device, which holds shapes but no values: "
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
