"""Judging a measured call that ran to the end, without pytest: its record, its budget, its leak limit and
its comparison with a baseline give its status and failure line (`judge`); the record and the outcome give
the test's result (`result_of`), the one place one is built from a measurement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pytest_gpumem.explain.text import made_of, over_limit
from pytest_gpumem.report import failures
from pytest_gpumem.report.advice_text import advice_clause
from pytest_gpumem.report.failures import FailureLine, budget_line, leak_message
from pytest_gpumem.results import Status, TestResult

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.results.baseline import Entry, Verdict


class _Compared(Protocol):
    """A test's comparison with its baseline (`pytest_gpumem.run.regression.Judgement`)."""

    @property
    def verdict(self) -> Verdict: ...
    @property
    def entry(self) -> Entry: ...
    @property
    def fails(self) -> bool: ...
    def failure_message(self) -> str: ...


@dataclass(frozen=True)
class Outcome:
    """A measured test's status and its failure line (None when it passes)."""

    status: Status
    failure: FailureLine | None = None

    @property
    def message(self) -> str | None:
        return None if self.failure is None else self.failure.line

    @property
    def detail(self) -> tuple[str, ...]:
        return () if self.failure is None else self.failure.detail


def judge(record: CallRecord, budget: Budget | None, leak: Limit | None, compared: _Compared | None) -> Outcome:
    """The outcome of a call that ran to the end: over its budget first, then a leak past `leak`, then
    its baseline's verdict; OK when none of them fails it."""
    call, phases = record.call, record.phases
    over = [] if budget is None else budget.violations(call, phases)
    if over:
        advised = advice_clause(record.advice, budget, call, phases)
        made = made_of(record.explanation, over_limit(budget, call, phases)) if not advised else ""
        return Outcome(Status.OVER_BUDGET, budget_line(over, made, advised))
    if leak is not None and call.net_bytes > leak.bytes:
        return Outcome(Status.LEAKED, leak_message(record, leak, call.net_bytes))
    if compared is not None:
        return Outcome(verdict_status(compared.verdict), _verdict_line(compared) if compared.fails else None)
    return Outcome(Status.OK)


def verdict_status(verdict: Verdict) -> Status:
    """The report's word for a baseline verdict: a test without a baseline is ``NEW`` when that passes,
    ``MISSING BASELINE`` when it fails (``--gpumem-strict``, also for a phase or gradients without one)."""
    from pytest_gpumem.results.baseline import BaselineStatus

    if verdict.status == BaselineStatus.REGRESSED:
        return Status.REGRESSED
    if verdict.gradient_status == BaselineStatus.CHANGED:
        return Status.GRADIENTS_CHANGED
    if verdict.failed:  # what else fails a verdict: something without a baseline, under strict
        return Status.MISSING_BASELINE
    if verdict.status == BaselineStatus.IMPROVED:
        return Status.IMPROVED
    return Status.NEW if verdict.status == BaselineStatus.NEW else Status.OK


def _verdict_line(compared: _Compared) -> FailureLine:
    """The baseline's line: its first problem and how to learn what grew, the others as they fit."""
    problems, message = compared.verdict.problems, compared.failure_message()
    if not problems:
        return FailureLine(message)
    return failures.verdict_line(problems, message.removeprefix(compared.verdict.failure_message()))


def result_of(
    record: CallRecord,
    outcome: Outcome,
    budget: Budget | None,
    compared: _Compared | None,
    info: dict[str, object],
    worker_device: str | None,
) -> TestResult:
    """The test's result, from its record and outcome (`info`: the record's, in plain JSON types)."""
    return TestResult(
        nodeid=record.nodeid,
        backend=record.backend,
        device=record.device,
        call=record.call,
        phases=dict(record.phases),
        budget_limits=None if budget is None else budget.to_json(),
        budget_text=None if budget is None else budget.describe(),
        status=outcome.status,
        message=outcome.message,
        detail=list(outcome.detail),
        info=info,
        verdict=None if compared is None else compared.verdict,
        baseline_entry=None if compared is None else compared.entry,
        notes=list(record.notes),
        worker_device=worker_device,
        explanation=record.explanation,
        fits=[fit.describe() for fit in record.fits],
        advice=record.advice,
        distributed=[world.summary() for world in record.worlds],
        simulated=[rank.to_json() for rank in record.simulated],
    )
