"""The gpumem fixture: what it reads, phases and their errors, results, and the plugin's own hooks."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import NoReturn

import pytest
import torch
from builders import Reported

from pytest_gpumem import GpuMemError


def test_the_fixture_reads_the_call_its_phases_device_and_backend(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        def test_device_and_backend(gpumem):
            assert str(gpumem.device) == "cpu"
            assert gpumem.backend.name == "tracker"

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
import os
from unittest import mock

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

def test_in_body_without_environment(request):
    with mock.patch.dict(os.environ, clear=True):  # PYTEST_CURRENT_TEST too
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
    result.assert_outcomes(failed=11, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*gpumem.phase('setup') works only while the test function of *test_phase_in_setup runs",
            "*::test_nest: gpumem.phase('inner') opened inside phase 'outer': phases cannot nest",
            "*gpumem.phase() needs a non-empty name other than 'call', got ''",
            "*gpumem.phase() needs a non-empty name other than 'call', got 'call'",
            "*gpumem.phase() needs a non-empty name other than 'call', got 3",
            "*gpumem has no phase 'backward' in *test_unknown_phase_read (phases measured: forward)",
            "*::test_in_body: request the gpumem fixture as a test argument or from a fixture; asked for inside*",
            "*::test_in_body_without_environment: request the gpumem fixture as a test argument or from a fixture*",
            *["*gpumem.check_gradients(rtol=...) must be a finite number >= 0, got *"] * 4,
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")


def test_a_phase_that_raises_is_closed_and_what_follows_is_measured(
    tracker: pytest.Pytester, reported: Reported
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
                f.write(json.dumps(result.to_json()) + "\\n")
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


def test_a_plugin_backend_may_identify_with_a_dict_and_a_result_hook_set_a_status_word(
    pytester: pytest.Pytester, reported: Reported
) -> None:
    pytester.makeconftest(
        """
        import torch
        from pytest_gpumem import Backend, Counters

        class Fixed(Backend):
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
            def identity(self): return {"backend": "fixed", "device": self.model}  # a dict, as documented before

        def pytest_gpumem_make_backend(config, name):
            if name == "fixed":
                return Fixed()

        def pytest_runtest_setup(item):
            Fixed.model = 0 if item.name == "test_unidentified" else "fake0"  # 0: no device's name

        def pytest_gpumem_result(item, result):
            if result.status == "NEW":
                result.status = "fine" if item.name == "test_bad_status" else "ok"  # plain strings, as before
        """
    )
    pytester.makepyfile(
        test_it="""
        def test_it(gpumem):
            assert gpumem.backend.name == "fixed"

        def test_bad_status(gpumem):
            pass

        def test_unidentified(gpumem):
            pass
        """
    )
    result = pytester.runpytest(
        "--gpumem-backend=fixed", "--gpumem-report", "--gpumem-update", "--gpumem-json=out.json", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "gpumem: fixed (a test double)",
            "test_it.py::test_bad_status: pytest_gpumem_result: result.status: 'fine' is not a status "
            "(one of: ok, NEW, *)",
            "test_it.py::test_unidentified: the fixed backend's identity(): "
            "identity.device: expected a non-empty string, got 0",
            "*test_it*100 B*ok*",
        ]
    )
    result.stdout.no_fnmatch_line("*pytest_gpumem/*.py:*")
    result.stdout.no_fnmatch_line("During handling*")
    assert {name: test["status"] for name, test in reported().items()} == {
        "test_it": "ok",
        "test_bad_status": "error",
        "test_unidentified": "error",
    }
    stored = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    assert {nodeid: list(entries) for nodeid, entries in stored["entries"].items()} == {
        "test_it.py::test_it": ["fixed | fake0"]
    }


class _Identified:
    name, device = "plugged", "cpu"

    def __init__(self, identity: object) -> None:
        self.own = identity

    def identity(self) -> object:
        return self.own


@pytest.mark.parametrize(
    ("identity", "key"),
    [
        ({"backend": "plugged", "device": "X1"}, "plugged | X1"),
        (
            {"backend": "plugged", "device": "X1", "capability": "9.0", "total_memory": 1024},
            "plugged | X1 | cc 9.0 | 1024 B",
        ),
    ],
)
def test_a_backend_identity_given_as_a_dict_keys_baselines_as_before(identity: object, key: str) -> None:
    from pytest_gpumem.run.regression import identity_of

    assert identity_of(_Identified(identity)).key == key  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("identity", "error"),
    [
        (["plugged"], "the plugged backend's identity(): expected a DeviceIdentity or a dict, got ['plugged']"),
        (
            {"backend": "plugged", "device": "X1", "memory": 1},
            "the plugged backend's identity(): identity: unknown key 'memory'",
        ),
    ],
)
def test_a_backend_identity_of_another_kind_is_refused_naming_the_backend(identity: object, error: str) -> None:
    from pytest_gpumem.errors import GpuMemError
    from pytest_gpumem.run.regression import identity_of

    with pytest.raises(GpuMemError) as raised:
        identity_of(_Identified(identity))  # type: ignore[arg-type]
    assert str(raised.value) == error


def test_a_status_given_as_its_word_is_a_status_and_a_result_is_never_changed() -> None:
    import dataclasses

    from pytest_gpumem.errors import GpuMemError
    from pytest_gpumem.results import Status, TestResult

    result = TestResult.of("t.py::t", "tracker", "cpu", None).replaced(status="OVER BUDGET")
    assert result.status is Status.OVER_BUDGET and not result.status.passing
    with pytest.raises(GpuMemError, match=r"^result.status: 'over' is not a status \(one of: ok, NEW, "):
        result.replaced(status="over")
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.status = Status.OK  # type: ignore[misc]
    assert result.status is Status.OVER_BUDGET


def test_the_fixture_shows_only_what_a_test_author_uses() -> None:
    from pytest_gpumem.backends.tracker.backend import TrackerBackend
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.measure.meter import GpuMem

    public = [name for name in dir(GpuMem(Measurement(TrackerBackend(), "t.py::t"))) if not name.startswith("_")]
    assert public == [
        "advise",
        "backend",
        "check_gradients",
        "device",
        "distributed",
        "fit",
        "info",
        "peak",
        "phase",
        "phases",
        "result",
        "simulate_rank",
    ]


def test_what_the_plugin_measured_on_request_is_kept_out_of_the_tests_info(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_fits(gpumem):
            gpumem.info["mine"] = 1
            gpumem.fit(lambda n: torch.ones(n, 256), [1, 2, 4], "1 MiB", confirm=False)
            gpumem.simulate_rank(lambda rank, world_size, meter: None, 8, rank=3)
        """
    )
    tracker.runpytest("--gpumem-json=run.json").assert_outcomes(passed=1)
    (test,) = json.loads((tracker.path / "run.json").read_text())["tests"]
    assert (test["info"], test["simulated"], test["advice"], test["distributed"]) == (
        {"mine": 1},
        [{"world_size": 8, "rank": 3}],
        None,
        [],
    )
    assert [sentence.split(":")[0] for sentence in test["fits"]] == ["largest batch that fits 1 MiB"]


