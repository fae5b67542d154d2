"""The one line a measured test fails with, and what of it goes to the test's report section.

The rule for every failure line: its first clause says what failed, by how much, the limit it passed and,
for a leak, who holds the memory; then each further clause, most useful first, that still fits in
`LINE_WIDTH` characters. A clause left out is a line of the report section (`also: ...`), unless the
section already says it; figures too long for a line (an allocator's state, survivors by module) are
there anyway."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cuda_allocator_model import format_size
from pytest_gpumem.constants import WORKSPACES_AT_ZERO
from pytest_gpumem.explain.text import made_of_forms, over_limit, wrapped
from pytest_gpumem.explain.text import section as explained
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
from pytest_gpumem.report.advice_text import advice_forms, advice_section

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.results import PhaseResult

LINE_WIDTH = 120  # characters of a failure line: what reads at a glance, in a terminal of 120 columns
ALSO = "also: "  # a detail line holding a clause the one line left out
_JOINERS = ("; ", ", ", ": ")


@dataclass(frozen=True)
class FailureLine:
    """A failure's line and the lines its report section adds (the clauses that did not fit, the
    figures that never do)."""

    line: str
    detail: tuple[str, ...] = ()

    def section(self) -> str:
        return "".join(f"\n{line}" for line in self.detail)


_Clause = str | tuple[str, ...]  # a clause, or its forms from the whole one to the shortest


def fit_line(
    head: str, clauses: Sequence[_Clause], shown: Collection[str] = (), width: int = LINE_WIDTH
) -> FailureLine:
    """`head`, then each clause in turn in the first of its forms that still fits in `width` characters (a
    clause carries its own joiner: '; ...', ', ...', ': ...' or ' (...)'); a clause not there whole is an
    `also:` line of the section, unless it is in `shown` (the section says it already)."""
    line, moved = head, []
    for clause in clauses:
        forms = (clause,) if isinstance(clause, str) else clause
        kept = next((form for form in forms if len(line) + len(form) <= width), "")
        line += kept
        if kept != forms[0] and forms[0] not in shown:
            moved.append(f"{ALSO}{_bare(forms[0])}")
    return FailureLine(line, tuple(moved))


def _bare(clause: str) -> str:
    """A clause on a line of its own: without its joiner, or its parentheses."""
    for joiner in _JOINERS:
        if clause.startswith(joiner):
            return clause[len(joiner) :]
    text = clause.strip()
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def budget_line(violations: Sequence[str], made: _Clause, advised: _Clause, low: bool = False) -> FailureLine:
    """The first limit exceeded (and that its figure is low by what was counted at 0 B, where `low`), then
    what its peak is made of (or how to see it), the advice, and the other limits exceeded."""
    bound = [f", with {WORKSPACES_AT_ZERO}"] if low else []
    return fit_line(violations[0], [*bound, made, advised, *(f"; {v}" for v in violations[1:])])


def verdict_line(problems: Sequence[str], how: str) -> FailureLine:
    """The first problem against the baseline, what grew, how to learn more, then the other problems
    (each problem, what grew with it, is a line of the section already)."""
    head, grew = _growth_apart(problems[0])
    others = [f"; {p}" for p in problems[1:]]
    return fit_line(head, [_shorter(grew), how, *others], shown=[grew, *others])


def _growth_apart(problem: str) -> tuple[str, str]:
    """'call peak 4.3 MiB is 277.2% above baseline 1.1 MiB (tolerance 5%)' and ': h.0 +1.5 MiB: ...', the
    module groups that grew, which `baselines.compare.with_growth` adds after the tolerance."""
    start = problem.find(" (tolerance ")
    end = problem.find(")", start) + 1 if start >= 0 else 0
    return (problem[:end], problem[end:]) if end and problem.startswith(": ", end) else (problem, "")


def _shorter(grew: str) -> tuple[str, ...]:
    """What grew (': h.* +1.5 MiB (12 blocks): gradients +1.0 MiB, ...; head +1.0 MiB, ...'), then the
    group that grew most with its parts, then that group alone."""
    if not grew:
        return ("",)
    groups = grew.removeprefix(": ").split("; ")
    more = "; ..." if len(groups) > 1 else ""
    depth, cut = 0, len(groups[0])
    for at, char in enumerate(groups[0]):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and groups[0].startswith((": ", ", "), at):
            cut = at
            break
    return grew, f": {groups[0]}{more}", f": {groups[0][:cut]}, ..."


def failure_line(reason: Reason, record: CallRecord, budget: Budget | None) -> FailureLine:
    """The one line of a test that failed for `reason`, and what its report section adds, read from the
    call's `record`."""
    if isinstance(reason, OverBudget):
        return _over_budget_line(reason, record, budget)
    if isinstance(reason, Leaked):
        return leak_message(record, reason.limit, reason.net)
    if isinstance(reason, OutOfMemory):
        return out_of_memory_message(record, budget, reason)
    return plain_line(reason)


