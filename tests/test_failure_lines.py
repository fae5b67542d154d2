"""Every failure line reads at a glance: what failed, by how much, the limit and who holds the memory
first, then what still fits in 120 characters; the rest is a line of the test's report section, so
nothing is lost (exact bytes: float32 = 4 bytes; uint8 = 1)."""

from __future__ import annotations

import pytest
from builders import Reported

from pytest_gpumem.baselines.compare import Tolerance, compare
from pytest_gpumem.budget import Budget, budget_from_marker
from pytest_gpumem.measure.oom_and_leaks import Holding
from pytest_gpumem.measure.record import CallRecord
from pytest_gpumem.outcome import Judged, judge
from pytest_gpumem.reasons import AllocatorState, Leaked, OutOfMemory, OverBudget, Raised, Regressed
from pytest_gpumem.report.failures import (
    LINE_WIDTH,
    budget_line,
    failure_line,
    fit_line,
    report_section,
    verdict_line,
)
from pytest_gpumem.results import PhaseResult, Status
from pytest_gpumem.results.baseline import DeviceIdentity, Entry, Environment
from pytest_gpumem.run.judgement import Judgement


def test_the_head_stays_whole_and_each_clause_follows_while_it_fits() -> None:
    head = "h" * (LINE_WIDTH - 50)
    found = fit_line(head, ["; " + "a" * 40, "; " + "b" * 40, " (" + "c" * 5 + ")", ", " + "d" * 60])
    assert found.line == head + "; " + "a" * 40 + " (ccccc)"  # b and d do not fit; the short c after b does
    assert found.detail == ("also: " + "b" * 40, "also: " + "d" * 60)
    assert len(found.line) <= LINE_WIDTH
    assert fit_line("x" * 300, ["; y"]).line == "x" * 300  # what failed is never cut


def test_a_clause_the_section_already_shows_is_not_repeated() -> None:
    found = fit_line(
        "h" * (LINE_WIDTH - 10), ["; largest: a survivor", ": parameters 4 B"], shown=["; largest: a survivor"]
    )
    assert found.detail == ("also: parameters 4 B",)


def test_a_budget_line_names_the_first_limit_then_what_made_it_then_the_advice_then_the_others() -> None:
    over = [f"{name} peak 40.0 MiB exceeds max_memory {name}=1 MiB" for name in ("forward", "backward", "step")]
    made = "; forward peak made of blocks.* (12 blocks) 30.0 MiB, ..."
    found = budget_line(over, made, "")
    assert found.line == over[0] + made  # 110 columns: the other limits are the section's
    assert found.detail == ("also: " + over[1], "also: " + over[2])
    hint = " (see what made it with --gpumem-explain or max_memory(explain=True))"
    briefly = " (see what made it with --gpumem-explain)"
    found = budget_line(over[:1], (hint, briefly), "")  # 124 columns whole: its brief form
    assert (found.line, found.detail) == (over[0] + briefly, ("also: " + hint[2:-1],))


def test_a_verdict_line_keeps_how_to_learn_more_and_leaves_the_other_problems_to_the_section() -> None:
    problems = ["call peak 2.0 MiB is 100.0% above baseline 1.0 MiB (tolerance 5%)", "forward " + "x" * 150]
    how = " (see what made it: pytest t.py::test_a --gpumem-explain)"  # 125 columns with the problem
    found = verdict_line(problems, how)
    assert (found.line, found.detail) == (problems[0], ("also: " + how[2:-1],))  # every problem is there already


def test_who_holds_a_leak_and_what_each_module_left() -> None:
    holding = Holding(
        kinds=(("parameters", 3264), ("saved for backward", 2048)),
        graph=True,
        holder="global STATE of test_x (a list)",
        modules=(
            *(("parameters", f"blocks.{i}.fc", 1000) for i in range(3)),
            ("parameters", "head", 264),
            ("saved for backward", "blocks.0.fc", 1024),
            ("saved for backward", "head", 1024),
        ),
    )
    assert holding.held() == "held by an autograd graph kept alive by global STATE of test_x (a list)"
    assert holding.parts(lambda n: f"{n:,} B") == "parameters 3,264 B, saved for backward 2,048 B"
    assert holding.by_module(lambda n: f"{n:,} B", width=70) == [  # repeated blocks folded, as elsewhere
        "left allocated by module: parameters 3,264 B: blocks.* 3,000 B (3",
        "  blocks), head 264 B",
        "left allocated by module: saved for backward 2,048 B: blocks.* 1,024 B",
        "  (3 blocks), head 1,024 B",
    ]
    assert Holding((), False, "global KEEP of t (a list)").held() == "kept by global KEEP of t (a list)"
    assert Holding((), False, None).held() == ""