MEMORY_SUITE = """
import pytest, torch

@pytest.mark.max_memory("1 B", leak="1 B")  # fails when measured
def test_over_its_budget(gpumem):
    with gpumem.phase("forward"):
        kept = torch.ones(1000)
    gpumem.check_gradients({"w": kept})
    gpumem.info["batch"] = 2
    assert gpumem.phases == {} and gpumem.device == torch.device("cpu")

def test_reads_its_peak(gpumem):
    with gpumem.phase("forward"):
        torch.ones(1000)
    assert gpumem.peak("forward") == 4000
"""


def test_a_memory_suite_runs_unmeasured_under_disable(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(MEMORY_SUITE)
    flags = ["--strict-markers", "--gpumem-all", "--gpumem-strict", "--gpumem-json=out.json", "-rs"]
    result = tracker.runpytest(*flags, "--gpumem-disable")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "gpumem: off (--gpumem-disable): tests run unmeasured; no budget, leak or baseline is judged",
            "SKIPPED [[]1[]] test_a_memory_suite_runs_unmeasured_under_disable.py:14: gpumem.peak() needs a "
            "measurement, and measurement is off (--gpumem-disable)",
        ]
    )
    assert json.loads((tracker.path / "out.json").read_text())["tests"] == []
    tracker.runpytest(*flags).assert_outcomes(failed=2)  # measured: a budget, a missing baseline
    with pytest.MonkeyPatch.context() as env:  # no allocator is modelled: its settings are not read
        env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:\u00b2")
        env.setenv("CUBLAS_WORKSPACE_CONFIG", ":99999999999:1")
        tracker.runpytest(*flags, "--gpumem-disable", "--gpumem-round=cuda").assert_outcomes(passed=1, skipped=1)


def test_a_gpumem_whose_measurement_is_off_runs_its_blocks_and_refuses_what_needs_a_measurement() -> None:
    from pytest_gpumem.backends.tracker.backend import TrackerBackend
    from pytest_gpumem.measure.meter import GpuMem, MeasurementOff

    made: list[TrackerBackend] = []

    def backend() -> TrackerBackend:
        made.append(TrackerBackend())
        return made[-1]

    def refuse(call: str) -> NoReturn:
        raise LookupError(call)

    meter = GpuMem(MeasurementOff("t.py::t", backend, refuse))
    with meter.phase("forward"):
        kept = torch.ones(1000)
    meter.check_gradients({"w": kept}, rtol=-1.0)  # checks nothing, not even its arguments
    meter.info["batch"] = 2
    assert (meter.phases, meter.info, made) == ({}, {"batch": 2}, [])
    with pytest.raises(GpuMemError, match="needs a non-empty name other than 'call', got 'call'"):
        meter.phase("call").__enter__()
    refused: dict[str, Callable[[], object]] = {
        "peak()": meter.peak,
        "result()": meter.result,
        "fit()": lambda: meter.fit(lambda n: None, [1, 2], "1 GB"),
        "advise()": lambda: meter.advise(lambda: None, model=torch.nn.Linear(1, 1)),
        "distributed()": lambda: meter.distributed(print),
        "simulate_rank()": lambda: meter.simulate_rank(print, 2),
    }
    for call, run in refused.items():
        with pytest.raises(LookupError, match=re.escape(call)):
            run()
    assert meter.device == torch.device("cpu") and len(made) == 1
