"""A measured test's result handed over with its report: settled with pytest's verdict, shown to the
`pytest_gpumem_result` hook (and rolled back when the hook breaks it), sent to the xdist controller as JSON text
on the report, and written as JUnit properties."""

from __future__ import annotations

import json
import re
import traceback

import pytest

from cuda_allocator_model import ModelError
from pytest_gpumem.distributed.worker import json_problem  # pure, and pytest-free for the ranks
from pytest_gpumem.errors import GpuMemError, one_line
from pytest_gpumem.results import REPORT_ATTRIBUTE, Status, TestResult


def settle(item: pytest.Item, result: TestResult, report: pytest.TestReport) -> None:
    """Settle the measured test's status with pytest's verdict, hand the final result to the hook, and
    send it along with the report (JSON text in an attribute that xdist hands to the controller test
    by test and --junitxml does not print; the JUnit properties are the short ones)."""
    agree_with_pytest(result, report)
    text = json.dumps(result.to_json(), allow_nan=False)
    if item.config.hook.pytest_gpumem_result.get_hookimpls():
        text = _after_hook(item, result, report, text)
    setattr(report, REPORT_ATTRIBUTE, text)
    properties = junit_properties(result)
    report.user_properties += properties
    # the teardown report, which --junitxml reads, copies the item's; a rerun replaces them
    item.user_properties[:] = [p for p in item.user_properties if not str(p[0]).startswith("gpumem")]
    item.user_properties += properties


def _after_hook(item: pytest.Item, result: TestResult, report: pytest.TestReport, before: str) -> str:
    """Call `pytest_gpumem_result` with the settled result and return the result's JSON text. A hook that
    raises or leaves what the report cannot hold fails this one test in one line (a test that failed on
    its own keeps its failure, the line beside it); the result goes back to what it was before the hook,
    and the run's other tests, its report and its files carry on."""
    try:
        item.config.hook.pytest_gpumem_result(item=item, result=result)
        return _checked(result)
    except pytest.exit.Exception:
        raise
    except ModelError as exc:  # e.g. a status that is none of ours, or a value JSON cannot hold
        problem, trace = f"{item.nodeid}: pytest_gpumem_result: {exc}", None
    except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
        problem = f"{item.nodeid}: pytest_gpumem_result raised {one_line(exc)}"
        trace = _hook_traceback(exc)
    for name, value in vars(TestResult.from_json(json.loads(before))).items():
        setattr(result, name, value)  # in place: the run's results hold this very object
    if report.failed:  # failed on its own: pytest shows that failure, the hook's line beside it
        report.sections.append(("Captured gpumem hook call", problem if trace is None else f"{problem}\n{trace}"))
    else:
        result.status, result.message, result.baseline_entry = Status.ERROR, problem, None
        _fail_report(report, problem, trace)
    return json.dumps(result.to_json(), allow_nan=False)


def _hook_traceback(exc: BaseException) -> str:
    """The traceback of an exception the hook raised, from the hook's own frames (not ours or pluggy's)."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or str(tb.tb_frame.f_globals.get("__name__")).startswith("pluggy")
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _checked(result: TestResult) -> str:
    """The result's JSON text, or a `GpuMemError` saying what in it JSON (or the xdist controller, which
    reads it back) cannot hold."""
    if not isinstance(result.info, dict):
        raise GpuMemError(f"result.info was set to a {type(result.info).__name__}, not a dict")
    try:
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
    return text


def _fail_report(report: pytest.TestReport, line: str, trace: str | None) -> None:
    """Turn the call's report into a failure shown as `line` (and the hook's traceback, when it raised)."""
    report.outcome = "failed"
    report.longrepr = line
    if hasattr(report, "wasxfail"):
        del report.wasxfail  # an xfail's report that failed for the hook is a failure, not an XPASS
    if trace is not None:
        report.sections.append(("Captured gpumem hook traceback call", trace))


def agree_with_pytest(result: TestResult, report: pytest.TestReport) -> None:
    """Make `result` agree with pytest's verdict on the call (`report`): a test that failed for a reason
    the measurement did not see (a unittest body, an xfail) is not `ok`, and only a test that passed
    records its figures as a baseline."""
    expected_failure = hasattr(report, "wasxfail")
    if report.failed and result.status.passing:
        result.status = Status.ERROR
        result.message = _first_line(str(report.longreprtext)) or "the test failed"
    elif expected_failure and report.skipped:
        result.status = Status.XFAILED
    elif expected_failure and result.status.passing:
        result.status = Status.XPASS
    if not report.passed or expected_failure:
        result.baseline_entry = None


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