LEAKS = """
import types

import pytest
import torch

STATE = types.SimpleNamespace()


@pytest.mark.max_memory(leak="1 kB")
def test_cache(gpumem):
    STATE.cache = [torch.ones(1000 + i) for i in range(10)]  # 40,180 B; the largest 4,036 B


@pytest.mark.max_memory(leak="1 kB", explain=True)
def test_model_and_losses(gpumem):
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    STATE.model, STATE.losses = net, [net(torch.ones(4, 16)).pow(2).sum() for _ in range(2)]
"""


def test_a_leak_names_its_holder_first_and_its_survivors_in_the_section(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(test_leaks=LEAKS)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "left 40.2 kB allocated after the call (leak limit 1 kB), kept by global STATE of test_leaks (a list)",
            *[f"left allocated: 3.9 KiB float32[[]{1009 - i}[]] on cpu, *" for i in range(10)],
            # each Linear(16, 16): 1,024 + 64 B of parameters; each loss saved its (4, 16) input and the
            # three layers' outputs (256 B each: the last one for pow) and is 4 B itself
            "left 5.3 kB allocated after the call (leak limit 1 kB), held by a graph kept by global STATE of "
            "test_leaks (a list)",
            "*Captured gpumem call*",
            "also: held by an autograd graph kept alive by global STATE of test_leaks (a list)",
            "also: parameters 3.3 kB, saved for backward 2.0 kB, graph outputs 8 B",
            "left allocated by module: parameters 3.2 KiB: * 3.2 KiB (3 blocks)",
            "left allocated by module: saved for backward 2.0 KiB: * 1.5 KiB (3 blocks)",
        ]
    )
    assert all(len(test["message"]) <= LINE_WIDTH for test in reported().values())


BUDGET = """
import pytest
import torch


@pytest.mark.max_memory("10 kB", forward="1 kB", backward="2 kB", explain=True)
def test_over_everywhere(gpumem):
    net = torch.nn.Linear(10, 10)  # 440 B
    gpumem.advise(lambda: net(torch.ones(4, 10)).sum().backward(), model=net, strategies=["bf16-autocast"])
    with gpumem.phase("forward"):
        a = torch.ones(1000)  # 4,000 B
    with gpumem.phase("backward"):
        b = torch.ones(2000)  # 8,000 B
"""


def test_a_budget_failure_names_the_first_limit_and_the_advice_and_the_section_the_other_limits(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(test_budget=BUDGET)
    result = tracker.runpytest("--gpumem-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "call peak 12.4 kB exceeds max_memory 10 kB; none of the 1 strategies advise measured fits the budget",
            "*Captured gpumem call*",  # 440 + 4,000 + 8,000 B
            "also: none of the 1 strategies advise measured fits the budget (lowest: bf16-autocast, *)",
            "also: forward peak 4.0 kB exceeds max_memory forward=1 kB",
            "also: backward peak 8.0 kB exceeds max_memory backward=2 kB",
            "forward: peak 3.9 KiB *",
            "peak explained (tracker):",
            "advice (tracker on cpu*",
        ]
    )
    test = reported()["test_over_everywhere"]
    assert len(test["message"]) <= LINE_WIDTH
    assert test["detail"] == [  # what the line leaves to the section reaches the JSON too
        "also: none of the 1 strategies advise measured fits the budget (lowest: bf16-autocast, step peak 624 B "
        "above its start)",
        "also: forward peak 4.0 kB exceeds max_memory forward=1 kB",
        "also: backward peak 8.0 kB exceeds max_memory backward=2 kB",
    ]


FRAGMENTED = """
import pytest
import torch


@pytest.mark.max_memory("30 MiB", capacity="40 MiB")
def test_fragmented(gpumem):
    kept = [torch.empty(5 * 2**20, dtype=torch.uint8) for _ in range(8)]  # two 20 MiB segments
    del kept[::2]  # 20 MiB free, in 5 MiB holes
    with gpumem.phase("grow"):
        torch.empty(8 * 2**20, dtype=torch.uint8)  # no hole holds it; a third segment passes 40 MiB
"""


