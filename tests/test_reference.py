"""The shipped reference suite as a user runs it, on a fast subset, and its option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

RunReference = Callable[..., dict[str, Any]]  # the conftest fixture run_reference
# the runs at these scales that docs/guides/reference-strategies.md shows: its examples read the same runs
GUIDE_SELECTIONS = {
    "2": "[plain] or amp or optimizer_in_backward",
    "0.25": "[plain] or amp or optimizer_in_backward or _ce",
}


def test_reference_report_subset(tracker: pytest.Pytester) -> None:
    result = tracker.runpytest(
        "--pyargs", "reference_losses", "-k", "naive_sum or dot or einsum", "--gpumem-report", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "*= reference_losses: peak bytes per strategy =*",
            "workload product (tracker; naive = naive_sum):",
            "strategy*forward*backward*step*total*total/naive*total/minimum*minimum",
            "naive_sum*4.0 MiB*8.0 MiB*-*8.0 MiB*1.00*1.00*8.0 MiB",
            "dot*4 B*8.0 MiB*-*8.0 MiB*1.00*1.00*8.0 MiB",
            "*= gpumem report =*",
        ]
    )
    result.stdout.no_fnmatch_line("reserved: *")


def test_reference_report_compares_reserved_memory_under_the_allocators_model(tracker: pytest.Pytester) -> None:
    result = tracker.runpytest(
        "--pyargs", "reference_losses", "-k", "naive_sum or dot", "--gpumem-report", "--gpumem-round=cuda",
        "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "reserved: the total's reserved memory (the allocator's model) against the naive strategy's",
            "strategy*total/naive*total/minimum*minimum*reserved",
            "naive_sum*8.0 MiB*1.00*1.00*8.0 MiB*1.00x",
            "dot*8.0 MiB*1.00*1.00*8.0 MiB*1.00x",  # the same 8 MiB gradient in the same segments
        ]
    )


@pytest.mark.slow  # a run of the reference suite, shared
@pytest.mark.parametrize(
    ("rounding", "rules"),
    [
        ("auto", "amp: autocast under CPU's rules"),  # none on cpu tensors
        ("cuda", "amp: autocast under CUDA's rules (torch *'s CUDA op lists, on cpu tensors)"),
    ],
)
def test_amp_runs_under_the_autocast_rules_of_what_is_measured(
    tracker: pytest.Pytester, run_reference: RunReference, rounding: str, rules: str
) -> None:
    """At scale 0.25: the rules do not depend on the batch, and amp's half-precision matmuls are slow on
    CPUs without a bf16 BLAS. The guide's run at that scale is the `auto` case (test_bounds_follow_the_scale
    reads it too)."""
    if rounding == "auto":
        ran = run_reference(tracker, "--gpumem-scale=0.25", "--gpumem-report", "-k", GUIDE_SELECTIONS["0.25"])
    else:
        ran = run_reference(tracker, "--gpumem-scale=0.25", "--gpumem-round=cuda", "--gpumem-report", "-k", "amp")
    assert "test_training_strategy[amp]" in ran["passed"]
    pytest.LineMatcher(ran["lines"]).fnmatch_lines([rules])


def test_reference_report_only_when_asked(tracker: pytest.Pytester) -> None:
    result = tracker.runpytest("--pyargs", "reference_losses", "-k", "naive_sum", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*reference_losses: peak bytes*")


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf"])
def test_bad_scale_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    result = pytester.runpytest("--pyargs", "reference_losses", f"--gpumem-scale={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*argument --gpumem-scale: invalid scale '{value}' (a positive number*"])


def test_bad_scale_in_ini_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_scale = big\n")
    result = pytester.runpytest("--pyargs", "reference_losses", "-k", "naive_sum")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option gpumem_scale: invalid scale 'big'*"])


def test_scale_changes_the_workload(tracker: pytest.Pytester) -> None:
    result = tracker.runpytest(
        "--pyargs", "reference_losses", "-k", "naive_sum", "--gpumem-scale=0.5", "--gpumem-report"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["naive_sum*2.0 MiB*4.0 MiB*-*4.0 MiB*"])


# Strategies whose hand-derived bounds depend on which of activations (scale with the batch) and
# parameter gradients (do not) dominate: at scale 1 the gradients do, at 2 (Net) and 0.25 (full_ce)
# the other term does.
SCALE_CASES = {
    "2": ["training_strategy[plain]", "training_strategy[checkpoint_layer]", "training_strategy[amp]",
          "training_strategy[clip_grad]"],
    "0.25": ["loss_strategy[full_ce]", "training_strategy[amp]", "training_strategy[optimizer_in_backward]"],
}  # fmt: skip


def _only_passed(outcomes: dict[str, int]) -> dict[str, int]:
    """The counts that `assert_outcomes(passed=N)` compares."""
    return {name: outcomes.get(name, 0) for name in ("passed", "skipped", "failed", "errors", "xpassed", "xfailed")}


@pytest.mark.slow  # seven training strategies run for real
@pytest.mark.parametrize("scale", sorted(SCALE_CASES))
def test_bounds_follow_the_scale(tracker: pytest.Pytester, run_reference: RunReference, scale: str) -> None:
    guide = run_reference(tracker, f"--gpumem-scale={scale}", "--gpumem-report", "-k", GUIDE_SELECTIONS[scale])
    assert _only_passed(guide["outcomes"]) == _only_passed({"passed": len(guide["passed"])})
    others = [f"test_{name}" for name in SCALE_CASES[scale] if f"test_{name}" not in guide["passed"]]
    if others:
        selection = " or ".join(others)
        result = tracker.runpytest(
            "--pyargs", "reference_losses", f"--gpumem-scale={scale}", "-k", selection, "-p", "no:cacheprovider"
        )
        result.assert_outcomes(passed=len(others))
