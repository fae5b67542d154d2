"""A measured test's result handed over with its report: settled with pytest's verdict, shown to the
`pytest_gpumem_result` hook as a copy that replaces it (unless the hook breaks it), sent to the xdist
controller as JSON text on the report, and written as JUnit properties."""

from __future__ import annotations

import copy
import json
import re
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from cuda_allocator_model import ModelError
from pytest_gpumem.distributed.worker import json_problem  # pure, and pytest-free for the ranks
from pytest_gpumem.errors import GpuMemError, one_line
from pytest_gpumem.outcome import status_of, with_pytest
from pytest_gpumem.reasons import Unmeasurable
from pytest_gpumem.report.failures import plain_line
from pytest_gpumem.results import REPORT_ATTRIBUTE, Phases, Status, TestResult
from pytest_gpumem.results.test_result import REPORT_NAMES


def hand_over(item: pytest.Item, result: TestResult, report: pytest.TestReport) -> TestResult:
    """The measured test's final result, which replaces `result` in the run's: its status settled with
    pytest's verdict, then what the result hook made of it; sent along with the report (JSON text in an
    attribute that xdist hands to the controller test by test and --junitxml does not print; the JUnit
    properties are the short ones)."""
    result = agree_with_pytest(result, report)
    if item.config.hook.pytest_gpumem_result.get_hookimpls():
        result, text = _after_hook(item, result, report)
    else:
        text = json.dumps(result.to_json(), allow_nan=False)
    setattr(report, REPORT_ATTRIBUTE, text)
    properties = junit_properties(result)
    report.user_properties += properties
    # the teardown report, which --junitxml reads, copies the item's; a rerun replaces them
    item.user_properties[:] = [p for p in item.user_properties if not str(p[0]).startswith("gpumem")]
    item.user_properties += properties
    return result


_JSON_FIELDS = ("info", "budget_limits", "distributed", "simulated")  # a result's fields in JSON types


class ResultDraft(TestResult):
    """The copy of a result that a `pytest_gpumem_result` hook is handed: the hook may set its fields by
    their names in the report (a status as its word) and change its lists and dicts, and what it leaves
    becomes the result that replaces the original; the original is never changed."""

    _named: dict[str, Any]  # every field by its name in the report

    def __init__(self, named: dict[str, Any]) -> None:
        object.__setattr__(self, "_named", named)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # a field's property sets it; any other name is the hook's own

    @classmethod
    def copy_of(cls, result: TestResult) -> ResultDraft:
        """A copy of `result` that shares nothing the hook can change (what it holds in JSON types is copied
        through JSON)."""
        named = result.named()
        for name, value in named.items():
            if name in _JSON_FIELDS:
                named[name] = json.loads(json.dumps(value))
            elif isinstance(value, tuple):
                named[name] = list(copy.deepcopy(value))
            elif isinstance(value, Phases):
                named[name] = dict(value)
        return cls(named)

    def named(self) -> dict[str, Any]:
        return dict(self._named)

    def final(self) -> TestResult:
        return TestResult.of(**self._named)


def _draft_field(name: str) -> property:
    def get(draft: ResultDraft) -> Any:
        return draft._named[name]

    def set_(draft: ResultDraft, value: object) -> None:
        draft._named[name] = Status.of(value) if name == "status" else value

    return property(get, set_)


def _read_only(name: str, get: Callable[[ResultDraft], Any]) -> property:
    """A property a hook may read and not set, named in the error as Python names a property's own."""

    def refuse(draft: ResultDraft, value: object) -> None:
        raise AttributeError(f"property {name!r} of 'ResultDraft' object has no setter")

    return property(get, refuse)


def _draft_part(name: str) -> property:
    return _read_only(name, lambda draft: getattr(draft.final(), name))


def _draft_peak(draft: ResultDraft) -> int | None:
    call = draft._named["call"]
    return None if call is None else call.peak_bytes


for _name in REPORT_NAMES:
    setattr(ResultDraft, _name, _draft_field(_name))
for _name in ("record", "outcome", "budget", "entry"):
    setattr(ResultDraft, _name, _draft_part(_name))
setattr(ResultDraft, "peak_bytes", _read_only("peak_bytes", _draft_peak))  # noqa: B010 (the result's is a part's)


