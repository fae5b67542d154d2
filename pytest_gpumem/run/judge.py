"""Judging one measured test: its budget, how its call ended (out of memory, a leak, an error of its
own), its baseline, and the result it leaves for the report, the hooks and the xdist controller."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

import pytest

from cuda_allocator_model import ModelError
from pytest_gpumem.budget import MARKER, Budget, all_of, budget_from_marker, closest_first
from pytest_gpumem.errors import GpuMemError, GpuMemWarning
from pytest_gpumem.measure.oom_and_leaks import release_memory
from pytest_gpumem.measure.terms import Terms
from pytest_gpumem.outcome import Judged, judge, result_of, stopped_by, unmeasurable, unmeasured_result
from pytest_gpumem.reasons import OutOfMemory, Raised, Reason, Unmeasurable
from pytest_gpumem.report import failures
from pytest_gpumem.report.failures import FailureLine
from pytest_gpumem.results import PhaseResult, TestResult
from pytest_gpumem.run import test_files
from pytest_gpumem.run.hand_over import hand_over
from pytest_gpumem.run.late_markers import device_too_late
from pytest_gpumem.run.session import JUDGE, MEASUREMENT_KEY, GpuMemSession

if TYPE_CHECKING:
    from pytest_gpumem.config import Options
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.run.judgement import Judgement

_RESULT_KEY = pytest.StashKey[TestResult]()  # the call's result, until its report is made


def measure_calls(session: GpuMemSession) -> None:
    """Wrap test calls from now on (registered only in runs that measure: the others pay nothing)."""
    if not session.measuring:
        session.config.pluginmanager.register(Judge(session), JUDGE)


def _budget_of(marks: Sequence[tuple[object, pytest.Mark]]) -> Budget | None:
    """The test's budget from its max_memory markers (closest level first)."""
    levels: dict[int, list[Budget]] = {}
    for node, mark in marks:
        levels.setdefault(id(node), []).append(budget_from_marker(mark.args, mark.kwargs))
    return closest_first([all_of(budgets) for budgets in levels.values()]) if levels else None


def _with_default(budget: Budget | None, default: Budget | None) -> Budget | None:
    """The suite-wide default limit applies to a test whose markers set no limit (a tolerance alone
    is not a limit)."""
    if default is None or (budget is not None and (budget.total is not None or budget.phases)):
        return budget
    return default if budget is None else dataclasses.replace(budget, total=default.total)


def _terms_of(options: Options, budget: Budget | None) -> Terms:
    """What the test runs on beyond its peaks, from its budget and the run's options."""
    evidence = options.snapshot_dir is not None
    return Terms.of(budget, options.capacity, options.leak, evidence=evidence, explain=options.explain)


def within_slack(call: PhaseResult, phases: Mapping[str, PhaseResult], slack: int) -> bool:
    """Whether the test allocated something and every peak (the call's and each phase's) is at most `slack`
    bytes: a baseline could never fail it, as the slack alone allows that much over any baseline. (A test
    that allocates nothing is left to the comparison, which counts it in the run's summary.)"""
    return 0 < max(phase.peak_bytes for phase in [call, *phases.values()]) <= slack


def _expected(item: pytest.Item, exc: BaseException) -> bool:
    """Whether an xfail marker expects this very exception (then pytest, not the plugin, judges it)."""
    mark = item.get_closest_marker("xfail")
    if mark is None:
        return False
    raises = mark.kwargs.get("raises")
    return raises is None or (isinstance(raises, (type, tuple)) and isinstance(exc, raises))


def _fail(message: str) -> NoReturn:
    """Fail the test with our one line. Not hidden: when every frame of a failure is hidden (the call
    wrappers hide theirs), pytest adds a line about `--full-trace` under it."""
    pytest.fail(message, pytrace=False)


def _warn_notes(item: pytest.Item, notes: list[str]) -> None:
    """Each thing the measurement could not see, as a warning at the test's own line."""
    path, line = item.location[0], (item.location[1] or 0) + 1
    for note in notes:
        warnings.warn_explicit(GpuMemWarning(f"{item.nodeid}: {note}"), GpuMemWarning, path, line)


