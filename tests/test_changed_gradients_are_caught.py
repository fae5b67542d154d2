"""Comparing gradient fingerprints (gradients.mismatches): a changed gradient is caught, in one mismatch per
parameter naming what changed, while the noise of reduction order and low precision passes."""

from __future__ import annotations

import math
import re

import pytest
import torch
from builders import model_with_grads

from pytest_gpumem.gradients import mismatches as GC
from pytest_gpumem.gradients.fingerprint import fingerprint
from pytest_gpumem.gradients.mismatches import compare_fingerprints
from pytest_gpumem.results.gradients import Fingerprint, GradStats, ParamFingerprint


def bf16_weight_grads() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight gradient x^T dy computed in bfloat16 two ways (one matmul / summed micro-batches)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=gen)
    dy = torch.randn(256, 128, generator=gen)
    whole = x.bfloat16().T @ dy.bfloat16()
    parts = sum(x[i : i + 32].bfloat16().T @ dy[i : i + 32].bfloat16() for i in range(0, 256, 32))
    assert isinstance(parts, torch.Tensor)
    exact = x.double().T @ dy.double()
    return whole, parts, exact


def test_fp32_scaled_by_1_001_is_caught() -> None:
    model = model_with_grads()
    base = fingerprint(model)
    for p in model.parameters():
        assert p.grad is not None
        p.grad.mul_(1.001)
    result = compare_fingerprints(base, fingerprint(model))
    assert not result.ok
    assert sorted(m.param for m in result.mismatches) == sorted(base.params)
    for mismatch in result.mismatches:
        assert mismatch.rel_error is not None and mismatch.rtol == GC.DEFAULT_RTOL["float32"]
        # the norms move by exactly the scale and are preferred to the projections' estimate
        assert mismatch.statistic in ("l2", "l1", "sum", "max_abs")
        assert mismatch.rel_error == pytest.approx(0.001, rel=1e-3)
        assert mismatch.change == pytest.approx(0.001, rel=1e-3)
        assert re.match(
            rf"gradient {re.escape(repr(mismatch.param))}: [-\w ]+ \+0\.1% (of the baseline's L1 norm )?\(",
            mismatch.message,
        )
        assert mismatch.param in mismatch.message and "rtol 0.01% for float32" in mismatch.message


def test_fp32_reduction_order_noise_passes() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 256, generator=gen)
    dy = torch.randn(512, 64, generator=gen)
    whole = x.T @ dy
    parts = sum(x[i : i + 16].T @ dy[i : i + 16] for i in range(0, 512, 16))
    assert isinstance(parts, torch.Tensor)
    assert not torch.equal(whole, parts)  # really different rounding
    assert compare_fingerprints(fingerprint({"w": whole}, of="value"), fingerprint({"w": parts}, of="value")).ok


def test_bf16_rounding_noise_passes_but_a_five_percent_change_is_caught() -> None:
    whole, parts, exact = bf16_weight_grads()
    assert not torch.equal(whole, parts)
    base = fingerprint({"w": whole}, of="value")
    assert compare_fingerprints(base, fingerprint({"w": parts}, of="value")).ok
    assert compare_fingerprints(base, fingerprint({"w": exact.bfloat16()}, of="value")).ok

    scaled = compare_fingerprints(base, fingerprint({"w": (whole.float() * 1.05).bfloat16()}, of="value"))
    assert not scaled.ok and scaled.mismatches[0].rtol == GC.DEFAULT_RTOL["bfloat16"]

    gen = torch.Generator().manual_seed(7)
    direction = torch.randn(whole.shape, generator=gen)
    noise = direction * (0.05 * whole.float().norm() / direction.norm())  # a change of 5% of the norm
    changed = fingerprint({"w": (whole.float() + noise).bfloat16()}, of="value")
    result = compare_fingerprints(base, changed)
    assert not result.ok
    assert len(result.mismatches) == 1  # the max-abs moves a little beyond the rtol, the projections by ~5%


