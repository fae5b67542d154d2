"""Judging a measured test without pytest, the one place its status is decided: `judge` gives the status
and the reasons of a call from its record, its budget, its leak limit and its baseline's comparison (or from
what stopped it); `with_pytest` settles that status with pytest's verdict; `result_of` builds the test's
result from the record and the outcome. Reasons are phrased by `report/failures.py`."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cuda_allocator_model import exception_text
from pytest_gpumem.errors import one_line
from pytest_gpumem.measure.oom_and_leaks import is_out_of_memory, needs_real_values, uninitialized_in_ours
from pytest_gpumem.measure.regions import phase_left_by
from pytest_gpumem.reasons import (
    AllocatorState,
    Leaked,
    OutOfMemory,
    OverBudget,
    Raised,
    Reason,
    Regressed,
    Unmeasurable,
)
from pytest_gpumem.results import BudgetView, Outcome, Status, TestResult, WrittenRecord, first_of

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.report.failures import FailureLine
    from pytest_gpumem.results.baseline import Entry, Verdict


class _Compared(Protocol):
    """A test's comparison with its baseline (`pytest_gpumem.run.judgement.Judgement`)."""

    @property
    def verdict(self) -> Verdict: ...
    @property
    def entry(self) -> Entry: ...
    @property
    def fails(self) -> bool: ...
    def failure_message(self) -> str: ...


@dataclass(frozen=True)
class Judged:
    """A measured test's status and why it failed (the first reason is its line; none when it passes)."""

    status: Status
    reasons: tuple[Reason, ...] = ()

    @property
    def reason(self) -> Reason | None:
        return self.reasons[0] if self.reasons else None


_FAILS_AS = {
    OverBudget: Status.OVER_BUDGET,
    Leaked: Status.LEAKED,
    OutOfMemory: Status.OUT_OF_MEMORY,
    Unmeasurable: Status.ERROR,
    Raised: Status.ERROR,
}


def status_of(reason: Reason) -> Status:
    """The status a test fails with for `reason` (a baseline's, the one its verdict said)."""
    return reason.status if isinstance(reason, Regressed) else _FAILS_AS[type(reason)]


def judge(
    record: CallRecord,
    budget: Budget | None,
    leak: Limit | None,
    compared: _Compared | None,
    stopped: Reason | None = None,
) -> Judged:
    """The outcome of a measured call. A call `stopped` for a reason (out of memory, an error of its own or
    of its measurement) fails for that reason alone; a call that ran to the end fails for each of its budget,
    its leak limit and its baseline that it passed, in that order (the status of the first, `PRECEDENCE`'s
    order), and is OK, NEW or IMPROVED when none fails it."""
    if stopped is not None:
        return Judged(status_of(stopped), (stopped,))
    verdict = None if compared is None else compared.verdict
    found = [_over_budget(record, budget), _leaked(record, leak), _regressed(compared)]
    reasons = tuple(reason for reason in found if reason is not None)
    statuses = [status_of(reason) for reason in reasons]
    statuses += [Status.OK] if verdict is None else [verdict_status(verdict)]
    return Judged(first_of(statuses), reasons)


def _over_budget(record: CallRecord, budget: Budget | None) -> OverBudget | None:
    over = [] if budget is None else budget.violations(record.call, record.phases)
    return OverBudget(tuple(over)) if over else None


def _leaked(record: CallRecord, leak: Limit | None) -> Leaked | None:
    net = record.call.net_bytes
    return Leaked(net, leak) if leak is not None and net > leak.bytes else None


def _regressed(compared: _Compared | None) -> Regressed | None:
    """The baseline's reason, when its comparison fails the test: its problems, and how to learn more."""
    if compared is None or not compared.fails:
        return None
    message = compared.failure_message()
    problems = compared.verdict.problems
    how = message.removeprefix(compared.verdict.failure_message())
    return Regressed(verdict_status(compared.verdict), problems, message, how)


def verdict_status(verdict: Verdict) -> Status:
    """The report's word for a baseline verdict: a test without a baseline is ``NEW`` when that passes,
    ``MISSING BASELINE`` when it fails (``--gpumem-strict``, also for a phase or gradients without one)."""
    from pytest_gpumem.results.baseline import BaselineStatus

    said = [
        (verdict.status == BaselineStatus.REGRESSED, Status.REGRESSED),
        (verdict.gradient_status == BaselineStatus.CHANGED, Status.GRADIENTS_CHANGED),
        (verdict.failed, Status.MISSING_BASELINE),  # what else fails a verdict: something without a baseline
        (verdict.status == BaselineStatus.IMPROVED, Status.IMPROVED),
        (verdict.status == BaselineStatus.NEW, Status.NEW),
    ]
    return first_of([status for applies, status in said if applies] + [Status.OK])