def plain_line(reason: Unmeasurable | Raised | Regressed) -> FailureLine:
    """The line of a reason that needs no record (a test that could not be measured has none)."""
    if isinstance(reason, Unmeasurable):
        return FailureLine(f"{reason.nodeid}: {reason.why}")
    if isinstance(reason, Raised):
        return FailureLine(reason.line)
    return verdict_line(reason.problems, reason.how) if reason.problems else FailureLine(reason.message)


def _over_budget_line(reason: OverBudget, record: CallRecord, budget: Budget | None) -> FailureLine:
    """The first limit exceeded, then the advice or what made the peak, then the other limits."""
    call, phases = record.call, record.phases
    advised = advice_forms(record.advice, budget, call, phases)
    made = made_of_forms(record.explanation, over_limit(budget, call, phases)) if not advised[0] else ""
    low = any(note.startswith(WORKSPACES_AT_ZERO) for note in record.notes)
    return budget_line(reason.violations, made, advised, low)


def out_of_memory_message(record: CallRecord, budget: Budget | None, oom: OutOfMemory) -> FailureLine:
    """Where it ran out, what it asked for, the peak so far, and the limit it hit (the capacity the test
    ran under, or the device's own memory); then that it is a prediction (on meta), fragmentation when the
    allocator's model saw it, the budget when it was already over, and the advice. The allocator's state
    is a line of the section."""
    where = f"in {oom.phase}" if oom.phase else "in the call"
    capacity = oom.capacity
    limits = ": the device's memory ran out" if capacity is None else f": past {_capacity_hit(budget, capacity)}"
    peak_bytes = record.call.peak_bytes
    peak = format_size(peak_bytes) if capacity is None else capacity.fmt(peak_bytes)
    state, (fragmented, briefly) = _allocator_state(oom.state)
    meta = "; a prediction on meta" if record.device == "meta" else ""
    predicted = (meta, "; on meta") if meta else ""
    head, tried = f"out of memory {where} after a peak of {peak}{limits}", ""
    if oom.tried:
        tried = f"; tried to allocate {oom.tried}"
        whole = f"out of memory {where} (tried to allocate {oom.tried}) after a peak of {peak}{limits}"
        head, tried = (whole, "") if len(whole + meta) <= LINE_WIDTH else (head, tried)
    clauses: list[_Clause] = [
        predicted,
        tried,
        (fragmented, briefly),
        _budget_over(budget, record, oom.phase),
        advice_forms(record.advice, budget, oom=True),
    ]
    found = fit_line(head, clauses, shown=[fragmented])
    return FailureLine(found.line, (*found.detail, *state))


def _allocator_state(error: AllocatorState | None) -> tuple[tuple[str, ...], tuple[str, str]]:
    """Where the tracker models the CUDA allocator: the section's lines of what it held when the new
    segment did not fit, in CUDA's terms, and the line's clause when fragmentation is the cause (the
    reserved but unallocated bytes would hold the request, but no free block does)."""
    if error is None:
        return (), ("", "")
    free = error.reserved - error.allocated
    lines = [
        f"allocator when it ran out: {format_size(error.reserved)} reserved, {format_size(error.allocated)} "
        f"allocated and {format_size(free)} reserved but unallocated"
    ]
    if free < error.requested:
        return tuple(lines), ("", "")
    lines.append(
        f"fragmentation: no free block holds {format_size(error.requested)}, though {format_size(free)} is "
        "reserved but unallocated;"
    )
    lines.append("  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets that memory serve it")
    return tuple(lines), (f"; fragmentation ({format_size(free)} reserved but unallocated)", "; fragmentation")


