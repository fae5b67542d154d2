from __future__ import annotations

import json

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