def unmeasurable(record: CallRecord, budget: Budget | None) -> Unmeasurable | None:
    """Why a call that ran to the end cannot be judged: an info JSON cannot hold, or a budget on a phase
    that the test never opened."""
    bad_info = _not_json(record.info)
    if bad_info:
        why = f"gpumem.info must be a dict of JSON values (str, numbers, lists, dicts): {bad_info}"
        return Unmeasurable(record.nodeid, why)
    unopened = [] if budget is None else budget.unopened(record.phases)
    if unopened:
        opened = ", ".join(record.phases) or "none"
        why = f"max_memory names phase {unopened[0]!r} that the test never opened (opened: {opened})"
        return Unmeasurable(record.nodeid, why)
    return None


def out_of_memory(exc: BaseException, capacity: Limit | None) -> OutOfMemory:
    """What an out-of-memory error says of itself: the phase it left, what it asked for, the allocator's
    state (where the tracker models the CUDA allocator); `capacity` is the limit the test ran under."""
    asked = re.search(r"[Tt]ried to allocate ([\d.,]+ ?[KMGTP]?i?B)", exception_text(exc))
    error = getattr(exc, "allocator_error", None)
    state = None if error is None else AllocatorState(error.reserved, error.allocated, error.requested)
    return OutOfMemory(phase_left_by(exc), asked.group(1) if asked else None, capacity, state)


def stopped_by(exc: BaseException, nodeid: str, device: object, capacity: Limit | None) -> Reason:
    """Why a call stopped on `exc`: out of memory, a measurement that cannot go on (an op on the meta
    device that needs real values, an uninitialized Lazy module met in our code), else the test's own error."""
    if is_out_of_memory(exc):
        return out_of_memory(exc, capacity)
    unmeasured = needs_real_values(exc, device) or uninitialized_in_ours(exc)
    return Raised(one_line(exc)) if unmeasured is None else Unmeasurable(nodeid, unmeasured)


def with_pytest(status: Status, failed: bool, skipped: bool, expected_failure: bool) -> Status:
    """The measured status settled with pytest's verdict on the call: a test that failed for a reason the
    measurement did not see (a unittest body, a strict XPASS) is an error, an xfail that failed `xfailed`,
    one that passed `XPASS`."""
    if failed and status.passing:
        return Status.ERROR
    if expected_failure and skipped:
        return Status.XFAILED
    if expected_failure and status.passing:
        return Status.XPASS
    return status


def _not_json(info: object) -> str | None:
    """Why `info` cannot travel as JSON (to the report, the file, the xdist controller), or None."""
    if not isinstance(info, dict):
        return f"it was set to a {type(info).__name__}, not a dict"
    try:
        json.dumps(info, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return str(exc)
    return None


def _plain_info(info: object) -> dict[str, Any]:
    """`info` in plain JSON types (a torch.Size becomes a list, a numpy float a float), or a description."""
    if _not_json(info) is None:
        plain: dict[str, Any] = json.loads(json.dumps(info, allow_nan=False))
        return plain
    try:
        text = repr(info)
    except Exception:
        text = f"<{type(info).__name__} whose repr raised>"
    return {"unreadable": text[:1000]}


def written(record: CallRecord) -> WrittenRecord:
    """What the result holds of `record`: every field its report writes, as the record holds it, but the
    test's `info`, in plain JSON types (a field added to `WrittenRecord` takes no line here)."""
    kept = {field.name: getattr(record, field.name) for field in dataclasses.fields(WrittenRecord)}
    return WrittenRecord(**{**kept, "info": _plain_info(record.info)})


def result_of(
    record: CallRecord,
    judged: Judged,
    failure: FailureLine | None,
    budget: Budget | None,
    compared: _Compared | None,
    worker_device: str | None,
) -> TestResult:
    """The test's result, from its record, how it was judged and the line of its first reason (`failure`,
    as `report/` phrased it)."""
    return TestResult(
        written(record),
        Outcome(judged.status, None if failure is None else failure.line, () if failure is None else failure.detail),
        BudgetView() if budget is None else BudgetView(budget.to_json(), budget.describe()),
        verdict=None if compared is None else compared.verdict,
        entry=None if compared is None else compared.entry,
        worker_device=worker_device,
    )


def unmeasured_result(backend: str, reason: Unmeasurable, failure: FailureLine) -> TestResult:
    """The result of a test whose call could not be measured at all (a value the allocator's model refused
    before the call began): no figures, its line."""
    return TestResult.of(reason.nodeid, backend, "", None, status=status_of(reason), message=failure.line)