def test_projections_report_the_change_when_the_norms_hold() -> None:
    whole, _, _ = bf16_weight_grads()
    base = fingerprint({"w": whole}, of="value")
    result = compare_fingerprints(base, fingerprint({"w": whole.flip(0)}, of="value"))
    (mismatch,) = result.mismatches
    assert mismatch.statistic == "proj"  # a permutation keeps every norm: the projections catch it
    assert mismatch.rel_error is not None and mismatch.rel_error > 0.5  # ~1.4: ||g - flip(g)|| / ||g||
    assert re.fullmatch(
        r"gradient 'w' changed by about [0-9.]+% of its baseline L2 norm "
        r"\(RMS of 8 random projections; rtol 2\.5% for bfloat16\)",
        mismatch.message,
    )


def test_detection_power_of_the_projections_in_bf16() -> None:
    """Random (norm-preserving) changes: 1% always passes, 5% (twice the bf16 rtol) is caught ~98% of the time
    per parameter (the RMS of 8 projections estimates the relative change with a chi(8) spread)."""
    gen = torch.Generator().manual_seed(11)
    g = torch.randn(64, 64, generator=gen).bfloat16()
    base = fingerprint({"w": g}, of="value")

    def caught(delta: float, n: int = 100) -> int:
        count = 0
        for _ in range(n):
            d = torch.randn(g.shape, generator=gen)
            changed = (g.float() + d * (delta * g.float().norm() / d.norm())).bfloat16()
            count += not compare_fingerprints(base, fingerprint({"w": changed}, of="value")).ok
        return count

    assert caught(0.01) == 0
    assert caught(0.05) >= 95


def test_a_permutation_keeps_norms_but_is_caught() -> None:
    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    permuted = g.flip(0)
    base = fingerprint({"w": g}, of="value")
    current = fingerprint({"w": permuted}, of="value")
    a, b = base.params["w"].grad, current.params["w"].grad
    assert a is not None and b is not None
    assert (a.l2, a.l1, a.max_abs) == pytest.approx((b.l2, b.l1, b.max_abs), rel=1e-12)
    result = compare_fingerprints(base, current)
    assert not result.ok and result.mismatches[0].statistic == "proj"


def test_projections_are_compared_relative_to_the_norm() -> None:
    def fp(proj: tuple[float, ...], l2: float = 1.0) -> Fingerprint:
        stats = GradStats(l2=l2, l1=2.0, sum=0.5, max_abs=0.5, proj=proj)
        return Fingerprint(params={"w": ParamFingerprint((4,), "float32", stats)}, method="m")

    # a near-zero projection that doubles is noise relative to a unit-norm gradient
    assert compare_fingerprints(fp((1e-9, 0.7)), fp((2e-9, 0.7))).ok
    result = compare_fingerprints(fp((1e-9, 0.7)), fp((1e-9, 0.6)))
    (mismatch,) = result.mismatches
    assert mismatch.statistic == "proj" and mismatch.rel_error == pytest.approx(math.sqrt(0.01 / 2))
    assert mismatch.message == (
        "gradient 'w' changed by about 7.07% of its baseline L2 norm "
        "(RMS of 2 random projections; rtol 0.01% for float32)"
    )


def test_shape_and_dtype_changes_are_their_own_failures() -> None:
    g = torch.randn(4, 6)
    base = fingerprint({"w": g}, of="value")
    reshaped = compare_fingerprints(base, fingerprint({"w": g.reshape(6, 4)}, of="value"))
    (mismatch,) = reshaped.mismatches
    assert mismatch.statistic == "shape"
    assert mismatch.message == "gradient 'w': shape changed from [4, 6] to [6, 4]"
    retyped = compare_fingerprints(base, fingerprint({"w": g.double()}, of="value"))
    (mismatch,) = retyped.mismatches
    assert mismatch.statistic == "dtype"
    assert mismatch.message == "gradient 'w': dtype changed from float32 to float64"


