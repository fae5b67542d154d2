"""A measured test reaches the report, the JSON and the baselines as pytest judged it: reruns, unittest
bodies, xfail, hypothesis examples, unusual `info`, and user errors shown without our frames (a crashed
xdist worker: tests/test_xdist.py)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from builders import Reported

FLAKY = """
import pytest, torch

attempts = []


@pytest.mark.max_memory(made="100 kB")
def test_flaky(gpumem):
    attempts.append(1)
    with gpumem.phase("made"):
        torch.ones(100_000 if len(attempts) == 1 else 1_000)  # 400,000 B the first time, 4,000 B after
"""


def test_each_rerun_attempt_is_measured_on_its_own(tracker: pytest.Pytester, reported: Reported) -> None:
    pytest.importorskip("pytest_rerunfailures")
    tracker.makepyfile(FLAKY)
    result = tracker.runpytest("--reruns=1", "--gpumem-update", "--gpumem-json=out.json", "-p", "no:randomly")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}
    test = reported()["test_flaky"]
    assert (test["status"], test["phases"]["made"]["peak_bytes"]) == ("NEW", 4_000)
    stored = (tracker.path / "gpumem-baselines.json").read_text(encoding="utf-8")
    assert "400000" not in stored
    assert "4000" in stored


OTHER_VERDICTS = """
import threading
import unittest
import pytest, torch


class Case(unittest.TestCase):
    @pytest.mark.max_memory("1 MiB")
    def test_body_fails(self):
        torch.ones(10)
        self.assertEqual(1, 2)


@pytest.mark.xfail(reason="known to be too big")
@pytest.mark.max_memory("1 kB")
def test_expected_to_fail(gpumem):
    torch.ones(1000)


@pytest.mark.max_memory("1 MiB")
def test_fine(gpumem):
    torch.ones(10)


def test_noted(gpumem):  # the tracker notes the thread; the run turns our warnings into errors
    threading.Thread(target=lambda: None, name="side").start()
"""


def test_status_and_records_follow_pytests_verdict(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(OTHER_VERDICTS)
    warnings_fail = ("-W", "error::pytest_gpumem.GpuMemWarning")
    result = tracker.runpytest("--gpumem-update", "--gpumem-json=out.json", "-p", "no:randomly", *warnings_fail)
    result.assert_outcomes(passed=1, failed=2, xfailed=1)
    tests = reported()
    assert tests["Case::test_body_fails"]["status"] == "error"
    assert tests["Case::test_body_fails"]["message"] == "AssertionError: 1 != 2"
    assert tests["test_expected_to_fail"]["status"] == "xfailed"
    assert tests["test_noted"]["status"] == "error"
    assert tests["test_noted"]["message"].startswith("pytest_gpumem.errors.GpuMemWarning: ")
    stored = json.loads((tracker.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    recorded = json.dumps(stored)
    assert "test_fine" in recorded
    assert "test_body_fails" not in recorded
    assert "test_expected_to_fail" not in recorded
    assert "test_noted" not in recorded


def test_info_must_be_a_dict_of_json_values_and_is_kept_readable_when_not(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(
        """
        import torch

        class Unshowable:
            def __repr__(self):
                raise RuntimeError("no")

        def test_list(gpumem):
            gpumem.info = [1, 2]

        def test_unshowable(gpumem):
            gpumem.info["x"] = Unshowable()

        def test_tensor(gpumem):
            gpumem.info["tensor"] = torch.ones(2)

        def test_nan(gpumem):
            gpumem.info["x"] = float("nan")

        def test_fine(gpumem):
            gpumem.info["shape"] = [2]
        """
    )
    result = tracker.runpytest("--gpumem-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=4)
    result.stdout.fnmatch_lines(
        [
            "*::test_list: gpumem.info must be a dict of JSON values *: it was set to a list, not a dict",
            "*::test_unshowable: gpumem.info must be a dict of JSON values *Unshowable is not JSON serializable",
            "*::test_tensor: gpumem.info must be a dict of JSON values (str, numbers, lists, dicts): "
            "*not JSON serializable",
            "*::test_nan: gpumem.info must be a dict of JSON values *",
        ]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    tests = reported()
    assert tests["test_list"]["info"] == {"unreadable": "[1, 2]"}
    assert tests["test_unshowable"]["info"] == {"unreadable": "<dict whose repr raised>"}
    assert tests["test_fine"]["info"] == {"shape": [2]}


def test_hypothesis_examples_are_each_measured_and_the_worst_kept(tracker: pytest.Pytester, reported: Reported) -> None:
    pytest.importorskip("hypothesis")
    tracker.makepyfile(
        """
        import torch
        from hypothesis import HealthCheck, example, given, settings, strategies as st

        @settings(max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
        @given(n=st.integers(1, 100))
        @example(n=1000)
        def test_sizes(gpumem, n):
            with gpumem.phase("made"):
                torch.ones(n)
        """
    )
    tracker.runpytest("--gpumem-json=out.json").assert_outcomes(passed=1)
    made = reported()["test_sizes"]["phases"]["made"]
    assert made["peak_bytes"] == 4 * 1000
    assert made["count"] >= 2


def test_user_errors_misuse_in_a_fixture_and_a_timeout_show_no_plugin_frames(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import time
        import pytest, torch

        def test_shapes(gpumem):
            with gpumem.phase("forward"):
                torch.ones(2, 3) @ torch.ones(2, 3)

        @pytest.fixture
        def measured_setup(gpumem):
            with gpumem.phase("setup"):
                yield

        def test_phase_in_setup(measured_setup):
            pass

        @pytest.mark.timeout(0.5, method="signal")
        def test_slow_phase(gpumem):
            with gpumem.phase("slow"):
                time.sleep(30)  # ended by the timeout
        """
    )
    result = tracker.runpytest("--tb=long", "-p", "no:randomly")
    result.assert_outcomes(errors=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "E*GpuMemError: gpumem.phase('setup') works only while the test function of *test_phase_in_setup runs",
            "*torch.ones(2, 3) @ torch.ones(2, 3)",
            "E*RuntimeError: mat1 and mat2 shapes*",
            "E*Failed: Timeout*",
        ]
    )
    result.stdout.no_fnmatch_line("*pytest_gpumem/*.py:*")


