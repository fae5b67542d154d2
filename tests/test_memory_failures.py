"""Out of memory and leaks as test failures, a device of a given size on the tracker, and the evidence a
failing test leaves (exact bytes: float32 = 4 bytes)."""

from __future__ import annotations

import fnmatch
import json
import os
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from builders import Reported

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.oom_and_leaks import Failed, is_out_of_memory, leak_holding, trial

LEAKS = """
import pytest, torch

KEEP = []


@pytest.mark.max_memory(leak="1 kB")
def test_keeps_a_tensor(gpumem):
    KEEP.append(torch.ones(1000))  # 4,000 B survive the call


@pytest.mark.max_memory(leak="1 kB")
def test_keeps_less(gpumem):
    KEEP.append(torch.ones(100))  # 400 B: under the limit


def test_cycle_is_collected(gpumem):
    node = {"t": torch.ones(1000)}
    node["self"] = node  # garbage once the call returns: not a leak


def test_graph_kept_alive(gpumem):
    x = torch.ones(250, requires_grad=True)
    KEEP.append((x * 2).sum())  # the loss, its graph and x: 1,000 (x) + 4 (loss), mul saves only scalars
"""


def test_a_kept_loss_names_the_graph_and_who_keeps_it(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_losses="""
        import torch

        LOSSES = []

        def test_keeps_losses(gpumem):
            model = torch.nn.Linear(64, 64)
            LOSSES.append(model(torch.ones(8, 64)).pow(2).sum())
        """
    )
    result = tracker.runpytest("--gpumem-leak=0")
    result.assert_outcomes(failed=1)
    # weight 16,384 + bias 256 B; pow saves its input, addmm's output (2,048 B), addmm saves the input
    # x (2,048 B); the loss (4 B) is the graph's output
    result.stdout.fnmatch_lines(
        [
            "left 20.7 kB allocated after the call (leak limit 0 (--gpumem-leak)), kept by global LOSSES of "
            "test_losses (a list)",  # the rest: past 120 characters
            "also: held by an autograd graph kept alive by global LOSSES of test_losses (a list)",
            "also: parameters 16.6 kB, saved for backward 4.1 kB, graph outputs 4 B",
            "left allocated: 16.0 KiB float32[[]64, 64[]] on cpu, made by aten.empty.memory_format at *",
        ]
    )


KEPT: list[object] = []
CACHE: dict[str, object] = {}


def _counts(device: str = "cpu") -> TrackerBackend:
    backend = TrackerBackend(device=device)
    backend.configure(Settings(None, origins=True, events=False))
    backend.start()
    return backend


def _generator() -> Iterator[torch.Tensor]:
    kept = torch.ones(10)
    yield kept


def test_a_trial_that_ran_out_of_memory_says_so_and_keeps_none_of_its_steps_tensors() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    def step() -> None:
        tensor = torch.empty(1000)  # held by this frame, which the error's traceback holds
        made.append(weakref.ref(tensor))
        raise torch.OutOfMemoryError("Tried to allocate 4.00 KiB")

    assert trial(step, is_out_of_memory) == Failed("OutOfMemoryError", "Tried to allocate 4.00 KiB", True)
    assert made[0]() is None


def test_a_trial_returns_what_its_step_returned_and_raises_what_it_does_not_catch() -> None:
    assert trial(lambda: 4000, is_out_of_memory) == 4000

    def step() -> None:
        raise ValueError("a shape the step refuses")

    with pytest.raises(ValueError, match="a shape the step refuses"):
        trial(step, is_out_of_memory)
    assert trial(step, lambda exc: True) == Failed("ValueError", "a shape the step refuses", False)


@pytest.mark.parametrize(
    ("keep", "holder"),
    [
        (lambda: KEPT.append(torch.ones(10)), "global KEPT of *test_memory_failures (a list)"),
        (lambda: CACHE.update(x=torch.ones(10)), "global CACHE of *test_memory_failures (a dict)"),
        (
            lambda: KEPT.append(next(g := _generator()) is None or g),
            "global KEPT of *test_memory_failures (the suspended generator _generator)",
        ),
        (
            lambda: KEPT.append(types.SimpleNamespace(t=torch.ones(10))),
            "global KEPT of * (a dict)",
        ),  # the namespace's __dict__
    ],
)
def test_who_keeps_a_survivor_is_named(keep: Callable[[], object], holder: str) -> None:
    backend = _counts()
    try:
        keep()
        holding = leak_holding(backend.live_storages())
    finally:
        backend.stop()
        KEPT.clear()
        CACHE.clear()
    assert holding is not None and holding.kinds == () and not holding.graph
    assert fnmatch.fnmatch(holding.held(), f"kept by {holder}")


