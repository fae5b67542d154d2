"""The gpumem fixture: what it reads, phases and their errors, results, and the plugin's own hooks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest


def test_the_fixture_reads_the_call_its_phases_device_and_backend(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        def test_device_and_backend(gpumem):
            assert str(gpumem.device) == "cpu"
            assert gpumem.backend_name == "tracker"

        def test_call_peak_so_far(gpumem):
            a = torch.ones(1000)
            with gpumem.phase("forward"):
                b = torch.ones(500)
            del a, b
            assert gpumem.peak() == 6000
            assert gpumem.result().net_bytes == 0

        @pytest.fixture
        def model(gpumem):
            return torch.ones(10_000, device=gpumem.device)  # made in setup: not part of the call

        def test_setup_is_not_measured(gpumem, model):
            with gpumem.phase("use"):
                y = model * 2
            assert gpumem.peak("use") == 40_000
        """
    )
    tracker.runpytest().assert_outcomes(passed=3)


PHASE_ERRORS = """
import pytest

def test_nest(gpumem):
    with gpumem.phase("outer"):
        with gpumem.phase("inner"):
            pass

@pytest.mark.parametrize("name", ["", "call", 3])
def test_bad_name(gpumem, name):
    with gpumem.phase(name):
        pass

def test_unknown_phase_read(gpumem):
    with gpumem.phase("forward"):
        pass
    gpumem.peak("backward")

@pytest.fixture
def early(gpumem):
    with gpumem.phase("setup"):
        pass

def test_phase_in_setup(early):
    pass

def test_in_body(request):
    request.getfixturevalue("gpumem")

@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, "tight"])
def test_gradient_tolerance(gpumem, value):
    import torch

    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    gpumem.check_gradients(model, rtol=value)
"""


def test_misuse_of_the_fixture_fails_that_test_in_one_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(PHASE_ERRORS)
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=10, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*gpumem.phase('setup') works only while the test function of *test_phase_in_setup runs",
            "*::test_nest: gpumem.phase('inner') opened inside phase 'outer': phases cannot nest",
            "*gpumem.phase() needs a non-empty name other than 'call', got ''",
            "*gpumem.phase() needs a non-empty name other than 'call', got 'call'",
            "*gpumem.phase() needs a non-empty name other than 'call', got 3",
            "*gpumem has no phase 'backward' in *test_unknown_phase_read (phases measured: forward)",
            "*::test_in_body: request the gpumem fixture as a test argument or from a fixture; asked for inside*",
            *["*gpumem.check_gradients(rtol=...) must be a finite number >= 0, got *"] * 4,
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")


def test_a_phase_that_raises_is_closed_and_what_follows_is_measured(
    tracker: pytest.Pytester, reported: Callable[..., dict[str, dict[str, Any]]]
) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        def test_raises(gpumem):
            keep = torch.ones(1000)
            with gpumem.phase("forward"):
                torch.ones(250)
                raise ValueError("boom")

        def test_after(gpumem):
            with gpumem.phase("forward"):
                torch.ones(10)
            assert gpumem.peak("forward") == 40

        def test_caught(gpumem):
            with pytest.raises(ValueError):
                with gpumem.phase("forward"):
                    x = torch.ones(100)
                    raise ValueError
            assert gpumem.peak("forward") == 400
            with gpumem.phase("backward"):
                pass

        @pytest.fixture
        def meter(request):
            return request.getfixturevalue("gpumem")

        def test_from_fixture(meter):
            with meter.phase("made"):
                torch.ones(100)
            assert meter.peak("made") == 400

        def test_xfail_inside(gpumem):
            pytest.xfail("known")

        def test_skip_inside(gpumem):
            pytest.skip("later")
        """
    )
    result = tracker.runpytest("--gpumem-report", "--gpumem-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=1, xfailed=1, skipped=1)
    result.stdout.fnmatch_lines(["*ValueError: boom*", "*test_raises*1000 B*error*"])
    tests = reported()
    assert sorted(tests) == ["test_after", "test_caught", "test_from_fixture", "test_raises"]  # skips: unmeasured
    assert (tests["test_from_fixture"]["status"], tests["test_from_fixture"]["peak_bytes"]) == ("ok", 400)
    assert tests["test_raises"]["phases"]["forward"]["peak_bytes"] == 1000


def test_result_hook_sees_whole_call_and_info(tracker: pytest.Pytester) -> None:
    tracker.makeconftest(
        """
        import json

        def pytest_gpumem_result(item, result):
            with open("results.jsonl", "a") as f:
                f.write(json.dumps(result.to_dict()) + "\\n")
        """
    )
    tracker.makepyfile(
        """
        import torch

        def test_it(gpumem):
            gpumem.info["strategy"] = "naive"
            a = torch.ones(1000)
            with gpumem.phase("forward"):
                b = torch.ones(500)
            del a, b
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)
    (line,) = (tracker.path / "results.jsonl").read_text().splitlines()
    data = json.loads(line)
    assert data["phases"]["forward"]["peak_bytes"] == 2000
    assert data["peak_bytes"] == 6000
    assert data["call"]["net_bytes"] == 0
    assert data["info"] == {"strategy": "naive"}
    assert data["status"] == "ok"


def test_custom_backend_hook(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import torch
        from pytest_gpumem import Counters

        class Fixed:
            '''A fake allocator whose every reading is 100 bytes above the start: tests the plumbing only.'''
            name = "fixed"
            device = torch.device("cpu")
            def __init__(self): self.n = 0
            def describe(self): return "fixed (a test double)"
            def start(self): pass
            def stop(self): pass
            def settle(self): pass
            def current(self): return Counters(self.n, self.n)
            def peak(self): self.n += 100; return Counters(self.n, self.n)
            def reset_peak(self): pass

        def pytest_gpumem_make_backend(config, name):
            if name == "fixed":
                return Fixed()
        """
    )
    pytester.makepyfile(
        """
        def test_it(gpumem):
            assert gpumem.backend_name == "fixed"
        """
    )
    result = pytester.runpytest("--gpumem-backend=fixed", "--gpumem-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpumem: fixed (a test double)", "*test_it*100 B*ok*"])
