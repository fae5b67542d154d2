"""The report's table fits the terminal: the optional columns left out in a fixed order once cutting is not
enough, and the test ids never narrower than they can be read."""

from __future__ import annotations

import itertools

import pytest

from pytest_gpumem.constants import COLUMNS
from pytest_gpumem.report.ids import ID_LEAST, TestFloors, least_width
from pytest_gpumem.report.terminal import table_lines
from pytest_gpumem.report.width import display_width
from pytest_gpumem.results import PhaseResult, Status, TestResult
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison, Verdict

MIB = 1 << 20
GIB = 1 << 30
PREFIX = "tests/test_training.py::"


def phase(name: str, peak: int, reserved: int | None = None, net: int = 0, rank: int | None = None) -> PhaseResult:
    return PhaseResult(name, peak, peak, reserved, net, rank=rank)


def regressed(phase_name: str, baseline: int, call: int, in_phase: int) -> Verdict:
    """The call compared with `baseline` (ok), and `phase_name` (regressed to `in_phase`)."""
    return Verdict("t", BaselineStatus.REGRESSED, (
        PhaseComparison(None, baseline, call, None, None, BaselineStatus.OK),
        PhaseComparison(phase_name, baseline, in_phase, None, None, BaselineStatus.REGRESSED)), (), ())  # fmt: skip


def fsdp_suite() -> list[TestResult]:
    """A sharded training step (rank 1 the worst: 12.4 GiB of 13.0 reserved, 10.0 GiB its baseline, its
    gradients changed) and an evaluation under a budget: every fixed column of the long form has a figure."""
    peak = 12 * GIB + 400 * MIB
    backward = phase("fsdp2.backward", peak, 13 * GIB, -300 * 1024, rank=1)
    step = TestResult.of(
        PREFIX + "test_fsdp_step[bf16-2048]", "cuda", "cuda:0", phase("call", peak, 13 * GIB, -300 * 1024, rank=1),
        {"fsdp2.forward": phase("fsdp2.forward", 9 * GIB, 10 * GIB, 512 * 1024, rank=1), backward.name: backward},
        status=Status.GRADIENTS_CHANGED, verdict=regressed(backward.name, 10 * GIB, peak, peak),
    )  # fmt: skip
    evaluation = TestResult.of(
        PREFIX + "test_eval[bf16-2048]", "cuda", "cuda:0", phase("call", 800 * MIB, GIB),
        {"forward": phase("forward", 800 * MIB, GIB)}, budget_text="call 1.0 GiB, forward 1.0 GiB",
    )  # fmt: skip
    return [step, evaluation]


def test_a_verbose_table_too_wide_for_reserved_leaves_out_net_and_baseline_too_and_keeps_names_whole() -> None:
    # 81 columns on main, its ids cut to nothing: reserved was listed to leave out, but never was; the
    # columns leave now in the order of `fitting._LEFT_OUT` (made of, budget, other phases, reserved, net,
    # baseline, change, backend) before any name or status is cut. The change: (12.4 - 10) / 10 = +23.9%
    assert table_lines(fsdp_suite(), 80, long=True) == [
        "test ids without their common prefix tests/test_training.py::",
        "test                  phase                      peak  change  status",
        "--------------------  --------------  ---------------  ------  -----------------",
        "test_fsdp_step[b…48]  call            12.4 GiB @rank1  +23.9%  GRADIENTS CHANGED",
        "                      fsdp2.forward    9.0 GiB @rank1",
        "                      fsdp2.backward  12.4 GiB @rank1  +23.9%  REGRESSED",
        "test_eval[bf16-2048]  call                  800.0 MiB          ok",
        "                      forward               800.0 MiB",
        "left out to fit 80 columns: reserved, net, baseline, budget",
    ]


