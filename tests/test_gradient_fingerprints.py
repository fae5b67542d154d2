"""Unit tests of gradient fingerprints (gradients.fingerprint), their comparison (gradients.compare) and
their stored form (results.gradients)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch
from torch import nn

from pytest_gpumem.gradients import compare as GC
from pytest_gpumem.gradients import fingerprint as G
from pytest_gpumem.gradients.compare import compare_fingerprints
from pytest_gpumem.gradients.fingerprint import fingerprint
from pytest_gpumem.results.gradients import Fingerprint, GradStats, ParamFingerprint


def model_with_grads(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    model(x).square().mean().backward()
    return model


def roundtrip(fp: Fingerprint) -> Fingerprint:
    return Fingerprint.from_json(json.loads(json.dumps(fp.to_json(), allow_nan=False)))


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


# --------------------------------------------------------------------------------------- fingerprints


def test_fingerprint_of_a_module() -> None:
    model = model_with_grads()
    fp = fingerprint(model)
    assert list(fp.params) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    weight = fp.params["0.weight"]
    assert weight.shape == (32, 16) and weight.dtype == "float32"
    assert weight.grad is not None and len(weight.grad.proj) == G.NUM_PROJECTIONS
    assert fp.method.startswith(f"torch-randn-f32/{G.NUM_PROJECTIONS}/")


def test_a_gradients_statistics_are_its_norms_sum_and_largest_value() -> None:
    layer = nn.Linear(2, 2)
    layer.weight.grad, layer.bias.grad = torch.tensor([[3.0, -4.0], [0.0, 0.0]]), torch.tensor([-0.75, 1.0])
    weight, bias = (fingerprint(layer).params[name].grad for name in ("weight", "bias"))
    assert weight is not None and bias is not None
    assert (weight.l2, weight.l1, weight.sum, weight.max_abs) == (5.0, 7.0, -1.0, 4.0)  # sqrt(9 + 16), 3 + 4, 3 - 4
    assert (bias.l2, bias.l1, bias.sum, bias.max_abs) == (1.25, 1.75, 0.25, 1.0)  # sqrt(0.5625 + 1), 0.75 + 1


def test_identical_gradients_pass_and_fingerprints_are_deterministic() -> None:
    a = fingerprint(model_with_grads())
    b = fingerprint(model_with_grads())
    assert a == b
    result = compare_fingerprints(a, b)
    assert result.ok and result.mismatches == () and result.notes == ()


def test_json_round_trip_is_exact() -> None:
    fp = fingerprint(model_with_grads())
    back = roundtrip(fp)
    assert back == fp
    assert compare_fingerprints(fp, back).ok


def test_fingerprint_does_not_touch_gradients_or_build_a_graph() -> None:
    model = model_with_grads()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    fingerprint(model)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_projections_depend_on_name_and_shape_not_on_call_order() -> None:
    g = torch.randn(10, 10)
    one = fingerprint({"a": g, "b": g}, of="value")
    two = fingerprint({"b": g, "a": g}, of="value")
    assert one.params["a"] == two.params["a"]
    assert one.params["a"].grad != one.params["b"].grad  # other name, other projection vectors
    flat = fingerprint({"a": g.reshape(100)}, of="value").params["a"].grad
    assert flat is not None and one.params["a"].grad is not None
    assert flat.proj != one.params["a"].grad.proj


def test_chunked_large_and_non_contiguous_tensors() -> None:
    """Half a million values (2 MB, read in several chunks), transposed: the same as contiguous."""
    big = torch.randn(5, 100_003)
    fp = fingerprint({"w": big.T}, of="value").params["w"]
    same = fingerprint({"w": big.T.contiguous()}, of="value").params["w"]
    assert fp == same and fp.shape == (100_003, 5)
    assert fp.grad is not None
    assert fp.grad.l2 == pytest.approx(big.double().norm().item(), rel=1e-12)


def test_sparse_and_complex_gradients() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 3, 3])).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    sparse_fp = fingerprint(emb).params["weight"]
    dense_fp = fingerprint({"weight": emb.weight.grad.to_dense()}, of="value").params["weight"]
    assert sparse_fp == dense_fp
    z = torch.randn(5, dtype=torch.complex64)
    cfp = fingerprint({"z": z}, of="value").params["z"]
    assert cfp.dtype == "complex64" and cfp.shape == (5,)
    assert cfp.grad is not None
    assert cfp.grad.l2 == pytest.approx(torch.linalg.vector_norm(z.to(torch.complex128)).item(), rel=1e-12)


def test_none_gradients_are_recorded() -> None:
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    model(torch.randn(4, 3)).sum().backward()
    fp = fingerprint(model)
    assert fp.params["bias"] == ParamFingerprint((2,), "float32", None)
    assert fp.params["weight"].grad is not None
    values = fingerprint({"used": torch.ones(2), "unused": None}, of="value")
    assert values.params["unused"] == ParamFingerprint(None, None, None)
    assert roundtrip(values) == values


def test_mapping_of_parameters_reads_their_grad() -> None:
    model = model_with_grads()
    assert fingerprint(dict(model.named_parameters())) == fingerprint(model)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module or a mapping"):
        fingerprint([torch.ones(1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a tensor"):
        fingerprint({"a": 1.0}, of="value")  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="needs the parameter tensor"):
        fingerprint({"a": None}, of="grad")
    with pytest.raises(ValueError, match="of='value' needs a mapping"):
        fingerprint(nn.Linear(1, 1), of="value")
    with pytest.raises(ValueError, match="must be 'auto', 'grad' or 'value'"):
        fingerprint({}, of="values")  # type: ignore[arg-type]


def test_non_finite_gradients_survive_json() -> None:
    g = torch.tensor([1.0, float("nan"), 2.0])
    h = torch.tensor([1.0, float("inf"), 2.0])
    fp = fingerprint({"nan": g, "inf": h, "ok": torch.ones(3)}, of="value")
    nan_stats = fp.params["nan"].grad
    inf_stats = fp.params["inf"].grad
    assert nan_stats is not None and math.isnan(nan_stats.l2) and math.isnan(nan_stats.max_abs)
    assert inf_stats is not None and inf_stats.max_abs == math.inf and inf_stats.l2 == math.inf
    text = json.dumps(fp.to_json(), allow_nan=False)
    assert '"nan"' in text and '"inf"' in text
    back = roundtrip(fp)
    assert compare_fingerprints(fp, back).ok  # same non-finite values: unchanged
    finite = fingerprint({"nan": torch.tensor([1.0, 3.0, 2.0]), "inf": h, "ok": torch.ones(3)}, of="value")
    result = compare_fingerprints(fp, finite)
    assert [m.param for m in result.mismatches] == ["nan"]
    assert "nan" in result.messages[0]


# ----------------------------------------------------------------------------------------- comparing


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
        return Fingerprint({"w": ParamFingerprint((4,), "float32", stats)}, method="m")

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
    none = Fingerprint({"w": ParamFingerprint((3,), "float32", None)}, method=with_grad.method)
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
        {
            name: ParamFingerprint(p.shape, p.dtype, None if p.grad is None else _with_proj(p.grad, 123.0))
            for name, p in base.params.items()
        },
        method="torch-randn-f32/8/000000000000",
    )
    result = compare_fingerprints(base, other)
    assert result.ok and len(result.notes) == 1 and "projections not compared" in result.notes[0]
    scaled = Fingerprint(
        {"w": ParamFingerprint((8, 8), "float32", _with_proj(_scaled(base.params["w"].grad, 2.0), 1.0))},
        method="other",
    )
    assert not compare_fingerprints(base, scaled).ok  # norms still compared


def _with_proj(stats: GradStats, value: float) -> GradStats:
    return GradStats(stats.l2, stats.l1, stats.sum, stats.max_abs, (value,) * len(stats.proj))


def _scaled(stats: GradStats | None, k: float) -> GradStats:
    assert stats is not None
    return GradStats(stats.l2 * k, stats.l1 * k, stats.sum * k, stats.max_abs * k, stats.proj)


# ------------------------------------------------------------------------------------- JSON validation

GOOD: dict[str, Any] = {
    "method": "m",
    "params": {
        "w": {
            "shape": [2],
            "dtype": "float32",
            "grad": {"l2": 1, "l1": 1.5, "sum": 0.5, "max_abs": 1.0, "proj": [0.1, -0.2]},
        }
    },
}


def _bad(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(json.dumps(GOOD))
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


W = ("params", "w")


@pytest.mark.parametrize(
    "obj, message",
    [
        ([], "gradients: expected an object"),
        (_bad(("method",), ""), "gradients.method: expected a non-empty string"),
        (_bad(("method",), KeyError), "gradients: missing key 'method'"),
        (_bad(("extra",), 1), "gradients: unknown key 'extra'"),
        (_bad(("params",), []), "gradients.params: expected an object"),
        (_bad((*W, "shape"), [2.0]), 'gradients.params["w"].shape: expected a list of integers'),
        (_bad((*W, "shape"), [True]), 'gradients.params["w"].shape: expected a list of integers'),
        (_bad((*W, "shape"), "2"), 'gradients.params["w"].shape: expected a list of integers'),
        (_bad((*W, "dtype"), 32), 'gradients.params["w"].dtype: expected a dtype name'),
        (_bad((*W, "grad", "l2"), None), 'gradients.params["w"].grad.l2: expected a number'),
        (_bad((*W, "grad", "l2"), True), 'gradients.params["w"].grad.l2: expected a number'),
        (_bad((*W, "grad", "l2"), "NaN"), 'gradients.params["w"].grad.l2: expected a number'),
        (_bad((*W, "grad", "proj"), []), 'gradients.params["w"].grad.proj: expected a non-empty list'),
        (_bad((*W, "grad", "proj"), [1, "x"]), 'gradients.params["w"].grad.proj[1]: expected a number'),
        (_bad((*W, "grad", "extra"), 1), "unknown key 'extra'"),
        (_bad((*W, "grad", "sum"), KeyError), "missing key 'sum'"),
    ],
)
def test_invalid_json_is_refused(obj: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        Fingerprint.from_json(obj)
    assert message in str(info.value)


def test_valid_json_loads() -> None:
    fp = Fingerprint.from_json(GOOD)
    assert fp.params["w"] == ParamFingerprint((2,), "float32", GradStats(1.0, 1.5, 0.5, 1.0, (0.1, -0.2)))
    assert Fingerprint.from_json(fp.to_json()) == fp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gradients_match_cpu_and_allocate_nothing_on_the_device() -> None:
    model = model_with_grads()
    expected = fingerprint(model)
    model.cuda()
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    on_device = fingerprint(model)
    assert torch.cuda.max_memory_allocated() == before
    assert compare_fingerprints(expected, on_device).ok
