"""An out-of-memory error as pytest judges it: an expected one (xfail) is left to xfail, and an unexpected
one names the phase it happened in, though a phase the test left by an exception came before."""

from __future__ import annotations

import pytest
from builders import Reported

SUITE = """
import pytest, torch

@pytest.mark.xfail(raises=torch.OutOfMemoryError, strict=True)
@pytest.mark.max_memory(capacity="1 MiB")
def test_expected_oom():
    torch.ones(1_000_000)

@pytest.mark.xfail(strict=True)
@pytest.mark.max_memory("1 MiB")
def test_expected_failure():
    assert False

@pytest.mark.max_memory(capacity="1 kB")
def test_caught_then_oom(gpumem):
    with pytest.raises(ValueError):
        with gpumem.phase("probe"):
            raise ValueError("handled")
    torch.ones(1000)
"""


def test_out_of_memory_is_judged_as_pytest_judges_the_test(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(SUITE)
    result = tracker.runpytest("--gpumem-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(xfailed=2, failed=1)
    tests = reported()
    assert tests["test_expected_oom"]["status"] == "xfailed"
    assert tests["test_expected_failure"]["status"] == "xfailed"
    result.stdout.fnmatch_lines(["out of memory in the call (tried to allocate 3.9 KiB) after a peak of 0 B*"])
    result.stdout.fnmatch_lines(["call: peak 0 B*"])  # the breakdown section of an out-of-memory test
