"""Gradient fingerprints (gradients.fingerprint): what they keep of each gradient, and their stored form
(results.gradients). Their comparison is in test_changed_gradients_are_caught.py."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from builders import model_with_grads
from torch import nn

from pytest_gpumem.gradients import fingerprint as G
from pytest_gpumem.gradients.fingerprint import fingerprint
from pytest_gpumem.gradients.mismatches import compare_fingerprints
from pytest_gpumem.results.codec import STORED, decode, encode
from pytest_gpumem.results.gradients import Fingerprint, GradStats, ParamFingerprint


def roundtrip(fp: Fingerprint) -> Fingerprint:
    return read(json.loads(json.dumps(encode(fp), allow_nan=False)))


def read(obj: object) -> Fingerprint:
    """A baseline entry's gradients, as the baseline file reads them."""
    return decode(Fingerprint, obj, "gradients", STORED)


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
    text = json.dumps(encode(fp), allow_nan=False)
    assert '"nan"' in text and '"inf"' in text
    back = roundtrip(fp)
    assert compare_fingerprints(fp, back).ok  # same non-finite values: unchanged
    finite = fingerprint({"nan": torch.tensor([1.0, 3.0, 2.0]), "inf": h, "ok": torch.ones(3)}, of="value")
    result = compare_fingerprints(fp, finite)
    assert [m.param for m in result.mismatches] == ["nan"]
    assert "nan" in result.messages[0]


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
        read(obj)
    assert message in str(info.value)


def test_valid_json_loads() -> None:
    fp = read(GOOD)
    assert fp.params["w"] == ParamFingerprint((2,), "float32", GradStats(1.0, 1.5, 0.5, 1.0, (0.1, -0.2)))
    assert read(encode(fp)) == fp


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
