"""Regressions found by an independent review of the hardening work, each reproduced first."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

import pytest


def _tests(pytester: pytest.Pytester) -> dict[str, dict[str, Any]]:
    doc = json.loads((pytester.path / "out.json").read_text(encoding="utf-8"))
    return {t["nodeid"].split("::", 1)[1]: t for t in doc["tests"]}


def test_two_fits_in_one_test_are_measured_apart(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_two(gpumem):
            big = gpumem.fit(lambda n: torch.ones(n * 1000), sizes=[1, 2, 3], capacity="1 MiB")
            small = gpumem.fit(lambda n: torch.ones(n * 10), sizes=[1, 2, 3], capacity="1 MiB")
            assert big.peaks == (4000, 8000, 12000)
            assert small.peaks == (40, 80, 120)
            assert small.largest == 1024**2 // 40
            assert set(gpumem.phases) == {"fit[0]", "fit[1]", "fit[2]", "fit#2[0]", "fit#2[1]", "fit#2[2]"}
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)


def test_a_bad_marker_reaches_the_controller(tracker: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    tracker.makepyfile(
        """
        import pytest

        @pytest.mark.max_memory("abc")
        def test_bad_marker(gpumem):
            pass

        def test_fine(gpumem):
            pass
        """
    )
    tracker.runpytest_subprocess("-n", "2", "--gpumem-json=out.json").assert_outcomes(passed=1, failed=1)
    assert _tests(tracker)["test_bad_marker"]["status"] == "error"


FLAKY = """
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


def test_a_rerun_starts_from_nothing(tracker: pytest.Pytester) -> None:
    pytest.importorskip("pytest_rerunfailures")
    tracker.makepyfile(FLAKY)
    tracker.runpytest("--junitxml=j.xml", "--gpumem-json=out.json", "-p", "no:randomly")
    assert _tests(tracker)["test_flaky"]["info"] == {"set_up": True, "attempt2": True}
    *_, case = [c for c in ET.parse(tracker.path / "j.xml").iter("testcase") if c.get("name") == "test_flaky"]
    names = [p.get("name") for p in case.iter("property")]
    assert names.count("gpumem_status") == 1
    assert [p.get("value") for p in case.iter("property") if p.get("name") == "gpumem_status"] == ["ok"]


def test_expected_out_of_memory_is_left_to_xfail(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.xfail(raises=torch.OutOfMemoryError, strict=True)
        @pytest.mark.max_memory(capacity="1 MiB")
        def test_expected_oom():
            torch.ones(1_000_000)

        @pytest.mark.xfail(strict=True)
        @pytest.mark.max_memory("1 MiB")
        def test_expected_failure():
            assert False
        """
    )
    tracker.runpytest("--gpumem-json=out.json").assert_outcomes(xfailed=2)
    tests = _tests(tracker)
    assert tests["test_expected_oom"]["status"] == "xfailed"
    assert tests["test_expected_failure"]["status"] == "xfailed"


def test_out_of_memory_names_the_phase_it_left(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory(capacity="1 kB")
        def test_caught_then_oom(gpumem):
            with pytest.raises(ValueError):
                with gpumem.phase("probe"):
                    raise ValueError("handled")
            torch.ones(1000)
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["out of memory in the call (tried to allocate 3.9 KiB) after a peak of 0 B*"])
    result.stdout.fnmatch_lines(["call: peak 0 B*"])  # the breakdown section of an out-of-memory test


def test_passing_tests_do_not_keep_their_trace(tracker: pytest.Pytester) -> None:
    tracker.makeconftest(
        """
        import pytest
        from pytest_gpumem.run.session import METER_KEY

        KEPT = []

        @pytest.hookimpl(trylast=True)
        def pytest_runtest_teardown(item):
            meter = item.stash.get(METER_KEY, None)
            KEPT.append(meter is not None and meter.trace is not None)

        def pytest_sessionfinish(session):
            assert KEPT and not any(KEPT), KEPT
        """
    )
    tracker.makepyfile("import torch\n\ndef test_a(gpumem):\n    torch.ones(10) + 1\n")
    result = tracker.runpytest("--gpumem-snapshot-dir=snaps")
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    assert list((tracker.path / "snaps").iterdir()) == []


def test_devices_the_caller_cannot_see_are_refused_once(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    tracker.makepyfile("def test_a(gpumem):\n    pass\n")
    result = tracker.runpytest_subprocess("-n", "2", "--gpumem-devices=0,1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-devices names cuda:0, but the caller sees 0 (none)"])
    result.stdout.no_fnmatch_line("*node down*")


def test_compare_fails_on_a_test_that_failed_in_the_new_run(tmp_path: Any) -> None:
    def report(status: str, peak: int, backend: str = "tracker") -> dict[str, Any]:
        test = {"nodeid": "t.py::test_a", "peak_bytes": peak, "phases": {}, "status": status, "backend": backend}
        return {"version": 1, "tests": [test]}

    old, new, other = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "other.json"
    old.write_text(json.dumps(report("ok", 80)), encoding="utf-8")
    new.write_text(json.dumps(report("OUT OF MEMORY", 0)), encoding="utf-8")
    other.write_text(json.dumps(report("ok", 80, backend="cuda")), encoding="utf-8")

    def compare(a: Any, b: Any) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pytest_gpumem", "compare", str(a), str(b)]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    run = compare(old, new)
    assert run.returncode == 1
    assert "failed in the new run: t.py::test_a (OUT OF MEMORY)" in run.stdout
    run = compare(old, other)
    assert run.returncode == 0
    assert "warning: t.py::test_a was measured on another backend or device than before" in run.stdout


def test_capacity_on_a_backend_that_cannot_is_one_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from pytest_gpumem.backends.tracker.backend import TrackerBackend

        class Plain(TrackerBackend):
            name = "plain"
            configure = None  # a backend with only the documented methods

        def pytest_gpumem_make_backend(config, name):
            return Plain() if name == "plain" else None
        """
    )
    pytester.makepyfile("import pytest\n\n@pytest.mark.max_memory(capacity='1 KiB')\ndef test_a():\n    pass\n")
    result = pytester.runpytest("--gpumem-backend=plain")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*capacity 1 KiB: the plain backend cannot set a capacity"])
    pytester.makepyfile("def test_a(gpumem):\n    pass\n")
    result = pytester.runpytest("--gpumem-backend=plain", "--gpumem-snapshot-dir=snaps")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["gpumem: *; --gpumem-snapshot-dir: the plain backend records no trace, none will be written"]
    )