FLAKY_WITH_A_FIXTURE = """
import pytest, torch

attempts = []

@pytest.fixture
def noted(gpumem):
    gpumem.info["set_up"] = True
    return gpumem

@pytest.mark.flaky(reruns=1)
def test_flaky(noted):
    attempts.append(1)
    noted.info[f"attempt{len(attempts)}"] = True
    torch.ones(10)
    assert len(attempts) == 2
"""


def test_a_rerun_starts_from_nothing(tracker: pytest.Pytester, reported: Reported) -> None:
    pytest.importorskip("pytest_rerunfailures")
    tracker.makepyfile(FLAKY_WITH_A_FIXTURE)
    tracker.runpytest("--junitxml=j.xml", "--gpumem-json=out.json", "-p", "no:randomly")
    assert reported()["test_flaky"]["info"] == {"set_up": True, "attempt2": True}
    *_, case = [c for c in ET.parse(tracker.path / "j.xml").iter("testcase") if c.get("name") == "test_flaky"]
    statuses = [p.get("value") for p in case.iter("property") if p.get("name") == "gpumem_status"]
    assert statuses == ["ok"]


CONVOLUTION = """
import torch


def test_conv(gpumem):  # cuDNN's workspaces are noted where a card is predicted
    conv = torch.nn.Conv2d(3, 8, 3).to(gpumem.device)
    conv(torch.randn(2, 3, 16, 16, device=gpumem.device)).sum().backward()
"""


def test_a_suite_that_fails_on_warnings_keeps_its_notes_as_warnings_by_ignoring_ours(
    pytester: pytest.Pytester, reported: Reported
) -> None:
    pytester.makepyfile(CONVOLUTION)
    settings = '[tool.pytest.ini_options]\ngpumem_backend = "tracker"\nfilterwarnings = [{}]\n'
    pytester.makepyprojecttoml(settings.format('"error"'))
    pytester.runpytest("--gpumem-device=meta", "-p", "no:randomly").assert_outcomes(failed=1)  # a note fails it
    pytester.makepyprojecttoml(settings.format('"error", "ignore::pytest_gpumem.GpuMemWarning"'))
    result = pytester.runpytest("--gpumem-device=meta", "--gpumem-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert reported()["test_conv"]["notes"][0].startswith("cuDNN workspaces counted at 0 B")


@pytest.mark.parametrize(
    ("measured", "failed", "skipped", "xfail", "settled"),
    [
        ("ok", True, False, False, "error"),  # a unittest body, a strict XPASS: pytest saw what we did not
        ("OVER BUDGET", True, False, False, "OVER BUDGET"),  # ours: pytest failed it for our reason
        ("NEW", False, False, False, "NEW"),
        ("ok", False, True, True, "xfailed"),
        ("OUT OF MEMORY", False, True, True, "xfailed"),  # xfail(raises=OutOfMemoryError)
        ("IMPROVED", False, False, True, "XPASS"),
    ],
)
def test_the_measured_status_is_settled_with_pytests_verdict(
    measured: str, failed: bool, skipped: bool, xfail: bool, settled: str
) -> None:
    from pytest_gpumem.outcome import with_pytest
    from pytest_gpumem.results import Status

    assert with_pytest(Status(measured), failed, skipped, xfail) == Status(settled)


def test_the_report_orders_its_rows_by_the_judges_precedence() -> None:
    from pytest_gpumem.report.terminal import ordered
    from pytest_gpumem.results import PRECEDENCE, Status, TestResult, first_of

    results = [
        TestResult.of(f"t.py::test_{n}", "tracker", "cpu", None, status=s) for n, s in enumerate(reversed(PRECEDENCE))
    ]
    assert [result.status for result in ordered(results)] == list(PRECEDENCE) == sorted(Status, key=PRECEDENCE.index)
    assert (first_of([Status.NEW, Status.LEAKED, Status.REGRESSED]), first_of([])) == (Status.LEAKED, Status.OK)
