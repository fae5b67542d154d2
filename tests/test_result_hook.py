"""The plugin's hooks and the names they hand over: the result hook (`pytest_gpumem_result`) sees each
measured test's final result, the one the report and the JSON show, and the session hook
(`pytest_gpumem_session_results`) all of them once, on the controller; a hook that breaks the result fails
that one test in one line and the run goes on; every type the hooks page names is a public name."""

from __future__ import annotations

import json
import keyword
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import pytest_gpumem
from pytest_gpumem.distributed.worker import json_problem, sendable_info

# One run serves both hook tests: the recording hook sees test_verdicts.py, the breaking one test_broken.py
RECORDING_HOOK = """
import json, os

def record_result(item, result):
    with open(item.config.rootpath / "hooked.jsonl", "a") as f:
        f.write(json.dumps([item.nodeid.split("::", 1)[1], result.status.value, result.message]) + "\\n")

def record_session(config, results):
    seen = {r.nodeid.split("::", 1)[1]: [r.status.value, r.message] for r in results}
    written = (config.rootpath / "out.json").is_file()
    with open(config.rootpath / "session.jsonl", "a") as f:
        f.write(json.dumps([getattr(config, "workerinput", {}).get("workerid"), written, seen]) + "\\n")
    config.pluginmanager.get_plugin("terminalreporter").write_line(f"session hook: {len(results)} results")
"""

VERDICTS = """
import unittest
import pytest, torch


class Case(unittest.TestCase):
    @pytest.mark.max_memory("1 MiB")
    def test_unittest_fails(self):
        torch.ones(10)
        self.assertEqual(1, 2)

    @pytest.mark.max_memory("1 MiB")
    def test_unittest_passes(self):
        torch.ones(10)


@pytest.mark.xfail(reason="known")
def test_xfail_fails(gpumem):
    torch.ones(10)
    assert False


@pytest.mark.xfail(reason="known")
def test_xpass(gpumem):
    torch.ones(10)


@pytest.mark.xfail(reason="known", strict=True)
def test_strict_xpass(gpumem):
    torch.ones(10)


def test_fails(gpumem):
    torch.ones(10)
    assert False


def test_passes(gpumem):
    torch.ones(10)
"""


BREAKING_HOOK = """
import pytest

def break_result(item, result):
    result.info["seen"] = True  # what a hook sets reaches the JSON
    if item.name == "test_set_in_info":
        result.info["tags"] = {"a"}
    elif item.name == "test_fails_and_nan_in_info":
        result.info["loss"] = [1.0, float("nan")]
    elif item.name == "test_hook_raises":
        raise KeyError("dashboard")
    elif item.name == "test_xfail_and_lock":
        import threading
        result.info["lock"] = threading.Lock()
    elif item.name == "test_no_dict":
        result.info = ["x"]

def break_session(config, results):
    raise KeyError("leaderboard")
"""

HOOKS = f"""{RECORDING_HOOK}
{BREAKING_HOOK}

def pytest_gpumem_result(item, result):
    (record_result if item.path.name == "test_verdicts.py" else break_result)(item, result)

def pytest_gpumem_session_results(config, results):
    record_session(config, results)
    break_session(config, results)
"""

BROKEN_BY_THE_HOOK = """
import pytest, torch

def test_set_in_info(gpumem):
    torch.ones(10)

def test_fails_and_nan_in_info(gpumem):
    torch.ones(10)
    assert 1 == 2

def test_hook_raises(gpumem):
    torch.ones(10)

@pytest.mark.xfail(reason="known")
def test_xfail_and_lock(gpumem):
    assert False

def test_no_dict(gpumem):
    pass

def test_later(gpumem):
    torch.ones(100)
"""


Shared = Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]  # the conftest fixture shared_run
MODES = {"serial": ("-p", "no:xdist"), "xdist": ("-n", "2", "-p", "no:hypothesispytest")}  # saves workers seconds


@dataclass(frozen=True)
class HookedRun:
    """The run of test_verdicts.py and test_broken.py under HOOKS: its result, its JSON report's tests by
    name, and the lines the recording hooks wrote."""

    result: pytest.RunResult
    tests: dict[str, dict[str, Any]]
    hooked: list[str]
    sessions: list[str]

    def outcomes(self, module: str) -> dict[str, int]:
        """The short summary's words (PASSED, FAILED, XFAIL, XPASS) counted for one module's tests."""
        words = [line.split(" ", 1)[0] for line in self.result.outlines if f" {module}::" in line]
        return {word: words.count(word) for word in sorted(set(words))}

    def of(self, module: str) -> dict[str, dict[str, Any]]:
        return {name: test for name, test in self.tests.items() if test["nodeid"].startswith(f"{module}::")}


