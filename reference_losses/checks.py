"""What the shipped suite does with one strategy: run it measured, then check outcome and bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reference_losses.fixtures import INFO_KEY, Case
from reference_losses.strategy import (
    FP32_RTOL,
    REDUCED_MARGIN,
    Expectation,
    NullMeter,
    Outcome,
    relative_errors,
    worst,
)

if TYPE_CHECKING:
    from pytest_gpumem import GpuMem

# The tracker counts exact bytes. Other backends (CUDA) may differ by allocator rounding, kernels'
# own scratch memory and different algorithms; these slacks are a guess until measured on a GPU.
EXACT_SLACK = (0.0, 0)
DEVICE_SLACK = (0.05, 1 << 20)


def run_measured(case: Case, gpumem: GpuMem) -> Outcome:
    """Phases forward/backward/step from one run; 'total' (the whole step) from a second run on a
    fresh copy, because a phase repeated (grad_accumulation) keeps only its maximum."""
    make_workspaces(gpumem.device)
    outcome = case.strategy.run(gpumem, case.workload.clone())
    fresh = case.workload.clone()
    with gpumem.phase("total"):
        case.strategy.run(NullMeter(), fresh)
    del fresh
    return outcome


def make_workspaces(device: Any) -> None:
    """cuBLAS keeps a workspace for each thread's handle (the test's and backward's) from its first matmul
    on: made here before the phases, as a training loop's first step makes them, so that each phase
    counts what its strategy holds (the call's peak keeps them)."""
    import torch

    a = torch.ones(2, 2, device=device, requires_grad=True)
    (a @ a).sum().backward()  # type: ignore[no-untyped-call]


def record(case: Case, gpumem: GpuMem, errors: dict[str, float] | None) -> None:
    """What the report shows; `errors` is None when values were not compared (the meta device)."""
    worst_error = None
    if errors is not None:
        key, error = worst(errors)
        worst_error = {"key": key, "relative": error}
    gpumem.info[INFO_KEY] = {
        "strategy": case.strategy.name,
        "workload": case.strategy.workload,
        "reference": case.strategy.reference,
        "minimum_bytes": case.strategy.minimum_bytes(case.workload),
        "worst_error": worst_error,
        "values_checked": errors is not None,
    }


def outcome_errors(case: Case, outcome: Outcome) -> dict[str, float]:
    """fp32 strategies: relative error against naive fp32 within FP32_RTOL. Reduced precision: error
    against the fp64 truth no worse than naive-in-that-dtype's error plus REDUCED_MARGIN[dtype]."""
    assert case.reference is not None, "no reference outcome to compare with (meta device)"
    if case.truth is None or case.naive_reduced is None or case.dtype is None:
        errors = relative_errors(outcome, case.reference)
        far = {k: e for k, e in errors.items() if not e <= FP32_RTOL}
        assert not far, f"{case.strategy.name} differs from {case.strategy.reference} beyond {FP32_RTOL}: {far}"
        return errors
    errors = relative_errors(outcome, case.truth)
    naive = relative_errors(case.naive_reduced, case.truth)
    margin = REDUCED_MARGIN[case.dtype]
    bad: dict[str, str] = {k: f"{e:.3g} > {naive[k]:.3g}" for k, e in errors.items() if not e <= naive[k] + margin}
    assert not bad, f"{case.strategy.name} error (vs fp64) above naive {case.dtype}'s + {margin}: {bad}"
    return errors


def measured(gpumem: GpuMem, expectation: Expectation) -> int:
    result = gpumem.result(expectation.phase)
    return result.net_bytes if expectation.net else result.requested_peak_bytes


def check_bytes(case: Case, gpumem: GpuMem) -> None:
    """The bounds count the strategy's tensors; where the tracker predicts a GPU, one op's kernel
    temporaries (a reduction's staging buffer) may sit on top of a peak: the largest is allowed above."""
    rel, extra = EXACT_SLACK if gpumem.backend.name == "tracker" else DEVICE_SLACK
    scratch = getattr(gpumem.backend, "largest_kernel_temporaries", 0)
    failures: list[str] = []
    for exp in case.strategy.expect(case.workload):
        got = measured(gpumem, exp)
        low, high = exp.low * (1 - rel) - extra, exp.high * (1 + rel) + extra + scratch
        if not low <= got <= high:
            what = "kept after" if exp.net else "peak of"
            failures.append(f"{what} {exp.phase}: {got} bytes, expected {exp.low}..{exp.high} ({exp.why})")
    assert not failures, f"{case.strategy.name}: " + "; ".join(failures)


def check(case: Case, gpumem: GpuMem) -> dict[str, Any]:
    """Run measured, compare the outcome with the naive reference (skipped where there is none: on the
    meta device tensors have no values), record the report's row, and check every byte bound."""
    outcome = run_measured(case, gpumem)
    errors = None if case.reference is None else outcome_errors(case, outcome)
    record(case, gpumem, errors)
    check_bytes(case, gpumem)
    return errors or {}