def test_an_unreachable_survivor_names_no_holder() -> None:
    backend = _counts()
    try:
        ring: dict[str, object] = {"t": torch.ones(10)}
        ring["self"] = ring
        holding = leak_holding(backend.live_storages())  # alive only through a local: no global holds it
    finally:
        backend.stop()
    assert holding is None
    del ring


OUT_OF_MEMORY = """
import pytest, torch

def big():
    a = torch.ones(40_000_000)  # 160,000,000 B
    b = torch.ones(20_000_000)  # 80,000,000 B more: past 200 MB

@pytest.mark.max_memory("256 MB")
def test_budget_not_the_cause(gpumem):
    big()

@pytest.mark.max_memory("100 MB")
def test_budget_passed_already(gpumem):
    big()

@pytest.mark.max_memory("1 GB", capacity="190 MB")
def test_own_capacity(gpumem):
    big()

@pytest.mark.max_memory(capacity="A100-40GB", device="meta")
def test_card(gpumem):
    torch.empty(50 * 2**30, dtype=torch.uint8, device=gpumem.device)
"""


def test_out_of_memory_names_the_limit_hit(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(OUT_OF_MEMORY)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-capacity=200MB")
    result.assert_outcomes(failed=4)
    oom = "out of memory in the call after a peak of 160.0 MB: past"
    tried = "also: tried to allocate 76.3 MiB"  # 124 columns with it on the line
    result.stdout.fnmatch_lines(
        [
            # the option's 200 MB binds; the budget (256 MB) is not the cause and was not exceeded
            f"{oom} the capacity 200MB (--gpumem-capacity)",
            tried,
            # a budget the peak had already passed is named as well
            f"{oom} the capacity 200MB (--gpumem-capacity)",
            tried,
            "also: over its budget 100 MB too, at 160.0 MB",
            "out of memory in the call (tried to allocate 76.3 MiB) after a peak of 160.0 MB: past "
            "max_memory(capacity='190 MB')",
            # a card's usable bytes: its 42,298,834,944 B less the 512 MiB CUDA's context keeps
            "out of memory in the call after a peak of 0 B: past max_memory(capacity='A100-40GB'), 38.9 GiB usable; "
            "on meta",
            "also: a prediction on meta",
            "also: tried to allocate 50.0 GiB",
        ]
    )
    result.stdout.no_fnmatch_line("*budget 256 MB*")


def test_leaks_of_a_known_size(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(LEAKS)
    result = tracker.runpytest("--gpumem-leak=0", "-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            # the largest survivor does not fit in the line: the section lists it
            "left 4.0 kB allocated after the call (leak limit 1 kB), kept by global KEEP of test_leaks_of_a_known_size "
            "(a list)",
            "left allocated: 3.9 KiB float32[[]1000[]] on cpu, made by aten.ones.default at *.py:8",
        ]
    )
    tests = reported()
    assert tests["test_keeps_a_tensor"]["status"] == "LEAKED"
    assert tests["test_keeps_less"]["status"] == "ok"  # its marker's 1 kB wins over the option's 0 B
    assert tests["test_graph_kept_alive"]["status"] == "LEAKED"  # the option's 0 B
    assert tests["test_cycle_is_collected"]["status"] == "ok"
    assert tests["test_graph_kept_alive"]["call"]["net_bytes"] == 1000 + 4


def test_marker_limit_wins_and_nothing_is_checked_without_one(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        LEAKS.replace('@pytest.mark.max_memory(leak="1 kB")\ndef test_keeps_less', "def test_keeps_less")
    )
    result = tracker.runpytest("-p", "no:randomly", "-k", "keeps")
    result.assert_outcomes(passed=1, failed=1)  # test_keeps_less has no limit of its own and no option


def test_leak_limit_is_exact(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        KEEP = []

        @pytest.mark.max_memory(leak=4000)
        def test_at_the_limit(gpumem):
            KEEP.append(torch.ones(1000))

        @pytest.mark.max_memory(leak=3999)
        def test_over_by_one(gpumem):
            KEEP.append(torch.ones(1000))
        """
    )
    tracker.runpytest("-p", "no:randomly").assert_outcomes(passed=1, failed=1)


CAPACITY = """
import pytest, torch


@pytest.mark.max_memory(capacity=10_000)
def test_raises_at_the_first_allocation_past_it(gpumem):
    a, b = torch.ones(1000), torch.ones(1000)  # 8,000 B
    c = torch.ones(500)  # 10,000 B: exactly the capacity, allowed
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 4 B with 9.8 KiB"):
        torch.ones(1)  # 10,004 B would be past it
    del c
    d = torch.ones(500)  # room again


@pytest.mark.max_memory(capacity="10 kB")
def test_runs_out(gpumem):
    a = torch.ones(1000)
    with gpumem.phase("backward"):
        b = torch.ones(2000)  # 4,000 + 8,000 B > 10 kB


def test_after_measures_what_it_measures_alone(gpumem):
    x = torch.ones(5000)  # 20,000 B: no capacity is left over from the test before
    assert gpumem.peak() == 20_000
"""


def test_capacity_and_out_of_memory(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(CAPACITY)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "out of memory in backward (tried to allocate 7.8 KiB) after a peak of 4.0 kB: "
            "past max_memory(capacity='10 kB')",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    tests = reported()
    assert tests["test_runs_out"]["status"] == "OUT OF MEMORY"
    assert tests["test_after_measures_what_it_measures_alone"]["peak_bytes"] == 20_000


def test_capacity_option_and_header(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_big(gpumem):
            torch.ones(1000)
        """
    )
    result = tracker.runpytest("--gpumem-capacity=3999")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "gpumem: tracker (*), device cpu",
            "  capacity 3999 (--gpumem-capacity): an allocation past it raises torch.OutOfMemoryError",
            "*out of memory in the call (tried to allocate 3.9 KiB) after a peak of 0 B: "
            "past the capacity 3999 (--gpumem-capacity)",
        ]
    )
    assert tracker.runpytest("--gpumem-capacity=4000").ret == 0