def _run_hooked(tracker: pytest.Pytester, mode: str) -> dict[str, Any]:
    tracker.makeconftest(HOOKS)
    tracker.makepyfile(test_verdicts=VERDICTS, test_broken=BROKEN_BY_THE_HOOK)
    args = ("-p", "no:randomly", "--gpumem-json=out.json", "--gpumem-report", "-rA")
    result = tracker.runpytest(*MODES[mode], *args)
    read = {name: (tracker.path / name).read_text(encoding="utf-8") for name in ("hooked.jsonl", "session.jsonl")}
    tests = json.loads((tracker.path / "out.json").read_text(encoding="utf-8"))["tests"]
    return {"ret": int(result.ret), "out": result.outlines, "err": result.errlines, "tests": tests, **read}


@pytest.fixture(params=[pytest.param("serial", id="mode0"), pytest.param("xdist", id="mode1", marks=pytest.mark.slow)])
def hooked_run(request: pytest.FixtureRequest, tracker: pytest.Pytester, shared_run: Shared) -> HookedRun:
    """One run per mode, which both hook tests read."""
    mode: str = request.param
    kept = shared_run(f"hooks-{mode}", lambda folder: _run_hooked(tracker, mode))[1]
    result = pytest.RunResult(kept["ret"], kept["out"], kept["err"], 0.0)
    tests = {test["nodeid"].split("::", 1)[1]: test for test in kept["tests"]}
    return HookedRun(result, tests, kept["hooked.jsonl"].splitlines(), kept["session.jsonl"].splitlines())


def _hooked(run: HookedRun) -> dict[str, list[Any]]:
    seen: dict[str, list[Any]] = {}
    for name, status, message in map(json.loads, run.hooked):
        assert name not in seen, f"the hook fired twice for {name}"
        seen[name] = [status, message]
    return seen


def test_the_hooks_see_the_status_the_report_shows(hooked_run: HookedRun) -> None:
    assert hooked_run.outcomes("test_verdicts.py") == {"FAILED": 3, "PASSED": 2, "XFAIL": 1, "XPASS": 1}
    reported = {name: [test["status"], test["message"]] for name, test in hooked_run.tests.items()}
    shown = {name: reported[name] for name in hooked_run.of("test_verdicts.py")}
    assert _hooked(hooked_run) == shown
    once = [[None, True, reported]]  # once, on the controller, the JSON written, every result
    assert [json.loads(line) for line in hooked_run.sessions] == once
    hooked_run.result.stdout.fnmatch_lines([f"session hook: {len(reported)} results", "*= gpumem report =*"])
    assert {name: status for name, (status, _) in shown.items()} == {
        "Case::test_unittest_fails": "error",
        "Case::test_unittest_passes": "ok",
        "test_xfail_fails": "xfailed",
        "test_xpass": "XPASS",
        "test_strict_xpass": "error",
        "test_fails": "error",
        "test_passes": "ok",
    }
    assert shown["Case::test_unittest_fails"][1] == "AssertionError: 1 != 2"


