"""Gradients that used to slip through: a dict of gradient tensors, parameters on the meta device, gradients
whose squares overflow, many changed parameters at once."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from builders import assert_one_line_failure, run, stored_gradients, strict_json

from pytest_gpumem.gradients.fingerprint import fingerprint
from pytest_gpumem.gradients.mismatches import compare_fingerprints
from pytest_gpumem.results.codec import encode

# ------------------------------------------------------------------------------- gradients as a dict

AUTOGRAD = """
import torch

FACTOR = {factor}
DTYPE = torch.{dtype}
VALUE = {value}

def test_grads(gpumem):
    w = torch.full((64,), VALUE, dtype=DTYPE, requires_grad=True)
    scale = torch.linspace(0.5, 1.5, 64, dtype=DTYPE) * FACTOR
    (g,) = torch.autograd.grad((w * scale).sum(), [w])  # g = scale: a plain tensor, no .grad
    gpumem.check_gradients({{"w": g}})
"""


def autograd_suite(pytester: pytest.Pytester, factor: float, dtype: str = "float32", value: float = 1.0) -> None:
    pytester.makepyfile(test_suite=AUTOGRAD.format(factor=factor, dtype=dtype, value=value))


def test_a_dict_of_gradient_tensors_is_fingerprinted() -> None:
    g = torch.linspace(0.5, 1.5, 64)
    fp = fingerprint({"w": g})
    stats = fp.params["w"].grad
    assert stats is not None and stats.l2 == pytest.approx(g.double().norm().item(), rel=1e-12)
    param = torch.nn.Parameter(torch.ones(3))
    assert fingerprint({"p": param}).params["p"].grad is None  # a parameter stands for its .grad
    assert not compare_fingerprints(fp, fingerprint({"w": g * 2})).ok


def test_a_dict_of_gradients_is_recorded_and_a_change_fails(tracker: pytest.Pytester) -> None:
    autograd_suite(tracker, factor=1.0)
    run(tracker, "--gpumem-update").assert_outcomes(passed=1)
    assert stored_gradients(tracker, "test_grads")["w"]["grad"] is not None
    run(tracker).assert_outcomes(passed=1)
    autograd_suite(tracker, factor=2.0)
    result = run(tracker)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["gradients changed in 1 of 1 parameters: gradient 'w' L2 norm +100.0%"])


# ------------------------------------------------------------------------------------------- meta


def test_meta_parameters_are_refused_in_one_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_suite="""
        import torch

        def test_after_backward(gpumem):
            model = torch.nn.Linear(4, 2, device="meta")
            model(torch.ones(3, 4, device="meta")).sum().backward()
            gpumem.check_gradients(model)

        def test_without_backward(gpumem):
            gpumem.check_gradients(torch.nn.Linear(4, 2, device="meta"))

        def test_meta_values(gpumem):
            gpumem.check_gradients({"g": torch.ones(4, device="meta")})
        """
    )
    result = run(tracker)
    result.assert_outcomes(failed=3)
    meta = "is on the meta device, which holds shapes but no values: there is nothing to fingerprint*"
    result.stdout.fnmatch_lines(
        [
            f"*::test_after_backward: gpumem.check_gradients(): fingerprint(): 'weight' {meta}",
            f"*::test_without_backward: gpumem.check_gradients(): fingerprint(): 'weight' {meta}",
            f"*::test_meta_values: gpumem.check_gradients(): fingerprint(): 'g' {meta}",
        ]
    )
    assert_one_line_failure(result)


def test_meta_raises_value_error() -> None:
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        fingerprint(torch.nn.Linear(2, 2, device="meta"))


# -------------------------------------------------------------------------------------- overflow


@pytest.mark.parametrize("value", [1e200, 1e-200, 1e300])
def test_norms_of_huge_and_tiny_float64_values_are_finite(value: float) -> None:
    g = torch.full((1000,), value, dtype=torch.float64)
    stats = fingerprint({"g": g}).params["g"].grad
    assert stats is not None
    assert stats.l2 == pytest.approx(value * math.sqrt(1000), rel=1e-12)
    assert stats.max_abs == value
    strict_json(json.dumps(encode(fingerprint({"g": g})), allow_nan=False))


@pytest.mark.parametrize(("dtype", "value"), [("float32", 1e30), ("float64", 1e200)])
def test_huge_gradients_are_stored_as_json_numbers_and_compared(
    tracker: pytest.Pytester, dtype: str, value: float
) -> None:
    autograd_suite(tracker, factor=value, dtype=dtype)
    run(tracker, "--gpumem-update").assert_outcomes(passed=1)
    stats = stored_gradients(tracker, "test_grads")["w"]["grad"]
    assert all(isinstance(stats[k], float) and math.isfinite(stats[k]) for k in ("l2", "l1", "sum", "max_abs"))
    run(tracker).assert_outcomes(passed=1)
    autograd_suite(tracker, factor=value * 2, dtype=dtype)
    result = run(tracker, "--gpumem-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["gradients changed in 1 of 1 parameters: gradient 'w' L2 norm +100.0%"])
    strict_json((tracker.path / "out.json").read_text())


# ------------------------------------------------------------------------------ many parameters changed

MANY = """
import torch

FACTOR = {factor}

def test_deep(gpumem):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(14)])  # 28 parameters
    (model(torch.randn(4, 8)).sum() * FACTOR).backward()
    gpumem.check_gradients(model)
"""


def test_many_changed_parameters_make_a_short_consistent_failure_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_suite=MANY.format(factor=1.0))
    run(tracker, "--gpumem-update").assert_outcomes(passed=1)
    tracker.makepyfile(test_suite=MANY.format(factor=2.0))
    result = run(tracker)
    result.assert_outcomes(failed=1)
    first = next(line for line in result.outlines if line.startswith("gradients changed in"))
    assert first.startswith(  # equal figures: in the baseline's (sorted) order
        "gradients changed in 28 of 28 parameters; worst: gradient '0.bias' L2 norm +100.0%, gradient '0.weight' "
    )
    assert first.endswith("; 25 more in the report section")
    assert len(first) < 300
    assert re.findall(r"[+-][0-9.]+%", first) == ["+100.0%"] * 3  # one figure for one uniform change
    section = result.outlines[result.outlines.index(first) + 1 :]
    details = [line for line in section if re.match(r"gradient '[0-9]+\.(weight|bias)': ", line)]
    assert len(details) == 28
    assert all(" L2 norm +100.0% (baseline " in line for line in details)


def test_summary_names_the_worst_first() -> None:
    names = [f"p{i}" for i in range(10)]
    base = fingerprint({n: torch.ones(4) for n in names})
    factors = {n: 1.0 + i / 10 for i, n in enumerate(names)}
    result = compare_fingerprints(base, fingerprint({n: torch.ones(4) * factors[n] for n in names}))
    (line,) = result.messages
    assert line == (
        "gradients changed in 9 of 10 parameters; worst: gradient 'p9' L2 norm +90.0%, "
        "gradient 'p8' L2 norm +80.0%, gradient 'p7' L2 norm +70.0%; 6 more in the report section"
    )
    assert len(result.details) == 9 and result.notes == result.details