def _after_hook(item: pytest.Item, result: TestResult, report: pytest.TestReport) -> tuple[TestResult, str]:
    """Call `pytest_gpumem_result` with a copy of the settled result; the result it leaves, and its JSON
    text. A hook that raises or leaves what the report cannot hold fails this one test in one line (a test
    that failed on its own keeps its failure, the line beside it); the result stays what it was before the
    hook, and the run's other tests, its report and its files carry on."""
    draft = ResultDraft.copy_of(result)
    try:
        item.config.hook.pytest_gpumem_result(item=item, result=draft)
        return _checked(draft)
    except pytest.exit.Exception:
        raise
    except ModelError as exc:  # e.g. a status that is none of ours, or a value JSON cannot hold
        refused, trace = Unmeasurable(item.nodeid, f"pytest_gpumem_result: {exc}"), None
    except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
        refused = Unmeasurable(item.nodeid, f"pytest_gpumem_result raised {one_line(exc)}")
        trace = _hook_traceback(exc)
    problem = plain_line(refused).line
    if report.failed:  # failed on its own: pytest shows that failure, the hook's line beside it
        report.sections.append(("Captured gpumem hook call", problem if trace is None else f"{problem}\n{trace}"))
    else:
        result = result.replaced(status=status_of(refused), message=problem, baseline_entry=None)
        _fail_report(report, problem, trace)
    return result, json.dumps(result.to_json(), allow_nan=False)


def _hook_traceback(exc: BaseException) -> str:
    """The traceback of an exception the hook raised, from the hook's own frames (not ours or pluggy's)."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or str(tb.tb_frame.f_globals.get("__name__")).startswith("pluggy")
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _checked(draft: ResultDraft) -> tuple[TestResult, str]:
    """The result the hook left and its JSON text, or a `GpuMemError` saying what in it JSON (or the xdist
    controller, which reads it back) cannot hold."""
    if not isinstance(draft.info, dict):
        raise GpuMemError(f"result.info was set to a {type(draft.info).__name__}, not a dict")
    try:
        result = draft.final()
        data = result.to_json()
    except Exception as exc:
        raise GpuMemError(f"the result cannot be written: {one_line(exc)}") from None
    try:
        text = json.dumps(data, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        found = next(filter(None, (json_problem(value, f"result.{key}") for key, value in data.items())), None)
        raise GpuMemError(found or f"the result cannot be written as JSON: {one_line(exc)}") from None
    try:
        TestResult.from_json(json.loads(text))
    except Exception as exc:
        raise GpuMemError(f"the result cannot be read back from its JSON: {one_line(exc)}") from None
    return result, text


def _fail_report(report: pytest.TestReport, line: str, trace: str | None) -> None:
    """Turn the call's report into a failure shown as `line` (and the hook's traceback, when it raised)."""
    report.outcome = "failed"
    report.longrepr = line
    if hasattr(report, "wasxfail"):
        del report.wasxfail  # an xfail's report that failed for the hook is a failure, not an XPASS
    if trace is not None:
        report.sections.append(("Captured gpumem hook traceback call", trace))


def agree_with_pytest(result: TestResult, report: pytest.TestReport) -> TestResult:
    """`result` agreeing with pytest's verdict on the call (`report`): a test that failed for a reason the
    measurement did not see (a unittest body, an xfail) is not `ok`, and only a test that passed records
    its figures as a baseline."""
    expected_failure = hasattr(report, "wasxfail")
    status = with_pytest(result.status, report.failed, report.skipped, expected_failure)
    message = result.message
    if status != result.status and status == Status.ERROR:
        message = _first_line(str(report.longreprtext)) or "the test failed"
    entry = result.baseline_entry if report.passed and not expected_failure else None
    if (status, message, entry) == (result.status, result.message, result.baseline_entry):
        return result
    return result.replaced(status=status, message=message, baseline_entry=entry)


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[0].removeprefix("E ").strip()


_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\u007e\u0080-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""What XML 1.0 cannot carry (and DEL), as pytest's junitxml sees it: control characters, NUL, lone
surrogates, U+FFFE and U+FFFF."""


def _xml_text(text: str) -> str:
    """`text` with each character XML cannot carry shown as `#xHH` (`#xHHHH` above 0xFF), every other
    character kept: what pytest's junitxml does to a property's value but not to its name."""
    return _NOT_XML.sub(lambda m: f"#x{ord(m.group()):02X}", text)


def junit_properties(result: TestResult) -> list[tuple[str, str]]:
    """What `--junitxml` shows of a measured test: its status and peaks in bytes, per phase (a phase's
    name with what XML cannot carry written as `#xHH`, so that the run's XML stays readable)."""
    properties = [("gpumem_status", result.status.value)]
    if result.call is not None:
        properties.append(("gpumem_peak_bytes", str(result.call.peak_bytes)))
    properties += [
        (_xml_text(f"gpumem_peak_bytes[{name}]"), str(phase.peak_bytes)) for name, phase in result.phases.items()
    ]
    return properties