def test_failing_tests_leave_their_trace(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(CAPACITY)
    tracker.makepyfile(test_leak=LEAKS)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-snapshot-dir=traces")
    result.assert_outcomes(passed=5, failed=2)
    files = sorted(p.name.rsplit("-", 1)[0] for p in (tracker.path / "traces").iterdir())
    assert files == ["test_failing_tests_leave_their_trace.py_test_runs_out", "test_leak.py_test_keeps_a_tensor"]
    (trace,) = (tracker.path / "traces").glob("test_leak.py_test_keeps_a_tensor-*.json")
    doc = json.loads(trace.read_text(encoding="utf-8"))
    assert doc["status"] == "LEAKED"
    assert doc["events"] == [
        {"action": "alloc", "bytes": 4000, "allocated": 4000, "op": "aten.ones.default", "where": "test_leak.py:8"}
    ]
    (oom,) = (tracker.path / "traces").glob("*test_runs_out-*.json")
    events = json.loads(oom.read_text(encoding="utf-8"))["events"]
    # `a` (4,000 B); `b` was refused before it was counted, so the trace ends at the capacity's edge
    assert [(e["action"], e["bytes"], e["op"]) for e in events][:1] == [("alloc", 4000, "aten.ones.default")]
    assert all(e["bytes"] != 8000 for e in events)


def test_bad_capacity_or_leak_fails_that_test_in_one_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest

        @pytest.mark.max_memory(capacity=0)
        def test_capacity(gpumem):
            pass

        @pytest.mark.max_memory(leak="lots")
        def test_leak(gpumem):
            pass
        """
    )
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*::test_capacity: max_memory capacity=: a limit must be above zero, got 0",
            "*::test_leak: max_memory leak=: cannot read size 'lots'*",
        ]
    )


def test_a_leak_made_inside_an_installed_package_names_the_tests_own_line(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_backend = tracker\npythonpath = site-packages\n")
    package = pytester.mkdir("site-packages") / "leaky.py"
    package.write_text("import torch\n\nCACHE = []\n\ndef remember(n):\n    CACHE.append(torch.ones(n))\n")
    pytester.makepyfile(test_uses_it="import leaky\n\n\ndef test_uses(gpumem):\n    leaky.remember(1000)\n")
    result = pytester.runpytest("--gpumem-leak=0")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "left 4.0 kB allocated after the call (leak limit 0 (--gpumem-leak)), kept by global CACHE of leaky "
            "(a list)*",
            "left allocated: 3.9 KiB float32[[]1000[]] on cpu, made by aten.ones.default at test_uses_it.py:5 via "
            "leaky.py:6",
        ]
    )


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("/p/.venv/lib/python3.11/site-packages/transformers/models/bert.py", (False, "transformers/models/bert.py")),
        ("/usr/lib/python3/dist-packages/numpy/core.py", (False, "numpy/core.py")),
        ("/p/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", None),
        ("<frozen importlib._bootstrap>", (False, "<frozen importlib._bootstrap>")),
        ("<string>", (True, "<string>")),
        (os.path.join(sysconfig.get_paths()["stdlib"], "copy.py"), (False, "copy.py")),
    ],
)
def test_a_code_file_is_the_users_own_an_installed_packages_or_neither(
    path: str, shown: tuple[bool, str] | None
) -> None:
    from pytest_gpumem.backends.tracker.recording import code_file_shown

    assert code_file_shown(path) == shown
