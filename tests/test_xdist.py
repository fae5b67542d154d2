"""pytest-xdist: each measured test's result reaches the controller with its report (a dying worker
loses only the test it ran, a bad marker is its test's error), the controller alone reports and writes
files (the baseline file as a serial run writes it), --junitxml shows only the short properties, and each
worker sees one of the caller's devices. One run on two workers serves every test here."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import UNPLUGGED

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
        shape=torch.Size([n, 2]), ratio=numpy.float64(0.5), name=type("Name", (str,), {})("x"),
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )

@pytest.mark.max_memory("abc")
def test_bad_marker(gpumem):
    pass

def test_dies(gpumem):
    os._exit(3)
"""
PEAKS = {f"test_alloc[{n}]": 1000 * (n + 1) for n in range(6)}
BASELINES = "baselines.json"
Shared = Callable[..., tuple[Path, Any]]  # the conftest fixture shared_run
ReadReport = Callable[[Path], dict[str, dict[str, Any]]]  # and read_report
STALE = 3000  # the stored baseline of test_alloc[5] before the run, which updates it to 6000


def _entry(peak: int) -> dict[str, Any]:
    identity = {"backend": "tracker", "capability": None, "device": "cpu", "total_memory": None}
    entry = {"cuda": torch.version.cuda, "identity": identity, "peak_bytes": peak, "phases": {"made": peak}}
    return {"tracker | cpu": {**entry, "torch": torch.__version__}}


def _baselines(peaks: dict[str, int]) -> dict[str, Any]:
    entries = {f"test_suite.py::{name}": _entry(peak) for name, peak in peaks.items()}
    return {"entries": entries, "schema": "pytest-gpumem-baselines", "version": 1}


@dataclass(frozen=True)
class Run:
    """The shared run: its folder, pytest's result and its JSON report's tests by name."""

    folder: Path
    result: pytest.RunResult
    tests: dict[str, dict[str, Any]]


def _junit_properties(folder: Path) -> dict[str, dict[str, str]]:
    text = (folder / "junit.xml").read_text(encoding="utf-8")
    assert "gpumem_result" not in text and "peak_bytes&quot;" not in text  # no JSON blob
    cases = ET.fromstring(text).iter("testcase")
    return {str(c.get("name")): {str(p.get("name")): str(p.get("value")) for p in c.iter("property")} for c in cases}


# the outputs the tests read, copied to the shared folder
OUTPUTS = ("junit.xml", "out.json", BASELINES)


def _run_in_parallel(tracker: pytest.Pytester, folder: Path) -> dict[str, Any]:
    """The controller runs in this process (torch already imported); its workers are processes."""
    tracker.makepyfile(test_suite=SUITE)
    (tracker.path / BASELINES).write_text(json.dumps(_baselines({"test_alloc[5]": STALE})))
    outputs = ("--junitxml=junit.xml", "--gpumem-json=out.json", "--gpumem-report")
    baselines = ("--gpumem-update", f"--gpumem-baseline-file={BASELINES}")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the caller's devices, simulated: the tracker measures on the CPU
        result = tracker.runpytest(*UNPLUGGED, "-n", "2", *outputs, *baselines, "--gpumem-devices=auto")
    for name in OUTPUTS:
        shutil.copy(tracker.path / name, folder / name)
    return {"ret": int(result.ret), "out": result.outlines, "err": result.errlines}


@pytest.fixture
def parallel(tracker: pytest.Pytester, shared_run: Shared, read_report: ReadReport) -> Run:
    folder, kept = shared_run("xdist", lambda folder: _run_in_parallel(tracker, folder))
    result = pytest.RunResult(kept["ret"], kept["out"], kept["err"], 0.0)
    return Run(folder, result, read_report(folder / "out.json"))


@pytest.mark.slow  # the shared run: a controller and two workers (and a replacement), each importing torch
def test_a_dying_worker_loses_only_its_own_test(parallel: Run) -> None:
    parallel.result.assert_outcomes(passed=6, failed=2)
    assert sorted(parallel.tests) == sorted([*PEAKS, "test_bad_marker"])


@pytest.mark.slow
def test_every_workers_results_reach_the_controllers_report_and_file(parallel: Run) -> None:
    parallel.result.stdout.fnmatch_lines(["*= gpumem report =*", "*test_alloc[[]5[]]*5.9 KiB*2.9 KiB*+100.0%*ok*"])
    tests = parallel.tests
    assert {name: tests[name]["phases"]["made"]["peak_bytes"] for name in PEAKS} == PEAKS


@pytest.mark.slow
def test_a_bad_marker_reaches_the_controller(parallel: Run) -> None:
    parallel.result.stdout.fnmatch_lines(["*test_bad_marker: max_memory limit: cannot read size 'abc'*"])
    assert parallel.tests["test_bad_marker"]["status"] == "error"


@pytest.mark.slow
def test_info_reaches_the_controller_in_plain_json_types(parallel: Run) -> None:
    info = parallel.tests["test_alloc[3]"]["info"]
    assert {key: info[key] for key in ("shape", "ratio", "name")} == {"shape": [3, 2], "ratio": 0.5, "name": "x"}


@pytest.mark.slow
def test_xdist_writes_the_same_baseline_file_as_a_serial_run(parallel: Run) -> None:
    """Every passed test's entry (the stale one updated), in the file's stable format: indent 2, sorted
    keys, a trailing newline."""
    parallel.result.stdout.fnmatch_lines([f"wrote */{BASELINES}: 5 added, 1 updated, 0 unchanged, 0 removed"])
    text = (parallel.folder / BASELINES).read_text(encoding="utf-8")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"  # the stable format
    stored = json.loads(text)
    compositions = [entry.pop("composition", None) for test in stored["entries"].values() for entry in test.values()]
    assert None not in compositions  # each recorded with what made its peak
    assert stored == _baselines(PEAKS)


@pytest.mark.slow
def test_junit_from_workers_has_only_short_properties(parallel: Run) -> None:
    properties = _junit_properties(parallel.folder)
    for name, peak in PEAKS.items():
        status = "ok" if name == "test_alloc[5]" else "NEW"  # the one test with a stored baseline
        expected = {"gpumem_status": status, "gpumem_peak_bytes": str(peak), "gpumem_peak_bytes[made]": str(peak)}
        assert properties[name] == expected


@pytest.mark.slow
def test_workers_see_one_of_the_callers_devices(parallel: Run) -> None:
    parallel.result.stdout.fnmatch_lines(
        ["gpumem: tracker (*), device cpu", "  xdist workers get one device each (all visible, round-robin)"]
    )
    tests = parallel.tests
    by_device = {tests[name]["info"]["visible"]: tests[name]["worker_device"] for name in PEAKS}
    assert by_device == {
        "2": "worker gw0: cuda:0 of the caller (CUDA_VISIBLE_DEVICES=2)",
        "3": "worker gw1: cuda:1 of the caller (CUDA_VISIBLE_DEVICES=3)",
    }


def test_junit_of_a_serial_run_has_only_short_properties(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_suite=SUITE)
    result = tracker.runpytest("-p", "no:xdist", "-k", "alloc", "--junitxml=junit.xml")
    result.assert_outcomes(passed=6)
    properties = _junit_properties(tracker.path)
    assert properties["test_alloc[0]"] == {
        "gpumem_status": "ok",
        "gpumem_peak_bytes": "1000",
        "gpumem_peak_bytes[made]": "1000",
    }
