"""pytest-xdist: each measured test's result reaches the controller with its report (a dying worker
loses only the test it ran), the controller alone reports and writes files, and --junitxml shows only
the short properties. One run on two workers serves every test here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xdist")

# 250 * (n + 1) float32 in phase "made": 1000 * (n + 1) bytes with the tracker; test_dies kills its worker
SUITE = """
import collections, os
import numpy, pytest, torch

@pytest.mark.parametrize("n", range(6))
def test_alloc(gpumem, n):
    with gpumem.phase("made"):
        torch.ones(250 * (n + 1))
    gpumem.info = collections.OrderedDict(
        shape=torch.Size([n, 2]), ratio=numpy.float64(0.5), name=type("Name", (str,), {})("x")
    )

def test_dies(gpumem):
    os._exit(3)
"""
PEAKS = {f"test_alloc[{n}]": 1000 * (n + 1) for n in range(6)}


class Run:
    def __init__(self, folder: Path, result: pytest.RunResult) -> None:
        self.folder, self.result = folder, result

    def tests(self) -> dict[str, dict[str, Any]]:
        doc = json.loads((self.folder / "out.json").read_text(encoding="utf-8"))
        return {test["nodeid"].split("::", 1)[1]: test for test in doc["tests"]}

    def junit_properties(self) -> dict[str, dict[str, str]]:
        text = (self.folder / "junit.xml").read_text(encoding="utf-8")
        assert "gpumem_result" not in text and "peak_bytes&quot;" not in text  # no JSON blob
        cases = ET.fromstring(text).iter("testcase")
        return {
            str(c.get("name")): {str(p.get("name")): str(p.get("value")) for p in c.iter("property")} for c in cases
        }


def _run(folder: Path, *args: str) -> pytest.RunResult:
    (folder / "tox.ini").write_text("[pytest]\ngpumem_backend = tracker\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "CI", "BUILD_NUMBER", "PYTEST_ADDOPTS")}
    env.pop("PYTEST_CURRENT_TEST", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *args]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    return pytest.RunResult(done.returncode, done.stdout.splitlines(), done.stderr.splitlines(), 0.0)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("xdist")
    (folder / "test_suite.py").write_text(SUITE)
    return Run(folder, _run(folder, "-n", "2", "--junitxml=junit.xml", "--gpumem-json=out.json", "--gpumem-report"))


def test_a_dying_worker_loses_only_its_own_test(parallel: Run) -> None:
    parallel.result.assert_outcomes(passed=6, failed=1)
    assert sorted(parallel.tests()) == sorted(PEAKS)


def test_every_workers_results_reach_the_controllers_report_and_file(parallel: Run) -> None:
    parallel.result.stdout.fnmatch_lines(["*= gpumem report =*", "*test_alloc[[]5[]]*5.9 KiB*ok*"])
    assert {name: test["phases"]["made"]["peak_bytes"] for name, test in parallel.tests().items()} == PEAKS


def test_info_reaches_the_controller_in_plain_json_types(parallel: Run) -> None:
    assert parallel.tests()["test_alloc[3]"]["info"] == {"shape": [3, 2], "ratio": 0.5, "name": "x"}


def test_junit_from_workers_has_only_short_properties(parallel: Run) -> None:
    properties = parallel.junit_properties()
    for name, peak in PEAKS.items():
        expected = {"gpumem_status": "ok", "gpumem_peak_bytes": str(peak), "gpumem_peak_bytes[made]": str(peak)}
        assert properties[name] == expected


def test_junit_of_a_serial_run_has_only_short_properties(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_suite=SUITE)
    result = tracker.runpytest("-p", "no:xdist", "-k", "not dies", "--junitxml=junit.xml")
    result.assert_outcomes(passed=6)
    properties = Run(tracker.path, result).junit_properties()
    assert properties["test_alloc[0]"] == {
        "gpumem_status": "ok",
        "gpumem_peak_bytes": "1000",
        "gpumem_peak_bytes[made]": "1000",
    }