def llama_suite() -> list[TestResult]:
    """Two tests with names longer than an 80-column table leaves them, on two backends, with long statuses
    and a change that names its phase."""
    phases = {"forward": phase("forward", GIB), "ddp.backward": phase("ddp.backward", 3 * GIB, rank=1)}
    return [
        TestResult.of(
            "tests/models/test_llama.py::test_a_really_quite_long_function_name[bf16-2048]", "tracker", "meta",
            phase("call", 9 * GIB + 600 * MIB, rank=1), phases, status=Status.GRADIENTS_CHANGED,
            verdict=regressed("ddp.backward", GIB, GIB + 100 * MIB, 3 * GIB + 300 * MIB),
        ),
        TestResult.of(
            "tests/models/test_llama.py::test_training_strategy[selective_checkpoint]", "cuda", "cuda:0",
            phase("call", 888 * MIB), phases, status=Status.MISSING_BASELINE,
            budget_text="call 1.0 GiB, forward 512.0 MiB, backward 3.0 GiB",
        ),
    ]  # fmt: skip


def test_the_ids_keep_a_readable_width_where_main_cut_them_to_nothing() -> None:
    # main fitted this in 80 columns without a single column of ids; now the baseline leaves for them
    # ((3.0 GiB + 300 MiB) / 1.0 GiB = +229.3%)
    assert table_lines(llama_suite(), 80) == [
        "test ids without their common prefix tests/models/test_llama.py::",
        "test       backend            call peak                change  status",
        "---------  ------------  --------------  --------------------  -----------------",
        "test_a_r…  tracker meta  9.6 GiB @rank1  +229.3% ddp.backward  GRADIENTS CHANGED",
        "test_tra…  cuda cuda:0        888.0 MiB                        MISSING BASELINE",
        "left out to fit 80 columns: baseline, budget, phases",
    ]


@pytest.mark.parametrize(
    ("width", "long", "said"),
    [
        (60, False, "baseline, change, budget, phases"),
        (60, True, "net, baseline, change, budget"),
        (52, False, "backend, baseline, chan…"),  # the line itself cut to fit
    ],
)
def test_optional_columns_leave_in_a_fixed_order(width: int, long: bool, said: str) -> None:
    lines = table_lines(llama_suite(), width, long)
    assert lines[-1] == f"left out to fit {width} columns: {said}"
    assert max(map(display_width, lines)) <= width


def test_every_line_fits_80_to_120_columns_whatever_the_columns_chosen() -> None:
    results = [*fsdp_suite(), *llama_suite()]
    choices = [COLUMNS, *itertools.combinations(COLUMNS, 6)][::5]
    for width, long, columns, form in itertools.product((80, 97, 120), (False, True), choices, ("short", "long")):
        lines = table_lines(results, width, long, columns, form)
        assert max(map(display_width, lines)) <= width, (width, long, columns, form, "\n".join(lines))
        rule = next(i for i, line in enumerate(lines) if line.startswith("-"))
        assert len(lines[rule].split("  ")[0]) >= ID_LEAST, "\n".join(lines)  # the test column


def test_the_least_an_id_column_keeps_is_8_columns_or_its_widest_name_and_parameters() -> None:
    assert least_width(["a.py::t", "b/c.py::TestC::t[1]"]) == 4  # "t[1]": "…::t[1]" reads whole
    assert least_width(["a.py::test_training_strategy"]) == ID_LEAST == 8  # "test_tr…"
    assert least_width([]) == 0


def test_floors_are_never_under_the_least() -> None:
    ids = ["a.py::t[1]", "a.py::test_training_strategy"]
    # room 5: the long name does not count ("t[1]" sets every floor at 4), unless a least is asked for
    assert TestFloors.of(ids, room=5) == TestFloors(4, 4, 4)
    assert TestFloors.of(ids, room=5, least=8) == TestFloors(8, 8, 8)
    assert TestFloors.of(ids, room=-3, least=8) == TestFloors(8, 8, 8)  # was 0: a column of no ids
    assert TestFloors.of(ids, room=40, least=8) == TestFloors.of(ids, room=40)  # 22 and more: untouched