def test_none_gradient_changes() -> None:
    with_grad = fingerprint({"w": torch.ones(3)}, of="value")
    none = Fingerprint(params={"w": ParamFingerprint((3,), "float32", None)}, method=with_grad.method)
    assert compare_fingerprints(none, none).ok
    (gone,) = compare_fingerprints(with_grad, none).mismatches
    assert (gone.statistic, gone.message) == ("grad", "gradient 'w' is None (baseline has a gradient)")
    (came,) = compare_fingerprints(none, with_grad).mismatches
    assert (came.statistic, came.message) == ("grad", "gradient 'w' is present (baseline: None)")


def test_added_and_missing_parameters() -> None:
    base = fingerprint({"a": torch.ones(2), "b": torch.ones(2)}, of="value")
    current = fingerprint({"a": torch.ones(2), "c": torch.ones(2)}, of="value")
    result = compare_fingerprints(base, current)
    assert [(m.param, m.statistic) for m in result.mismatches] == [("b", "param"), ("c", "param")]
    assert result.details == (
        "gradient 'b': parameter missing (in baseline)",
        "gradient 'c': new parameter (not in baseline)",
    )
    assert result.messages == (
        "gradients changed in 2 of 3 parameters; worst: gradient 'b' missing, gradient 'c' new (not in baseline)",
    )


def test_zero_gradient_and_atol() -> None:
    zero = fingerprint({"w": torch.zeros(5)}, of="value")
    assert compare_fingerprints(zero, zero).ok
    tiny = fingerprint({"w": torch.full((5,), 1e-30)}, of="value")
    assert not compare_fingerprints(zero, tiny).ok
    assert compare_fingerprints(zero, tiny, atol=1e-20).ok


def test_rtol_overrides() -> None:
    g = torch.randn(50, generator=torch.Generator().manual_seed(5))
    base = fingerprint({"w": g}, of="value")
    current = fingerprint({"w": g * 1.01}, of="value")
    assert not compare_fingerprints(base, current).ok
    assert compare_fingerprints(base, current, rtol=0.02).ok
    assert compare_fingerprints(base, current, rtol={"float32": 0.02}).ok
    assert not compare_fingerprints(base, current, rtol={"bfloat16": 0.02}).ok
    assert GC.rtol_for("float32") == 1e-4 and GC.rtol_for("float8_e4m3fn") == 0.25
    assert GC.rtol_for("int8") == GC.FALLBACK_RTOL and GC.rtol_for(None) == GC.FALLBACK_RTOL
    for bad in (-1.0, math.nan, {"float32": -1.0}):
        with pytest.raises(ValueError, match="rtol"):
            compare_fingerprints(base, current, rtol=bad)
    with pytest.raises(ValueError, match="atol"):
        compare_fingerprints(base, current, atol=-1.0)


def test_other_projection_method_skips_projections_with_a_note() -> None:
    g = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    base = fingerprint({"w": g}, of="value")
    other = Fingerprint(
        params={
            name: ParamFingerprint(p.shape, p.dtype, None if p.grad is None else _with_proj(p.grad, 123.0))
            for name, p in base.params.items()
        },
        method="torch-randn-f32/8/000000000000",
    )
    result = compare_fingerprints(base, other)
    assert result.ok and len(result.notes) == 1 and "projections not compared" in result.notes[0]
    scaled = Fingerprint(
        params={"w": ParamFingerprint((8, 8), "float32", _with_proj(_scaled(base.params["w"].grad, 2.0), 1.0))},
        method="other",
    )
    assert not compare_fingerprints(base, scaled).ok  # norms still compared


def _with_proj(stats: GradStats, value: float) -> GradStats:
    return GradStats(stats.l2, stats.l1, stats.sum, stats.max_abs, (value,) * len(stats.proj))


def _scaled(stats: GradStats | None, k: float) -> GradStats:
    assert stats is not None
    return GradStats(stats.l2 * k, stats.l1 * k, stats.sum * k, stats.max_abs * k, stats.proj)