def _capacity_hit(budget: Budget | None, capacity: Limit) -> str:
    """The limit hit, as the test set it: max_memory(capacity='10 kB'), or the capacity 200MB (--gpumem-capacity) (the
    option's limit is written with its flag already); a card's usable bytes after its name."""
    if budget is not None and budget.capacity is capacity:
        named = f"max_memory(capacity={capacity.written!r})"
    else:
        named = f"the capacity {capacity.written}"
    return named if capacity.card is None else f"{named}, {format_size(capacity.bytes, binary=True)} usable"


def _budget_over(budget: Budget | None, record: CallRecord, phase: str | None) -> str:
    """'; over its budget 100 MB too, at 120.3 MB' when the peak so far already exceeded the limit on the
    phase it ran out in (or on the call)."""
    if budget is None:
        return ""
    if phase is not None and phase in budget.phases and phase in record.phases:
        name, limit, peak = f"{phase}=", budget.phases[phase], record.phases[phase].peak_bytes
    elif budget.total is not None:
        name, limit, peak = "", budget.total, record.call.peak_bytes
    else:
        return ""
    return "" if peak <= limit.bytes else f"; over its budget {name}{limit.written} too, at {limit.fmt(peak)}"


def leak_message(record: CallRecord, leak: Limit, net_bytes: int) -> FailureLine:
    """How much the call left allocated, the limit, and who holds it; then what it is (parameters, saved
    for backward, ...) and the largest survivor. Every survivor is a line of the section, and so is what
    each module's tensors left."""
    holding = record.holding
    held: _Clause = "" if holding is None or not holding.held() else f", {holding.held()}"
    if holding is not None and holding.graph and holding.holder is not None:
        held = (f", {holding.held()}", f", held by a graph kept by {holding.holder}", f", kept by {holding.holder}")
    parts: _Clause = ""
    if holding is not None and holding.kinds:
        what, size = holding.kinds[0]
        whole = f": {holding.parts(leak.fmt)}"
        parts = (whole, f": {what} {leak.fmt(size)}, ...") if len(holding.kinds) > 1 else whole
    largest = f"; largest: {record.survivors[0].describe(leak.fmt)}" if record.survivors else ""
    briefly = largest.split(", made by ")[0]
    head = f"left {leak.fmt(net_bytes)} allocated after the call (leak limit {leak.written})"
    found = fit_line(head, [held, parts, (largest, briefly)], shown=[largest])
    by_module = () if holding is None else tuple(holding.by_module(format_size))
    return FailureLine(found.line, (*found.detail, *by_module))


def breakdown(call: PhaseResult, phases: Mapping[str, PhaseResult]) -> str:
    """The report section of a measured test: every phase and the whole call."""
    lines = []
    for phase in [*phases.values(), call]:
        shown = phase.reserved_peak_bytes
        reserved = "" if shown is None else f", reserved {format_size(shown)} in all"
        lines.append(
            f"{phase.name}: peak {format_size(phase.peak_bytes)} (requested {format_size(phase.requested_peak_bytes)}"
            f"{reserved}), net {format_size(phase.net_bytes)}, entered {phase.count}x"
        )
    return "\n".join(lines)


def report_section(record: CallRecord, verdict: Sequence[str], failure: FailureLine | None) -> str:
    """The report section of a test that ran to the end: what its failure line left out, phases,
    survivors, explanation, advice, the baseline's `verdict` lines, notes."""
    section = failure.section().removeprefix("\n") + "\n" if failure is not None and failure.detail else ""
    section += breakdown(record.call, record.phases) + survivors_section(record)
    section += explained(record.explanation) + advice_section(record.advice)
    if verdict:
        section += "".join(f"\n{part}" for line in verdict for part in _verdict_lines(line))
    return section + "".join(f"\nnote: {note}" for note in record.notes)


def _verdict_lines(line: str) -> list[str]:
    """A baseline's verdict in lines of at most `LINE_WIDTH`: a problem too long for one goes on with what
    grew on an indented line, cut after a comma where still too long."""
    head, grew = _growth_apart(line)
    if len(line) <= LINE_WIDTH or not grew:
        return wrapped(line, LINE_WIDTH)
    return [f"{head}:", *wrapped(f"  {grew.removeprefix(': ')}", LINE_WIDTH)]


def survivors_section(record: CallRecord) -> str:
    return "".join(f"\nleft allocated: {survivor.describe()}" for survivor in record.survivors)