class Judge:
    """Measures and judges the calls of the tests that ask for it; registered only in runs that measure."""

    def __init__(self, session: GpuMemSession) -> None:
        self.session = session
        self.files = test_files.chosen(session.options)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        """Measure the call of a test that asks for it (a max_memory marker or the gpumem fixture), or
        of every test under --gpumem-all."""
        __tracebackhide__ = True  # the test's own failure shows the test's frames, not this wrapper's
        session = self.session
        marks = list(item.iter_markers_with_node(MARKER))
        asked = bool(marks) or MEASUREMENT_KEY in item.stash  # else measured only for --gpumem-all
        if not asked and not session.options.measure_all:
            return (yield)
        try:
            budget = _with_default(_budget_of(marks), session.options.default_budget)
            measured = session.measurement(item)
            late = device_too_late(item, measured)
            if late is not None:
                raise GpuMemError(late)
            terms = _terms_of(session.options, budget)
            measured.backend.predict_card(terms.card)  # before the baseline is looked up: its identity names the card
            terms = terms.explaining(session.baselines.explains(item.nodeid, measured.backend))
            measured.set_up(terms)
        except ModelError as exc:
            refused = Unmeasurable(item.nodeid, str(exc))
        else:
            return (yield from self._measured(item, measured, budget, terms, asked))
        failure = failures.plain_line(refused)
        self._keep(item, unmeasured_result(session.backend_name, refused, failure))
        _fail(failure.line)

    def _measured(
        self, item: pytest.Item, measured: Measurement, budget: Budget | None, terms: Terms, asked: bool
    ) -> Generator[None, object, object]:
        __tracebackhide__ = True
        measured.begin()
        test_files.begin(self.files, item, measured, self.session.problems)
        try:
            outcome = yield
        except ModelError as exc:
            stopped: Reason = Unmeasurable(item.nodeid, str(exc))
        except (pytest.skip.Exception, pytest.xfail.Exception):
            measured.end()
            raise
        except BaseException as exc:
            stopped = stopped_by(exc, measured.nodeid, measured.device, terms.capacity)
            if isinstance(stopped, Raised):  # the test's own error: pytest shows it, as unmeasured
                try:
                    self._stopped(item, measured, budget, stopped)
                finally:
                    measured.end_if_running()
                raise
            if _expected(item, exc):  # xfail(raises=...): the test behaves as it does unmeasured
                self._stopped(item, measured, budget, stopped)
                raise
            exc.__traceback__ = None  # its frames hold the test's tensors
        else:
            self._judge(item, measured, budget, terms, asked)
            return outcome
        if isinstance(stopped, OutOfMemory):
            release_memory()
        record, failure = self._stopped(item, measured, budget, stopped)
        detail = failure.section() + "\n" + failures.breakdown(record.call, record.phases)
        if detail:
            item.add_report_section("call", "gpumem", detail.removeprefix("\n"))
        _fail(failure.line)

    def _judge(
        self, item: pytest.Item, measured: Measurement, budget: Budget | None, terms: Terms, asked: bool
    ) -> None:
        record = measured.end()
        refused = unmeasurable(record, budget)
        judgement = None if refused is not None else self._baseline(measured, record, budget, asked)
        judged = judge(record, budget, terms.leak, judgement, refused)
        failure = _line(judged, record, budget)
        if refused is None and (budget is not None or judgement is not None or judged.reasons or _has_detail(record)):
            messages = () if judgement is None else judgement.verdict.messages
            item.add_report_section("call", "gpumem", failures.report_section(record, messages, failure))
        self._finish(item, record, budget, judged, failure, judgement)
        if failure is not None and failure.line:
            _fail(failure.line)

    def _baseline(
        self, measured: Measurement, record: CallRecord, budget: Budget | None, asked: bool
    ) -> Judgement | None:
        """The test's comparison with its baseline, None without baselines. A test measured only for
        --gpumem-all whose peaks all stay within the slack needs none (also under --gpumem-strict), and
        records none; a test that asked to be measured (marker, fixture) is compared whatever its size."""
        baselines = self.session.baselines
        if not baselines.active:
            return None
        if not asked and within_slack(record.call, record.phases, baselines.options.slack):
            return None
        return baselines.judge(record, measured.backend, budget)

    def _stopped(
        self, item: pytest.Item, measured: Measurement, budget: Budget | None, reason: Reason
    ) -> tuple[CallRecord, FailureLine]:
        """End the call that `reason` stopped and keep its result; its record and its line."""
        record = measured.end()
        judged = judge(record, budget, None, None, reason)
        failure = failures.failure_line(reason, record, budget)
        self._finish(item, record, budget, judged, failure)
        return record, failure

    def _finish(
        self,
        item: pytest.Item,
        record: CallRecord,
        budget: Budget | None,
        judged: Judged,
        failure: FailureLine | None,
        judgement: Judgement | None = None,
    ) -> None:
        """Keep the test's result and its files."""
        assignment = self.session.assignment
        worker_device = None if assignment is None else assignment.describe()
        result = result_of(record, judged, failure, budget, judgement, worker_device)
        session = self.session
        measured = session.measurement(item)
        result = test_files.write(self.files, item, measured, result, record, session.config.rootpath, session.problems)
        self._keep(item, result)
        _warn_notes(item, list(result.notes))  # with the files' notes; after: `filterwarnings = error` fails here

    def _keep(self, item: pytest.Item, result: TestResult) -> None:
        """The result joins the run's and waits for its report, where pytest's verdict settles it and the
        hook sees it (`pytest_runtest_makereport`)."""
        self.session.add(result)
        item.stash[_RESULT_KEY] = result

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """The call's report carries the measured test's final result (`hand_over`), which replaces the one
        the run kept when the call ended."""
        report = yield
        result = item.stash.get(_RESULT_KEY, None)
        if result is not None and report.when == "call":
            del item.stash[_RESULT_KEY]
            self.session.add(hand_over(item, result, report))
        return report


def _line(judged: Judged, record: CallRecord, budget: Budget | None) -> FailureLine | None:
    """The line of its first reason, as `report/` phrases it (None when it passes)."""
    return None if judged.reason is None else failures.failure_line(judged.reason, record, budget)


def _has_detail(record: CallRecord) -> bool:
    """Whether the measurement has something to say beyond a budget or a verdict."""
    return bool(record.notes or record.explanation or record.advice)
