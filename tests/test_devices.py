"""Device assignment per xdist worker, tested without a GPU: the caller's visible devices are simulated.
That two workers see one device each is asserted on test_xdist.py's shared run."""

from __future__ import annotations

import argparse

import pytest
from builders import Reported

from pytest_gpumem.run.devices import Assignment, assign, visible_devices
from pytest_gpumem.values import devices_spec


def _no_count() -> int:
    raise AssertionError("CUDA_VISIBLE_DEVICES is set: the device count must not be asked")


@pytest.mark.parametrize(
    ("env", "count", "visible"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, _no_count, ["2", "3"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, _no_count, ["GPU-aa", "GPU-bb"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, _no_count, []),
        ({}, lambda: 4, ["0", "1", "2", "3"]),
        ({}, lambda: 0, []),
    ],
)
def test_visible_devices_in_the_callers_terms(env: dict[str, str], count: object, visible: list[str]) -> None:
    assert visible_devices(env, count) == visible  # type: ignore[arg-type]


def test_auto_round_robin_over_the_callers_devices() -> None:
    visible = ["2", "3"]
    assert [assign(f"gw{i}", "auto", visible) for i in range(3)] == [
        Assignment("gw0", 0, "2"),
        Assignment("gw1", 1, "3"),
        Assignment("gw2", 0, "2"),
    ]


def test_a_list_names_ordinals_as_the_caller_sees_them() -> None:
    visible = ["4", "5", "6", "7"]
    assert [assign(f"gw{i}", (1, 3), visible) for i in range(3)] == [
        Assignment("gw0", 1, "5"),
        Assignment("gw1", 3, "7"),
        Assignment("gw2", 1, "5"),
    ]
    assert assign("gw5", (2,), visible) == Assignment("gw5", 2, "6")  # one named device: every worker on it


@pytest.mark.parametrize("visible", [[], ["0"]])
def test_auto_with_one_device_or_none_changes_nothing(visible: list[str]) -> None:
    assert assign("gw1", "auto", visible) is None


def test_a_device_the_caller_cannot_see_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--gpumem-devices names cuda:2, but the caller sees 2 \(2, 3\)"):
        assign("gw0", (0, 2), ["2", "3"])


@pytest.mark.parametrize(("text", "spec"), [("auto", "auto"), ("0,1", (0, 1)), (" 3 ", (3,))])
def test_spec(text: str, spec: object) -> None:
    assert devices_spec(text) == spec


@pytest.mark.parametrize("text", ["", "a,b", "0,0", "-1", "0;1"])
def test_bad_spec(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid devices"):
        devices_spec(text)


SUITE = """
import os
import pytest

@pytest.mark.parametrize("n", range(6))
def test_sees(gpumem, n):
    gpumem.info["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
"""


def test_without_xdist_nothing_changes(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, reported: Reported
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    tracker.makepyfile(SUITE)
    tracker.runpytest("-p", "no:xdist", "--gpumem-devices=auto", "--gpumem-json=out.json").assert_outcomes(passed=6)
    assert {(t["info"]["visible"], t["worker_device"]) for t in reported().values()} == {("2,3", None)}


def test_a_device_not_visible_is_a_usage_error_before_any_worker_starts(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    tracker.makepyfile(SUITE)
    result = tracker.runpytest("-n", "2", "--gpumem-devices=0,5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-devices names cuda:5, but the caller sees 2 (2, 3)"])


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
