"""The gpumem fixture: phases, their errors, results, and the plugin's own hooks."""

from __future__ import annotations

import pytest


def test_device_and_backend(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        def test_it(gpumem):
            assert str(gpumem.device) == "cpu"
            assert gpumem.backend_name == "tracker"
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)


def test_nested_phase_is_an_error(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        def test_nest(gpumem):
            with gpumem.phase("outer"):
                with gpumem.phase("inner"):
                    pass
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*::test_nest: gpumem.phase('inner') opened inside phase 'outer': phases cannot nest"])
    result.stdout.no_fnmatch_line("*Traceback*")


@pytest.mark.parametrize(("name", "shown"), [("''", "''"), ("'call'", "'call'"), ("3", "3")])
def test_bad_phase_name(tracker: pytest.Pytester, name: str, shown: str) -> None:
    tracker.makepyfile(f"def test_it(gpumem):\n    with gpumem.phase({name}):\n        pass\n")
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*gpumem.phase() needs a non-empty name other than 'call', got {shown}"])


def test_unknown_phase_read(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        def test_it(gpumem):
            with gpumem.phase("forward"):
                pass
            gpumem.peak("backward")
        """
    )
    result = tracker.runpytest()
    result.stdout.fnmatch_lines(["*gpumem has no phase 'backward' in *test_it (phases measured: forward)"])


def test_phase_that_raises_is_closed_and_next_test_unaffected(tracker: pytest.Pytester) -> None:
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
        """
    )
    result = tracker.runpytest("--gpumem-report")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*ValueError: boom*", "*test_raises*1000 B*error*"])


def test_measured_only_during_call(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.fixture
        def model(gpumem):
            return torch.ones(10_000, device=gpumem.device)  # made in setup: not part of the call

        def test_it(gpumem, model):
            with gpumem.phase("use"):
                y = model * 2
            assert gpumem.peak("use") == 40_000

        @pytest.fixture
        def early(gpumem):
            with gpumem.phase("setup"):
                pass

        def test_phase_in_setup(early):
            pass
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*gpumem.phase('setup') works only while the test function of *test_phase_in_setup runs"]
    )


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
    import json

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


def test_info_must_be_json(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_shape(gpumem):
            gpumem.info["tensor"] = torch.ones(2)

        def test_nan(gpumem):
            gpumem.info["x"] = float("nan")

        def test_fine(gpumem):
            gpumem.info["shape"] = [2]
        """
    )
    result = tracker.runpytest("--gpumem-json=out.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*::test_shape: gpumem.info must be a dict of JSON values (str, numbers, lists, dicts): "
            "*not JSON serializable"
        ]
    )
    assert (tracker.path / "out.json").exists()


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')", "-1", "'tight'"])
def test_check_gradients_tolerances_checked(tracker: pytest.Pytester, value: str) -> None:
    tracker.makepyfile(
        f"""
        import torch

        def test_it(gpumem):
            model = torch.nn.Linear(2, 2)
            model(torch.ones(1, 2)).sum().backward()
            gpumem.check_gradients(model, rtol={value})
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*gpumem.check_gradients(rtol=...) must be a finite number >= 0, got *"])


def test_xfail_and_skip_inside_are_not_errors(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest

        def test_x(gpumem):
            pytest.xfail("known")

        def test_s(gpumem):
            pytest.skip("later")
        """
    )
    result = tracker.runpytest("--gpumem-report")
    result.assert_outcomes(xfailed=1, skipped=1)
    result.stdout.fnmatch_lines(["no test was measured*"])


def test_call_peak_so_far(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_it(gpumem):
            a = torch.ones(1000)
            with gpumem.phase("forward"):
                b = torch.ones(500)
            del a, b
            assert gpumem.peak() == 6000
            assert gpumem.result().net_bytes == 0
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)


def test_fixture_requested_dynamically(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.fixture
        def meter(request):
            return request.getfixturevalue("gpumem")

        def test_from_fixture(meter):
            with meter.phase("made"):
                torch.ones(100)
            assert meter.peak("made") == 400

        def test_in_body(request):
            request.getfixturevalue("gpumem")
        """
    )
    result = tracker.runpytest("--gpumem-report")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*::test_in_body: request the gpumem fixture as a test argument or from a fixture; asked for inside*",
            "*test_from_fixture*400 B*ok",
        ]
    )