def test_a_hook_that_breaks_the_result_fails_one_test_in_one_line(hooked_run: HookedRun) -> None:
    result = hooked_run.result
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # not INTERNALERROR (3)
    assert hooked_run.outcomes("test_broken.py") == {"FAILED": 5, "PASSED": 1}
    result.stdout.fnmatch_lines_random(
        [
            "test_broken.py::test_set_in_info: pytest_gpumem_result: result.info['tags'] is a set, "
            "which JSON cannot hold",
            "test_broken.py::test_hook_raises: pytest_gpumem_result raised KeyError: 'dashboard'",
            "*conftest.py*, in pytest_gpumem_result",  # the hook's own traceback, in a section
            "test_broken.py::test_xfail_and_lock: pytest_gpumem_result: result.info['lock'] is a lock, "
            "which JSON cannot hold",
            "test_broken.py::test_no_dict: pytest_gpumem_result: result.info was set to a list, not a dict",
            "E       assert 1 == 2",  # a test that failed on its own keeps its failure ...
            "test_broken.py::test_fails_and_nan_in_info: pytest_gpumem_result: result.info['loss'][1] is nan, "
            "which JSON cannot hold",  # ... with the hook's line beside it
            "gpumem: pytest_gpumem_session_results raised KeyError: 'leaderboard'",  # and the report goes on
        ]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    tests = hooked_run.of("test_broken.py")
    assert {name: (test["status"], test["info"]) for name, test in tests.items()} == {
        "test_set_in_info": ("error", {}),  # as before the hook
        "test_fails_and_nan_in_info": ("error", {}),
        "test_hook_raises": ("error", {}),
        "test_xfail_and_lock": ("error", {}),
        "test_no_dict": ("error", {}),
        "test_later": ("ok", {"seen": True}),
    }
    assert tests["test_later"]["peak_bytes"] == 400
    assert tests["test_set_in_info"]["message"] == (
        "test_broken.py::test_set_in_info: pytest_gpumem_result: result.info['tags'] is a set, which JSON cannot hold"
    )
    assert tests["test_fails_and_nan_in_info"]["message"] == "AssertionError: assert 1 == 2"


class _Unshowable(str):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"a": [1, "b", {"c": None}], "d": 1.5, "e": True}, None),
        ({"s": {1}}, "info['s'] is a set, which JSON cannot hold"),
        ({"a": [0, [1, object()]]}, "info['a'][1][1] is an object, which JSON cannot hold"),
        ({"x": math.inf}, "info['x'] is inf, which JSON cannot hold"),
        ({(1, 2): 0}, "info has a key that is a tuple, which JSON cannot hold"),
        ({_Unshowable("k"): threading.Lock()}, "info['k'] is a lock, which JSON cannot hold"),
        ({"k" * 100: {1}}, f"info['{'k' * 56}...] is a set, which JSON cannot hold"),
    ],
    ids=["json", "set", "nested", "inf", "tuple-key", "key-repr-raises", "long-key"],
)
def test_what_json_cannot_hold_is_named_by_its_place_and_type(value: object, problem: str | None) -> None:
    assert json_problem(value, "info") == problem


def test_a_value_that_holds_itself_or_nests_too_deep_is_named() -> None:
    looped: dict[str, Any] = {}
    looped["me"] = [looped]
    assert json_problem(looped, "info") == "info['me'][0] holds itself, which JSON cannot hold"
    deep: list[Any] = []
    for _ in range(150):
        deep = [deep]
    assert json_problem(deep, "v") == f"v{'[0]' * 100} is nested more than 100 levels deep, which JSON cannot hold"


def test_a_rank_names_what_of_its_info_cannot_reach_the_parent() -> None:
    with pytest.raises(TypeError) as caught:
        sendable_info({"loss": math.nan, "held": {"lock": [threading.Lock()]}})
    assert str(caught.value) == (
        "gpumem.info['held']['lock'][0] is a lock, which JSON cannot hold, so the rank cannot send it to the parent"
    )
    with pytest.raises(TypeError, match=r"^gpumem.info was set to a list, not a dict, on a rank$"):
        sendable_info([1])
    sent = sendable_info({"loss": math.nan})  # NaN travels to the parent as before (json.dumps writes NaN)
    assert math.isnan(sent["loss"])


HOOKS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "hooks.md"


def test_every_type_the_hooks_page_names_is_a_public_name() -> None:
    """A capitalised name in backquotes, bare or as `pytest_gpumem.Name` (`unittest.TestCase` is not ours)."""
    found = re.findall(r"`(?:pytest_gpumem\.)?([A-Z][a-z]\w*)`", HOOKS_PAGE.read_text(encoding="utf-8"))
    named = set(found) - set(keyword.kwlist)  # `None`, `True`, `False`
    assert {"Status", "Verdict", "Entry", "Explanation", "Settings", "DeviceIdentity", "TestResult"} <= named
    assert sorted(named - set(pytest_gpumem.__all__)) == []
    assert [name for name in sorted(named) if not isinstance(getattr(pytest_gpumem, name), type)] == []