def test_out_of_memory_on_the_allocators_model_says_the_cause_and_the_section_its_state(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(test_oom=FRAGMENTED)
    result = tracker.runpytest("--gpumem-round=cuda", "--gpumem-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "out of memory in grow after a peak of 40.0 MiB (41,943,040 B): past max_memory(capacity='40 MiB'); "
            "fragmentation",
            "*Captured gpumem call*",
            "also: tried to allocate 20.0 MiB",
            "also: over its budget 30 MiB too, at 40.0 MiB",
            "allocator when it ran out: 40.0 MiB reserved, 20.0 MiB allocated and 20.0 MiB reserved but unallocated",
            "fragmentation: no free block holds 8.0 MiB, though 20.0 MiB is reserved but unallocated;",
            "  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets that memory serve it",
            "call: peak 40.0 MiB *",
        ]
    )
    assert len(reported()["test_fragmented"]["message"]) <= LINE_WIDTH


LAZY = """
import pytest
import torch

KEEP = []


def test_advise_meets_it(gpumem):
    model = torch.nn.LazyLinear(4)
    gpumem.advise(lambda: model(torch.ones(2, 3)).sum().backward(), model=model)


def test_the_test_meets_it(gpumem):
    model = torch.nn.LazyLinear(4)
    model.weight.numel()


@pytest.mark.max_memory(leak=0, explain=True)
def test_a_leak_beside_it(gpumem):
    KEEP.append(torch.nn.LazyLinear(4))  # no memory yet
    KEEP.append(torch.ones(10))  # 40 B
"""


def test_an_uninitialized_lazy_module_fails_in_one_line_where_our_code_meets_it(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_lazy=LAZY)
    result = tracker.runpytest("-p", "no:randomly", "-W", "error::pytest_gpumem.GpuMemWarning")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        [
            "test_lazy.py::test_advise_meets_it: gpumem.advise() met an uninitialized parameter of a Lazy module "
            "(torch.nn.LazyLinear and the like, before their first forward): run the model once on a batch before "
            "measuring it",
            "*def test_the_test_meets_it*",  # the test's own use: torch's error at the test's line, as unmeasured
            "E       ValueError: Attempted to use an uninitialized parameter in *numel*",
            "left 40 B allocated after the call (leak limit 0 B), kept by global KEEP of test_lazy (a list): inputs "
            "and other 40 B",
            "left allocated: 40 B float32[[]10[]] on cpu, made by aten.ones.default at test_lazy.py:20",
        ]
    )
    result.stdout.no_fnmatch_line("*pytest_gpumem/*")  # none of our frames
    result.stdout.no_fnmatch_line("left allocated: 0 B*")  # the Lazy module's empty parameters hold nothing


def test_what_grew_against_the_baseline_follows_the_regression_as_it_fits() -> None:
    regressed = "call peak 4.3 MiB is 277.2% above baseline 1.1 MiB (tolerance 0% + 1.0 MiB)"
    grew = ": h.0 +1.5 MiB: gradients +769.0 KiB"
    assert verdict_line([regressed + grew], "").line == regressed + grew
    found = verdict_line([regressed + grew + "; h.2 +1.5 MiB: gradients +769.0 KiB"], "")  # the section's line
    assert (found.line, found.detail) == (regressed + grew + "; ...", ())  # says it whole
    found = verdict_line([regressed + grew.replace("h.0", "h" * 20)], "")
    assert found.line == regressed + ": " + "h" * 20 + " +1.5 MiB, ..."
    assert verdict_line(["gradients changed: fc.weight differs"], "").line == "gradients changed: fc.weight differs"


def test_a_verdict_too_long_for_a_line_goes_on_with_what_grew_on_an_indented_line_in_the_section() -> None:
    regressed = "call peak 35.2 MiB is 200.0% above baseline 11.7 MiB (tolerance 5% + 1.0 MiB)"
    grew = ": (outside modules) +23.4 MiB, inputs and other"
    long = f"{regressed}{grew}" + ", blocks.0 +1.0 MiB" * 2
    short = "call peak 4.3 MiB is 277.2% above baseline 1.1 MiB (tolerance 0% + 1.0 MiB): h.0 +1.5 MiB"
    section = report_section(_record(4), [long, short, "gradients changed: " + "w, " * 60], None)
    lines = section.splitlines()[1:]
    assert lines[:3] == [f"{regressed}:", f"  {grew[2:]}" + ", blocks.0 +1.0 MiB" * 2, short]
    assert all(len(line) <= LINE_WIDTH for line in lines) and lines[4].startswith("  w, ")  # cut after a comma


def _record(peak: int, net: int = 0, **phases: int) -> CallRecord:
    """The record of a call that peaked at `peak` bytes, left `net` allocated and had `phases` (peaks)."""
    measured = {name: PhaseResult(name, bytes_, bytes_, None, 0) for name, bytes_ in phases.items()}
    return CallRecord("t.py::test_a", "tracker", "cpu", PhaseResult("call", peak, peak, None, net), measured)


