from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("xdist")

SUITE = """
import pytest, torch

@pytest.mark.parametrize("n", [250, 500, 1000, 2000])
def test_alloc(gpumem, n):
    with gpumem.phase("made"):
        torch.ones(n)
    assert gpumem.peak("made") == 4 * n
"""


def _run(pytester: pytest.Pytester, *args: str) -> dict[str, dict[str, object]]:
    result = pytester.runpytest_subprocess("--gpumem-json=out.json", "--gpumem-report", *args)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*= gpumem report =*", "*test_alloc?2000?*7.8 KiB*ok"])
    tests = json.loads((pytester.path / "out.json").read_text())["tests"]
    return {t["nodeid"]: t["phases"] for t in tests}


def test_workers_send_results_to_the_controller(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(SUITE)
    serial = _run(tracker, "-p", "no:xdist")
    parallel = _run(tracker, "-n", "2")
    assert serial == parallel
    assert len(serial) == 4


# 250 * (n + 1) float32 in phase "made": 1000 * (n + 1) bytes with the tracker; test_dies kills its worker
JUNIT_SUITE = """
import os, pytest, torch

@pytest.mark.parametrize("n", range(4))
def test_alloc(gpumem, n):
    with gpumem.phase("made"):
        torch.ones(250 * (n + 1))

def test_dies(gpumem):
    os._exit(3)
"""


@pytest.mark.parametrize("args", [("-p", "no:xdist", "-k", "not dies"), ("-n", "2")])
def test_junit_has_only_short_properties_and_a_dead_worker_loses_only_its_test(
    tracker: pytest.Pytester, args: tuple[str, ...]
) -> None:
    tracker.makepyfile(test_suite=JUNIT_SUITE)
    result = tracker.runpytest_subprocess("--junitxml=junit.xml", "--gpumem-json=out.json", "-p", "no:randomly", *args)
    result.assert_outcomes(passed=4, failed=0 if "no:xdist" in args else 1)
    text = (tracker.path / "junit.xml").read_text(encoding="utf-8")
    assert "gpumem_result" not in text and "peak_bytes&quot;" not in text  # no JSON blob
    cases = {case.get("name"): case for case in ET.fromstring(text).iter("testcase")}
    for n in range(4):
        properties = {p.get("name"): p.get("value") for p in cases[f"test_alloc[{n}]"].iter("property")}
        assert properties == {
            "gpumem_status": "ok",
            "gpumem_peak_bytes": str(1000 * (n + 1)),
            "gpumem_peak_bytes[made]": str(1000 * (n + 1)),
        }
    tests = json.loads((tracker.path / "out.json").read_text(encoding="utf-8"))["tests"]
    peaks = {t["nodeid"]: t["phases"]["made"]["peak_bytes"] for t in tests}
    assert peaks == {f"test_suite.py::test_alloc[{n}]": 1000 * (n + 1) for n in range(4)}
