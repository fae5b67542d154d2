"""Under xdist, refusals reach the controller: a bad marker is its test's error in the report, and devices
the caller cannot see are refused once, as a usage error, before any worker starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("xdist")


@pytest.mark.slow  # a controller and a worker, each importing torch
def test_a_bad_marker_reaches_the_controller(
    tracker: pytest.Pytester, reported: Callable[..., dict[str, dict[str, Any]]]
) -> None:
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
    tracker.runpytest_subprocess("-n", "1", "--gpumem-json=out.json").assert_outcomes(passed=1, failed=1)
    assert reported()["test_bad_marker"]["status"] == "error"


def test_devices_the_caller_cannot_see_are_refused_once(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    tracker.makepyfile("def test_a(gpumem):\n    pass\n")
    result = tracker.runpytest_subprocess("-n", "2", "--gpumem-devices=0,1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-devices names cuda:0, but the caller sees 0 (none)"])
    result.stdout.no_fnmatch_line("*node down*")