def _against(stored: int, current: int) -> Judgement:
    """The comparison of a call that peaked at `current` bytes with its baseline of `stored` (tolerance 5%)."""
    identity, env = DeviceIdentity("tracker", "cpu"), Environment("2.13.0", None)
    entry = Entry.measured(identity, env, current, {})
    verdict = compare("t.py::test_a", entry, Entry.measured(identity, env, stored, {}), Tolerance(5, 0))
    return Judgement(verdict, entry, verdict.failed)


HELD = budget_from_marker((1000,), {"leak": 100, "forward": 600})  # max_memory(1000, leak=100, forward=600)


def _line(outcome: Judged, record: CallRecord, budget: Budget | None = None) -> tuple[str, tuple[str, ...]]:
    """The outcome's line and detail, as the report phrases its first reason."""
    assert outcome.reason is not None
    found = failure_line(outcome.reason, record, budget)
    return found.line, found.detail


def test_a_call_within_its_budget_its_leak_limit_and_its_baseline_passes() -> None:
    outcome = judge(_record(1000, 100, forward=600), HELD, HELD.leak, _against(1000, 1050))
    assert (outcome.status, outcome.reasons) == (Status.OK, ())
    assert judge(_record(5000, 5000), None, None, None).status == Status.OK  # held to nothing


def test_the_budget_is_judged_before_a_leak_and_a_regression() -> None:
    record = _record(1001, 101, forward=601)
    outcome = judge(record, HELD, HELD.leak, _against(1000, 1001 + 50))
    assert outcome.status == Status.OVER_BUDGET
    assert [type(reason) for reason in outcome.reasons] == [OverBudget, Leaked, Regressed]  # the budget's first
    hint = " (see what made it with --gpumem-explain or max_memory(explain=True))"
    also = "also: forward peak 601 B exceeds max_memory forward=600 B"
    assert _line(outcome, record, HELD) == ("call peak 1001 B exceeds max_memory 1000 B" + hint, (also,))


def test_a_leak_is_judged_before_a_regression() -> None:
    record = _record(900, 101)
    outcome = judge(record, HELD, HELD.leak, _against(800, 900))
    assert HELD.leak is not None
    assert (outcome.status, outcome.reason) == (Status.LEAKED, Leaked(101, HELD.leak))
    assert _line(outcome, record, HELD) == ("left 101 B allocated after the call (leak limit 100 B)", ())


def test_a_call_past_its_baseline_and_tolerance_regresses() -> None:
    record = _record(1051)
    outcome = judge(record, None, None, _against(1000, 1051))  # 5% of 1000 B is 50 B
    how = "to see what grew, record the baseline with its composition: pytest t.py::test_a --gpumem-update"
    line = "call peak 1.0 KiB is 5.1% above baseline 1000 B (tolerance 5%)"  # 165 columns with how: the section's
    assert (outcome.status, _line(outcome, record)) == (Status.REGRESSED, (line, (f"also: {how}",)))


def test_a_call_stopped_out_of_memory_fails_for_that_alone_in_a_line_read_from_its_record() -> None:
    held = budget_from_marker((1000,), {"capacity": "2 kB", "forward": 600})  # max_memory(1000, capacity=...)
    record = _record(1500, 0, forward=700)  # over both limits too, but it never ended
    oom = OutOfMemory("forward", "1.95 KiB", held.capacity, AllocatorState(2048, 1536, 2000))
    outcome = judge(record, held, None, _against(1000, 1500), oom)
    assert (outcome.status, outcome.reasons) == (Status.OUT_OF_MEMORY, (oom,))
    line, detail = _line(outcome, record, held)
    # 2,048 - 1,536 = 512 B reserved but unallocated cannot hold 2,000 B: no fragmentation
    assert line == (
        "out of memory in forward (tried to allocate 1.95 KiB) after a peak of 1.5 kB: past max_memory(capacity='2 kB')"
    )
    held_then = "allocator when it ran out: 2.0 KiB reserved, 1.5 KiB allocated and 512 B reserved but unallocated"
    assert detail == ("also: over its budget forward=600 B too, at 700 B", held_then)


def test_a_call_that_raised_is_an_error_in_its_own_line() -> None:
    outcome = judge(_record(5000), HELD, HELD.leak, None, Raised("ValueError: boom"))
    assert outcome.status == Status.ERROR
    assert _line(outcome, _record(5000)) == ("ValueError: boom", ())
