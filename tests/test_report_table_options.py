"""The report table's columns (--gpumem-columns) and its test ids' form (--gpumem-name): chosen by the user,
the default today's table."""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import re
from collections.abc import Callable

import pytest

from pytest_gpumem import values
from pytest_gpumem.constants import COLUMNS
from pytest_gpumem.report.terminal import table_lines
from pytest_gpumem.report.width import display_width
from pytest_gpumem.results import PhaseResult, Status, TestResult
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison, Verdict
from pytest_gpumem.results.explanation import Explanation, PhaseExplanation, SampledTimeline

KIB = 1024


def phase(name: str, kib: int, reserved: int | None = None) -> PhaseResult:
    return PhaseResult(name, kib * KIB, kib * KIB, reserved, -KIB)


def two_tests() -> list[TestResult]:
    """test_a: 12 KiB (forward 4, backward 8, reserved 2 MiB each), 1 KiB net freed each, a 16 KiB budget,
    explained (8 KiB of parameters, 4 of temporaries); test_b: 40 KiB, over a 20 KiB baseline (+100.0%), on
    meta."""
    mib = 2048 * KIB
    made = PhaseExplanation(12 * KIB, {"parameters": 8 * KIB, "temporaries": 4 * KIB}, {}, [], [], live={}, entries=1)
    explanation = Explanation("tests/test_m.py::test_a", "tracker", [], {}, {"call": made}, SampledTimeline(0, []))
    a = TestResult.of(
        "tests/test_m.py::test_a", "tracker", "cpu", phase("call", 12, mib),
        {"forward": phase("forward", 4, mib), "backward": phase("backward", 8, mib)}, budget_text="16 KiB",
        explanation=explanation,
    )  # fmt: skip
    compared = PhaseComparison(None, 20 * KIB, 40 * KIB, 21 * KIB, 100.0, BaselineStatus.REGRESSED)
    verdict = Verdict("tests/test_m.py::test_b", BaselineStatus.REGRESSED, (compared,), (), ())
    b = TestResult.of(
        "tests/test_m.py::test_b", "tracker", "meta", phase("call", 40, mib), {"forward": phase("forward", 40)},
        status=Status.REGRESSED, verdict=verdict,
    )  # fmt: skip
    return [a, b]


def test_the_chosen_columns_stand_beside_the_test_in_the_tables_order() -> None:
    assert table_lines(two_tests(), 120, columns=("peak", "status")) == [
        "test ids without their common prefix tests/test_m.py::",
        "test    call peak  status",
        "------  ---------  ---------",
        "test_b   40.0 KiB  REGRESSED",
        "test_a   12.0 KiB  ok",
    ]


def test_every_column_by_default() -> None:
    assert table_lines(two_tests(), None) == table_lines(two_tests(), None, columns=COLUMNS)
    assert re.split(" {2,}", table_lines(two_tests(), None)[1]) == [
        "test", "device", "forward", "call peak", "reserved", "baseline", "change", "budget", "status",
        "other phases", "call peak made of",
    ]  # fmt: skip


def test_without_phases_the_long_form_has_a_row_per_test() -> None:
    assert table_lines(two_tests(), 120, long=True, columns=("peak", "net")) == [
        "test ids without their common prefix tests/test_m.py::",
        "test        peak       net",
        "------  --------  --------",
        "test_b  40.0 KiB  -1.0 KiB",
        "test_a  12.0 KiB  -1.0 KiB",
    ]


def test_long_ids_are_whole_and_need_no_caption() -> None:
    lines = table_lines(two_tests(), 120, columns=("status",), id_form="long")
    assert lines == [
        "test                     status",
        "-----------------------  ---------",
        "tests/test_m.py::test_b  REGRESSED",
        "tests/test_m.py::test_a  ok",
    ]
    assert table_lines(two_tests(), 20, columns=("status",), id_form="long")[2] == "…::test_b  REGRESSED"


def test_each_column_shows_something_of_its_own() -> None:
    for name in COLUMNS:
        without = tuple(c for c in COLUMNS if c != name)
        short, long = (table_lines(two_tests(), None, long, COLUMNS) for long in (False, True))
        assert (short, long) != tuple(table_lines(two_tests(), None, long, without) for long in (False, True)), name


@pytest.mark.parametrize("width", [100, 120])
def test_any_choice_fits_the_width(width: int) -> None:
    for count in (1, 3, len(COLUMNS)):
        for chosen, long, form in itertools.product(
            itertools.combinations(COLUMNS, count), (False, True), ("short", "long")
        ):
            lines = table_lines(two_tests(), width, long, chosen, form)
            assert max(map(display_width, lines)) <= width, "\n".join(lines)


@pytest.mark.parametrize(
    ("parse", "value", "message"),
    [
        (values.columns, "pk", "invalid column 'pk' (choose from " + ", ".join(COLUMNS) + ", or all)"),
        (values.columns, "peak, pk", "invalid column 'pk' (choose from device, *"),
        (values.columns, "", "invalid column '' (choose from device, *"),
        (values.id_form, "medium", "invalid id form 'medium' (choose from short, long)"),
    ],
)
def test_a_bad_choice_is_refused_naming_the_choices(parse: Callable[[str], object], value: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        parse(value)
    assert fnmatch.fnmatchcase(str(caught.value), message), str(caught.value)


def test_the_columns_are_taken_in_the_tables_order_whatever_the_order_given() -> None:
    assert values.columns(" status, peak,peak") == ("peak", "status")


def test_all_columns_is_the_default_the_help_names() -> None:
    assert values.columns(" all") == COLUMNS


TESTS = "import torch\n\ndef test_a(gpumem):\n    torch.ones(10)\n\ndef test_b(gpumem):\n    torch.ones(20)\n"


def test_gpumem_columns_chooses_the_report_tables_columns(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_two=TESTS)
    result = tracker.runpytest("--gpumem-report", "--gpumem-columns=status")
    result.stdout.fnmatch_lines(["test    status", "------  ------", "test_a  ok", "test_b  ok"])
    tracker.makeini("[pytest]\ngpumem_backend = tracker\ngpumem_columns = peak,sttaus\n")
    refused = tracker.runpytest("--gpumem-report")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["ERROR: ini option gpumem_columns: invalid column 'sttaus' (choose from *)"])


def test_gpumem_name_long_shows_whole_test_ids(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_two=TESTS)
    result = tracker.runpytest("--gpumem-report", "--gpumem-name=long")
    result.stdout.fnmatch_lines(["test                 call peak  status", "*", "test_two.py::test_b*80 B  ok"])
    result.stdout.no_fnmatch_line("test ids without*")
    refused = tracker.runpytest("--gpumem-report", "--gpumem-name=full")
    refused.stderr.fnmatch_lines(["*argument --gpumem-name: invalid id form 'full' (choose from short, long)"])