def test_a_hook_changes_a_copy_and_the_result_it_leaves_replaces_the_original() -> None:
    from dataclasses import FrozenInstanceError

    from pytest_gpumem import PhaseResult, Status, TestResult
    from pytest_gpumem.run.hand_over import ResultDraft

    call = PhaseResult("call", 4000, 4000, None, 0)
    original = TestResult.of(
        "t.py::test_a",
        "tracker",
        "cpu",
        call,
        {"f": call},
        budget_limits={"call": 1},
        info={"tags": ["a"]},
        notes=["n"],
        distributed=[{"world_size": 2}],
        simulated=[{"rank": 1}],
    )
    draft = ResultDraft.copy_of(original)
    assert json.dumps(draft.to_json()) == json.dumps(original.to_json())  # the hook sees the report's entry
    draft.status = "LEAKED"  # type: ignore[misc, assignment]  # a word, as hooks set it
    draft.info["tags"].append("b")
    assert draft.budget_limits is not None
    draft.budget_limits["call"] = 2
    draft.distributed[0]["world_size"] = 3
    draft.simulated[0]["rank"] = 0
    draft.notes.append("from the hook")  # type: ignore[attr-defined]
    draft.phases["g"] = call  # type: ignore[index]
    assert (draft.outcome.status, draft.record.notes, draft.budget.limits) == (
        Status.LEAKED,
        ("n", "from the hook"),
        {"call": 2},
    )
    final = draft.final()
    assert (original.status, original.info, original.notes) == (Status.OK, {"tags": ["a"]}, ("n",))
    assert (original.budget_limits, original.distributed, original.simulated) == (
        {"call": 1},
        ({"world_size": 2},),
        ({"rank": 1},),
    )
    assert list(original.phases) == ["f"]
    assert (type(final), final.status, final.info) == (TestResult, Status.LEAKED, {"tags": ["a", "b"]})
    assert final.notes == ("n", "from the hook")
    assert list(final.phases) == ["f", "g"]
    with pytest.raises(FrozenInstanceError):
        final.status = Status.OK  # type: ignore[misc]
    with pytest.raises(TypeError):
        final.phases["h"] = call  # type: ignore[index]


@pytest.mark.parametrize("name", ["peak_bytes", "record", "outcome", "budget", "entry"])
def test_a_hook_setting_a_figure_it_may_only_read_is_told_which(name: str) -> None:
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.run.hand_over import ResultDraft

    draft = ResultDraft.copy_of(TestResult.of("t.py::test_a", "tracker", "cpu", None))
    with pytest.raises(AttributeError, match=f"^property '{name}' of 'ResultDraft' object has no setter$"):
        setattr(draft, name, 5)


def test_a_value_a_hook_leaves_that_is_no_list_is_kept_as_given_for_the_reading_back_to_refuse() -> None:
    from pytest_gpumem import TestResult
    from pytest_gpumem.results.checks import OffShape

    result = TestResult.of("t.py::test_a", "tracker", "cpu", None, notes="abc")  # a str: not three notes
    assert result.to_json()["notes"] == "abc"
    with pytest.raises(OffShape, match=r"^result.notes must be a list, got 'abc'$"):
        TestResult.from_json(result.to_json())


def test_a_result_copies_pickles_and_turns_into_a_dict_as_a_value_does() -> None:
    import copy
    import dataclasses
    import pickle

    from pytest_gpumem import PhaseResult, TestResult

    call = PhaseResult("call", 4000, 4000, None, 0)
    result = TestResult.of("t.py::test_a", "tracker", "cpu", call, {"f": call}, notes=["n"])
    assert pickle.loads(pickle.dumps(result)) == copy.deepcopy(result) == result
    assert dataclasses.asdict(result)["record"]["phases"] == {"f": dataclasses.asdict(call)}


def test_a_hooks_phases_of_the_wrong_type_are_named_as_the_hook_left_them() -> None:
    from pytest_gpumem import TestResult

    with pytest.raises(AttributeError, match="'list' object has no attribute 'items'"):
        TestResult.of("t.py::test_a", "tracker", "cpu", None, []).to_json()  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["verdict", "baseline_entry", "explanation", "advice"])
def test_a_hooks_dict_where_a_value_goes_is_named_as_lacking_its_writer(name: str) -> None:
    from pytest_gpumem import TestResult

    odd: dict[str, Any] = {name: {"a": 1}}
    with pytest.raises(AttributeError, match=r"^'dict' object has no attribute 'to_json'$"):
        TestResult.of("t.py::test_a", "tracker", "cpu", None, **odd).to_json()
