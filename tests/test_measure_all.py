"""--gpumem-all measures every test; --gpumem-max-memory is the limit of tests that set none."""

from __future__ import annotations

import pytest
from builders import Reported

SUITE = """
import pytest, torch

def test_plain():
    torch.ones(1000)  # 4,000 B

@pytest.mark.max_memory("1 MiB")
def test_own_limit():
    torch.ones(1000)

@pytest.mark.max_memory(tolerance=10)
def test_tolerance_only():
    torch.ones(1000)

@pytest.mark.max_memory(made="1 MiB")
def test_phase_limit(gpumem):
    with gpumem.phase("made"):
        torch.ones(1000)
"""


def _statuses(reported: Reported) -> dict[str, tuple[str, int]]:
    return {name: (t["status"], t["peak_bytes"]) for name, t in reported().items()}


@pytest.mark.parametrize("how", ["option", "ini"])
def test_every_test_is_measured_and_held_to_the_default_limit(
    tracker: pytest.Pytester, how: str, reported: Reported
) -> None:
    import xml.etree.ElementTree as ET

    tracker.makepyfile(SUITE)
    if how == "ini":
        tracker.makeini("[pytest]\ngpumem_backend = tracker\ngpumem_all = true\ngpumem_max_memory = 3999\n")
    args = ["--gpumem-all", "--gpumem-max-memory=3999"] if how == "option" else []
    result = tracker.runpytest(*args, "--gpumem-json=out.json", "--junitxml=junit.xml", "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*call peak 4.0 kB (4,000 B) exceeds max_memory 3999 (--gpumem-max-memory) "
            "(see what made it with --gpumem-explain)",
            "also: see what made it with --gpumem-explain or max_memory(explain=True)",
            "gpumem: 4 measured: 2 over budget, 2 ok",
        ]
    )
    assert _statuses(reported) == {
        "test_plain": ("OVER BUDGET", 4000),
        "test_own_limit": ("ok", 4000),  # its own limit wins
        "test_tolerance_only": ("OVER BUDGET", 4000),  # a tolerance is not a limit
        "test_phase_limit": ("ok", 4000),  # a phase limit is
    }
    cases = {case.get("name"): case for case in ET.parse(tracker.path / "junit.xml").iter("testcase")}
    properties = {p.get("name"): p.get("value", "") for p in cases["test_phase_limit"].iter("property")}
    assert properties == {"gpumem_status": "ok", "gpumem_peak_bytes": "4000", "gpumem_peak_bytes[made]": "4000"}


def test_unmarked_tests_stay_unmeasured_without_it(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(SUITE)
    tracker.runpytest("--gpumem-json=out.json").assert_outcomes(passed=4)
    assert "test_plain" not in _statuses(reported)


def test_a_bad_default_limit_is_a_usage_error(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(SUITE)
    result = tracker.runpytest("--gpumem-max-memory=3ab")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --gpumem-max-memory: invalid size '3ab': *unit*"])
    tracker.makeini("[pytest]\ngpumem_max_memory = lots\n")
    result = tracker.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option gpumem_max_memory: invalid size 'lots': *"])


def test_counts_line_orders_the_worst_first() -> None:
    from pytest_gpumem.report.terminal import counts_line
    from pytest_gpumem.results import Status, TestResult

    statuses = [Status(s) for s in ("ok", "NEW", "REGRESSED", "error", "ok", "xfailed")]
    results = [TestResult.of(f"t{i}", "tracker", "cpu", None, status=s) for i, s in enumerate(statuses)]
    assert counts_line(results) == "6 measured: 1 regressed, 1 unmeasurable or failed, 1 new, 2 ok, 1 xfailed"
    assert counts_line([]) == "no test measured"


def test_counts_line_is_the_same_whichever_result_came_first() -> None:
    """Under xdist results arrive in any order; xfailed and XPASS have no word of their own in the line."""
    from pytest_gpumem.report.terminal import counts_line
    from pytest_gpumem.results import Status, TestResult

    statuses = [Status(s) for s in ("XPASS", "xfailed", "ok")]
    results = [TestResult.of(f"t{i}", "tracker", "cpu", None, status=s) for i, s in enumerate(statuses)]
    assert counts_line(results) == counts_line(results[::-1]) == "3 measured: 1 ok, 1 xfailed, 1 XPASS"


SMALL_AND_LARGE = """
import pytest, torch

def test_within_slack():
    torch.ones(1000)  # 4,000 B: the slack alone allows that much over any baseline

def test_over_slack():
    torch.ones(1001)  # 4,004 B

@pytest.mark.max_memory(tolerance=10)
def test_marked_within_slack():
    torch.ones(1000)
"""


def test_an_unmarked_test_within_the_slack_needs_no_baseline_and_records_none(tracker: pytest.Pytester) -> None:
    import json

    tracker.makepyfile(SMALL_AND_LARGE)
    flags = ["--gpumem-all", "--gpumem-slack=4000", "-p", "no:randomly"]
    strict = tracker.runpytest(*flags, "--gpumem-strict")
    strict.assert_outcomes(passed=1, failed=2)
    strict.stdout.fnmatch_lines(
        [
            "FAILED *::test_over_slack",
            "FAILED *::test_marked_within_slack",  # marked: compared whatever its size
        ]
    )
    tracker.runpytest(*flags, "--gpumem-update").assert_outcomes(passed=3)
    stored = json.loads((tracker.path / "gpumem-baselines.json").read_text())
    assert sorted(name.split("::")[1] for name in stored["entries"]) == ["test_marked_within_slack", "test_over_slack"]


def test_within_slack_holds_every_peak_to_the_slack() -> None:
    from builders import phase_result

    from pytest_gpumem.run.judge import within_slack

    call = phase_result("call", 4000)
    assert within_slack(call, {}, 4000)
    assert not within_slack(call, {}, 3999)
    assert not within_slack(phase_result("call", 10), {"made": phase_result("made", 4001)}, 4000)
    assert not within_slack(phase_result("call", 0), {}, 4000)  # counted among the tests that allocate nothing
