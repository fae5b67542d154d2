"""Under xdist, devices the caller cannot see are refused once, as a usage error, before any worker starts
(a bad marker reaching the controller as its test's error is asserted on test_xdist.py's shared run)."""

from __future__ import annotations

import pytest

pytest.importorskip("xdist")


def test_devices_the_caller_cannot_see_are_refused_once(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    tracker.makepyfile("def test_a(gpumem):\n    pass\n")
    result = tracker.runpytest_subprocess("-n", "2", "--gpumem-devices=0,1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-devices names cuda:0, but the caller sees 0 (none)"])
    result.stdout.no_fnmatch_line("*node down*")
