"""The report's layout: pure functions from results to lines that fit a width, and one run of each form."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from builders import phase_result

from pytest_gpumem.config import Options
from pytest_gpumem.options import OPTIONS
from pytest_gpumem.report.fitting import join_fitting
from pytest_gpumem.report.ids import TestId, common_prefix, elide, shorten_id, shorten_ids
from pytest_gpumem.report.markdown import markdown
from pytest_gpumem.report.terminal import (
    cell_rank,
    fold_ranks,
    largest_change,
    shared_phases,
    table_lines,
)
from pytest_gpumem.report.width import ELLIPSIS, cut, display_width, flatten, pad, truncate
from pytest_gpumem.report.writers import WRITERS, JsonReport, RunInfo
from pytest_gpumem.results import PhaseResult, Status, TestResult
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison, Verdict
from pytest_gpumem.run.test_files import TEST_FILES

MIB = 1024 * 1024


def phase(name: str, mib: float, rank: int | None = None) -> PhaseResult:
    return phase_result(name, int(mib * MIB), rank)


def strategy(name: str, test: str = "test_training_strategy") -> TestResult:
    phases = {p.name: p for p in (phase("forward", 4), phase("backward", 8), phase("total", 8))}
    nodeid = f"reference_losses/test_strategies.py::{test}[{name}]"
    return TestResult.of(nodeid, "tracker", "cpu", phase("call", 40), phases)


def distributed(world: int = 2) -> TestResult:
    """Two ranks' `ddp.*` phases, then each phase's worst rank (rank 1 has 28 MiB in backward, rank 0 16)."""
    per_rank = [phase(f"ddp.{p}@rank{r}", 16 if p == "setup" else 16 + 12 * r, r) for r in range(world)
                for p in ("setup", "forward", "backward", "step")]  # fmt: skip
    worst = [phase(f"ddp.{p}", 16 if p == "setup" else 16 + 12 * (world - 1), 0 if p == "setup" else world - 1)
             for p in ("setup", "forward", "backward", "step")]  # fmt: skip
    phases = {p.name: p for p in per_rank + worst}
    return TestResult.of(
        "reference_losses/test_distributed.py::test_data_parallel[2]", "tracker", "cpu", phase("call", 128), phases
    )


def main_job() -> list[TestResult]:
    names = ["naive_sum", "dot", "chunked_ce_checkpoint", "optimizer_in_backward", "selective_checkpoint"]
    return [distributed(), *(strategy(n) for n in names)]


def test_ranks_fold_into_the_worst_rank() -> None:
    folded = fold_ranks(distributed().phases)
    assert list(folded) == ["ddp.setup", "ddp.forward", "ddp.backward", "ddp.step"]
    assert (folded["ddp.backward"].peak_bytes, folded["ddp.backward"].rank) == (28 * MIB, 1)


def test_a_lone_per_rank_phase_folds_to_its_highest_rank() -> None:
    phases = {"x@rank0": phase("x@rank0", 3), "x@rank1": phase("x@rank1", 5), "x@rankA": phase("x@rankA", 1)}
    folded = fold_ranks(phases)
    assert (folded["x"].peak_bytes, folded["x"].rank) == (5 * MIB, 1)
    assert "x@rankA" in folded  # not a rank number: an ordinary phase


def test_shared_phases_are_those_of_more_than_half_the_tests() -> None:
    folded = [fold_ranks(r.phases) for r in main_job()]
    assert shared_phases(folded) == ["forward", "backward", "total"]
    assert shared_phases(folded[:2]) == []  # one of two is not more than half


@pytest.mark.parametrize(
    ("nodeids", "prefix"),
    [
        (["a/t.py::test_x[1]", "a/t.py::test_x[2]"], "a/t.py::"),
        (["a/b.py::t", "a/c.py::t"], "a/"),
        (["t.py::test[a::b1]", "t.py::test[a::b2]"], "t.py::"),  # never into the parameters
        (["t.py::test", "t.py::test2"], "t.py::"),
        (["t.py::test", "t.py::"], ""),  # an id would be left empty
        (["only.py::test"], ""),
        (["x.py::a", "y.py::a"], ""),
    ],
)
def test_common_prefix_ends_at_a_pytest_separator(nodeids: list[str], prefix: str) -> None:
    assert common_prefix(nodeids) == prefix


def test_elide_keeps_both_ends() -> None:
    # 9 characters, the ellipsis, 10: the end is the longer part
    assert elide("test_strategies.py::test_training[selective]", 20) == "test_stra…selective]"
    assert len(elide("x" * 100, 37)) == 37
    assert elide("short", 10) == "short"


def test_join_fitting_says_how_many_more() -> None:
    parts = ["forward 4.0 MiB", "backward 8.0 MiB", "step 1 B"]
    assert join_fitting(parts, 100) == "forward 4.0 MiB · backward 8.0 MiB · step 1 B"
    assert join_fitting(parts, 34) == "forward 4.0 MiB · +2 more"
    assert join_fitting(parts, 8) == "+3 more"
    # a part that does not fit is passed over for one that does; by rank: backward first, forward has no
    # room then, step has; shown in their own order
    assert join_fitting(parts, 37) == "forward 4.0 MiB · step 1 B · +1 more"
    assert join_fitting(parts, 37, rank=[1, 0, 2]) == "backward 8.0 MiB · step 1 B · +1 more"
    assert join_fitting(parts, 26, rank=[1, 0, 2]) == "backward 8.0 MiB · +2 more"


def test_a_narrow_cell_shows_the_largest_phase_of_each_group_first() -> None:
    names = ["ddp.setup", "ddp.backward", "fsdp2.forward", "fsdp2.backward", "load"]
    sizes = [16, 16, 26, 28, 1]
    # the largest of ddp (setup, the first of two alike), fsdp2 and load, then the others by size
    assert cell_rank(names, sizes) == [1, 4, 3, 0, 2]


@pytest.mark.parametrize(
    ("ids", "width", "shown"),
    [
        (
            ["a/b/test_m.py::TestC::test_x[p]", "a/b/test_m.py::TestC::test_y[p]"],
            20,
            ["…::TestC::test_x[p]", "…::TestC::test_y[p]"],
        ),
        (["a/test_m.py::test_x[1]", "a/test_m.py::test_x[2]"], 13, ["…::test_x[1]", "…::test_x[2]"]),
        (["test_m.py::test_x[a/b::c]", "short"], 20, ["…::test_x[a/b::c]", "short"]),  # never into the parameters
        # would read the same: what leads to the name is cut where they differ, never the name
        (["a.py::test_x", "b.py::test_x"], 10, ["a…::test_x", "b…::test_x"]),
        (["a/TestA::test_x", "a/TestB::test_x"], 12, ["a/…A::test_x", "a/…B::test_x"]),
        (
            ["t.py::test_a_long_name[p1]", "t.py::test_a_long_name[p2]"],
            20,
            ["test_a_long_name[p1]", "test_a_long_name[p2]"],
        ),
        # the parameters cut in the middle, apart; a name that alone does not fit is cut at its end
        (
            ["t.py::test_name[small_batch]", "t.py::test_name[large_batch]"],
            16,
            ["test_name[sm…ch]", "test_name[la…ch]"],
        ),
        (["t.py::test_a_long_name[p1]"], 10, ["test_a_lo…"]),
        (["t.py::test_日本語の名前[p1]"], 20, ["test_日本語の名前[…]"]),  # 5 + 12 columns of name, 3 left
        # a name that leaves its parameters under 3 columns gives way at its end, so the rows differ
        (
            ["t.py::test_日本語の長い名前[p1]", "t.py::test_日本語の長い名前[p2]"],
            20,
            ["test_日本…[p1]", "test_日本…[p2]"],
        ),
    ],
)
def test_ids_lose_whole_leading_parts_before_they_are_cut(ids: list[str], width: int, shown: list[str]) -> None:
    assert shorten_ids(ids, width) == shown
    assert all(display_width(text) <= width for text in shown)


LONG_ID = "tests/models/test_llama.py::TestBlock::test_forward[bf16-seq2048]"


@pytest.mark.parametrize(
    ("width", "shown"),
    [
        (70, LONG_ID),
        (64, "…/models/test_llama.py::TestBlock::test_forward[bf16-seq2048]"),
        (60, "…/test_llama.py::TestBlock::test_forward[bf16-seq2048]"),
        (40, "…::TestBlock::test_forward[bf16-seq2048]"),
        (30, "…::test_forward[bf16-seq2048]"),
        (27, "test_forward[bf16-seq2048]"),  # "…::" has no room: the name and parameters alone
        (20, "test_forward[bf…048]"),  # the parameters cut in the middle, the name whole
        (12, "test_forwar…"),  # the name alone does not fit: cut at its end
        (1, "…"),
        (0, ""),
    ],
)
def test_an_id_loses_its_leading_parts_then_its_parameters_and_never_its_name_in_the_middle(
    width: int, shown: str
) -> None:
    assert shorten_id(LONG_ID, width) == shown


def test_display_width_counts_screen_columns() -> None:
    assert display_width("test_x") == 6
    assert display_width("日本語") == 6  # W: two columns each
    assert display_width("\uff46\uff55\uff4c\uff4c") == 8  # F: fullwidth "full"
    assert display_width("e\u0301") == 1  # a combining mark takes none
    assert display_width("a\u200bb") == 2  # nor a zero-width space
    assert display_width("😀") == 2
    assert display_width("…") == display_width("·") == 1  # ambiguous: narrow


def test_padding_and_cutting_go_by_screen_columns() -> None:
    assert pad("日本", 6) == "日本  " and pad("日本", 6, right=True) == "  日本"
    assert truncate("日本語のテスト", 7) == "日本語…"
    assert truncate("日本語のテスト", 8) == "日本語…"  # a wide character never half shown
    assert truncate("e\u0301e\u0301e\u0301", 2) == "e\u0301…"  # a mark stays with its character
    assert cut("test_日本語[a]", 10, 4) == "test…語[a]"
    assert elide("日本語日本語", 5) == "日…語"
    assert truncate("short", 5) == "short" and truncate("longer", 0) == ""


@pytest.mark.parametrize(
    "text", ["日本語のテスト名", "e\u0301" * 9, "a😀b日c\u200bd", "test_\uff46\uff55\uff4c\uff4c[モデル]"]
)
def test_cuts_fit_every_width_and_never_split_a_wide_character_or_lose_a_mark(text: str) -> None:
    for width in range(display_width(text) + 2):
        for shown in (truncate(text, width), elide(text, width), cut(text, width, width // 3)):
            assert display_width(shown) <= width
            assert not shown.startswith("\u0301")  # a mark is never left without its character
            kept = shown.replace(ELLIPSIS, "")
            assert all(char in text for char in kept)  # whole characters of the text, nothing half shown


def test_a_cell_is_one_line_without_control_characters() -> None:
    assert flatten("two\nlines\tand a tab") == "two lines and a tab"
    assert flatten("esc\x1b[31mred\x1b[0m") == "esc\\x1b[31mred\\x1b[0m"  # a terminal would obey it
    assert flatten("nul\x00 lone \ud800") == "nul\\x00 lone \\ud800"
    assert flatten("日本 [red] <b>") == "日本 [red] <b>"  # markup is text: nothing reads it


@pytest.mark.parametrize("width", [61, 80, 97, 100, 120, 200])
def test_every_line_fits_the_width(width: int) -> None:
    for long in (False, True):
        lines = table_lines(main_job(), width, long)
        assert max(map(display_width, lines)) <= width, "\n".join(lines)


SHORT_AT_120 = """\
test ids without their common prefix reference_losses/
test                                                   forward  backward    total  call peak  status  other phases
-----------------------------------------------------  -------  --------  -------  ---------  ------  ------------
test_distributed.py::test_data_parallel[2]                                         128.0 MiB  ok      +4 more
…::test_training_strategy[chunked_ce_checkpoint]       4.0 MiB   8.0 MiB  8.0 MiB   40.0 MiB  ok
test_strategies.py::test_training_strategy[dot]        4.0 MiB   8.0 MiB  8.0 MiB   40.0 MiB  ok
test_strategies.py::test_training_strategy[naive_sum]  4.0 MiB   8.0 MiB  8.0 MiB   40.0 MiB  ok
…::test_training_strategy[optimizer_in_backward]       4.0 MiB   8.0 MiB  8.0 MiB   40.0 MiB  ok
…::test_training_strategy[selective_checkpoint]        4.0 MiB   8.0 MiB  8.0 MiB   40.0 MiB  ok"""


def test_short_form_at_120_columns() -> None:
    # every shared phase keeps its column, no budget column (no test has one); the ids lose their module
    # only where their name and parameters need the room, and keep them whole; what is left goes to the
    # modules of the shorter ids (the distributed test's cell would need 28 columns to show one phase)
    assert table_lines(main_job(), 120) == SHORT_AT_120.splitlines()


def test_parameters_are_cut_before_phases_leave_their_columns() -> None:
    # at 80 columns: the parameters keep 10 columns ("[chun…oint]") so that two phases keep theirs; the
    # least shared one (total) goes to the cell, which says so; every name whole
    assert table_lines(main_job(), 80) == [
        "test ids without their common prefix reference_losses/",
        "test                               forward  backward  call peak  status  others",
        "---------------------------------  -------  --------  ---------  ------  -------",
        "…::test_data_parallel[2]                              128.0 MiB  ok      +4 more",
        "test_training_strategy[chun…oint]  4.0 MiB   8.0 MiB   40.0 MiB  ok      +1 more",
        "…::test_training_strategy[dot]     4.0 MiB   8.0 MiB   40.0 MiB  ok      +1 more",
        "test_training_strategy[naive_sum]  4.0 MiB   8.0 MiB   40.0 MiB  ok      +1 more",
        "test_training_strategy[opti…ward]  4.0 MiB   8.0 MiB   40.0 MiB  ok      +1 more",
        "test_training_strategy[sele…oint]  4.0 MiB   8.0 MiB   40.0 MiB  ok      +1 more",
    ]


def mixed_devices() -> list[TestResult]:
    """A suite mixing CPU and meta tests: a long module path, parameters, a Japanese name, a budget."""

    def test(
        name: str, device: str = "cpu", budget: str | None = None, mib: tuple[float, float] = (4, 8)
    ) -> TestResult:
        phases = {p.name: p for p in (phase("forward", mib[0]), phase("backward", mib[1]))}
        nodeid = f"tests/models/test_llama_memory.py::{name}"
        return TestResult.of(nodeid, "tracker", device, phase("call", sum(mib)), phases, budget_text=budget)

    return [
        test("test_forward_backward[bf16-seq2048]"),
        test("test_forward_backward[fp32-seq512]", mib=(8, 16)),
        test("test_日本語の名前", mib=(4, 2)),
        test("test_predicted_on_meta", "meta", "1 GiB, capacity 3 GiB", (1024, 2560)),
    ]


MIXED_HEAD = "test ids without their common prefix tests/models/test_llama_memory.py::"
MIXED_LAYOUTS = {
    120: [
        MIXED_HEAD,
        "test                                 device  forward  backward  call peak  budget                 status",
        "-----------------------------------  ------  -------  --------  ---------  ---------------------  ------",
        "test_forward_backward[bf16-seq2048]  cpu     4.0 MiB   8.0 MiB   12.0 MiB                         ok",
        "test_forward_backward[fp32-seq512]   cpu     8.0 MiB  16.0 MiB   24.0 MiB                         ok",
        "test_predicted_on_meta               meta    1.0 GiB   2.5 GiB    3.5 GiB  1 GiB, capacity 3 GiB  ok",
        "test_日本語の名前                    cpu     4.0 MiB   2.0 MiB    6.0 MiB                         ok",
    ],
    97: [  # the budget is cut first
        MIXED_HEAD,
        "test                                 device  forward  backward  call peak  budget          status",
        "-----------------------------------  ------  -------  --------  ---------  --------------  ------",
        "test_forward_backward[bf16-seq2048]  cpu     4.0 MiB   8.0 MiB   12.0 MiB                  ok",
        "test_forward_backward[fp32-seq512]   cpu     8.0 MiB  16.0 MiB   24.0 MiB                  ok",
        "test_predicted_on_meta               meta    1.0 GiB   2.5 GiB    3.5 GiB  1 GiB, capaci…  ok",
        "test_日本語の名前                    cpu     4.0 MiB   2.0 MiB    6.0 MiB                  ok",
    ],
    80: [  # the budget left out, then the parameters cut; the phases keep their columns
        MIXED_HEAD,
        "test                                device  forward  backward  call peak  status",
        "----------------------------------  ------  -------  --------  ---------  ------",
        "test_forward_backward[bf16-…q2048]  cpu     4.0 MiB   8.0 MiB   12.0 MiB  ok",
        "test_forward_backward[fp32-seq512]  cpu     8.0 MiB  16.0 MiB   24.0 MiB  ok",
        "test_predicted_on_meta              meta    1.0 GiB   2.5 GiB    3.5 GiB  ok",
        "test_日本語の名前                   cpu     4.0 MiB   2.0 MiB    6.0 MiB  ok",
        "left out to fit 80 columns: budget",
    ],
    61: [  # the caption's prefix cut in the middle; the phases left out, and said so
        "test ids without their common prefix tests/model…_memory.py::",
        "test                                device  call peak  status",
        "----------------------------------  ------  ---------  ------",
        "test_forward_backward[bf16-…q2048]  cpu      12.0 MiB  ok",
        "test_forward_backward[fp32-seq512]  cpu      24.0 MiB  ok",
        "test_predicted_on_meta              meta      3.5 GiB  ok",
        "test_日本語の名前                   cpu       6.0 MiB  ok",
        "left out to fit 61 columns: budget, phases",
    ],
}


@pytest.mark.parametrize("width", sorted(MIXED_LAYOUTS))
def test_a_suite_mixing_cpu_and_meta_keeps_its_names_whole_and_its_phases_where_they_fit(width: int) -> None:
    lines = table_lines(mixed_devices(), width)
    assert lines == MIXED_LAYOUTS[width]
    assert max(map(display_width, lines)) <= width  # "test_日本語の名前" takes 17 columns, 12 characters


def hostile_suite(phases: int) -> list[TestResult]:
    ids = [
        "tests/a_very/deeply/nested/package/test_module_with_a_long_name.py::TestGroup::test_step[[red]-<b>]",
        "tests/a_very/deeply/nested/package/test_module_with_a_long_name.py::TestGroup::test_step[<b>-[red]]",
        "tests/unicode/test_ユニコード.py::test_日本語のテスト名[モデル-e\u0301-😀]",
        "tests/markup/test_markup.py::test_[bold]markup[/bold]",
        "tests/t.py::test_with_a_function_name_longer_than_most_terminals_are_wide_at_all_even_at_120_columns",
    ]
    names = [f"phase_{i}_日本" if i % 3 else f"p{i}[red]" for i in range(phases)]
    budget = "forward=1 GiB, capacity 80 GiB"
    return [
        TestResult.of(nodeid, "tracker", "meta" if i % 2 else "cpu", phase("call", 64 * (i + 1)),
                   {name: phase(name, j + i) for j, name in enumerate(names)}, budget_text=budget)
        for i, nodeid in enumerate(ids)
    ]  # fmt: skip


@pytest.mark.parametrize("width", [40, 61, 80, 97, 100, 120, 200])
@pytest.mark.parametrize("phases", [0, 3, 30])
def test_hostile_ids_fit_every_width_and_keep_their_names_whole_where_they_fit(width: int, phases: int) -> None:
    results = hostile_suite(phases)
    for long in (False, True) if width >= 61 else (False,):
        lines = table_lines(results, width, long)
        assert max(map(display_width, lines)) <= width, "\n".join(lines)
    cells = [line.split("  ")[0] for line in table_lines(results, width)[3:]]
    for nodeid, cell in zip(sorted(r.nodeid for r in results), cells, strict=False):  # all "ok": by id
        name = TestId.of(nodeid).name
        # whole where its column has room for it (all but the last at 61 columns and more), else cut at its end
        assert name in cell or (cell.endswith(ELLIPSIS) and name.startswith(cell[:-1])), cells
        assert name in cell or width < 61 or name.startswith("test_with_a_function_name"), cells


def test_wide_terminal_keeps_every_shared_phase_and_whole_ids() -> None:
    lines = table_lines(main_job(), 250)
    assert lines[1].split()[:4] == ["test", "forward", "backward", "total"]
    assert "test_strategies.py::test_training_strategy[selective_checkpoint]" in lines[-1]
    # setup: both ranks 16 MiB, so no rank named
    assert lines[3].endswith("ddp.setup 16.0 MiB · ddp.forward 28.0 MiB @rank1 · "
                             "ddp.backward 28.0 MiB @rank1 · ddp.step 28.0 MiB @rank1")  # fmt: skip


def test_long_form_has_a_row_per_test_and_phase() -> None:
    results = [distributed(), strategy("dot")]
    lines = table_lines(results, 120, long=True)
    body = lines[3:]
    assert len(body) == 2 + len(results[0].phases) + len(results[1].phases)
    assert body[0].split()[:4] == ["test_distributed.py::test_data_parallel[2]", "call", "128.0", "MiB"]
    assert any(line.split()[:3] == ["ddp.backward@rank1", "28.0", "MiB"] for line in body)
    assert any(line.split()[:4] == ["ddp.backward", "28.0", "MiB", "@rank1"] for line in body)


def compared(*comparisons: tuple[str | None, int, float, BaselineStatus]) -> Verdict:
    """A verdict with these (phase, baseline, change %, status) comparisons."""
    rows = tuple(
        PhaseComparison(p, base, base + int(base * change / 100), None, change, status)
        for p, base, change, status in comparisons
    )
    regressed = any(c.status == BaselineStatus.REGRESSED for c in rows)
    return Verdict("t", BaselineStatus.REGRESSED if regressed else BaselineStatus.OK, rows, (), ())


def test_long_form_shows_each_phase_against_its_baseline() -> None:
    verdict = compared((None, 40 * MIB, 0.0, BaselineStatus.OK), ("backward", 4 * MIB, 100.0, BaselineStatus.REGRESSED))
    result = replace(strategy("dot"), verdict=verdict)
    lines = table_lines([result], 120, long=True)
    assert lines[0].split() == ["test", "phase", "peak", "net", "baseline", "change", "status"]
    backward = next(line for line in lines if " backward " in line)
    assert backward.split()[-3:] == ["MiB", "+100.0%", "REGRESSED"]


def table_of(text: str) -> list[str]:
    """The lines of the Markdown summary's table."""
    return [line for line in text.splitlines() if line.startswith("|")]


def test_short_markdown_keeps_whole_ids_and_every_phase() -> None:
    lines = table_of(markdown(main_job()))
    assert lines[0].replace(" ", "") == "|test|forward|backward|total|callpeak|status|otherphases|"
    assert "reference_losses/test_strategies.py::test_training_strategy[selective_checkpoint]" in lines[-1]
    assert "ddp.backward 28.0 MiB @rank1 · ddp.step 28.0 MiB @rank1" in lines[2]


def test_long_markdown_has_a_row_per_phase() -> None:
    lines = table_of(markdown([strategy("dot")], long=True))
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["call", "forward", "backward", "total"]


def test_markdown_links_pictures_from_its_own_folder(tmp_path: Path) -> None:
    result = replace(strategy("dot"), html_path="pictures/dot.html")  # relative to the rootdir
    text = markdown([result], root=tmp_path, folder=tmp_path / "reports" / "ci")
    assert "[picture](<../../pictures/dot.html>)" in text
    assert "[picture](<pictures/dot.html>)" in markdown([result], root=tmp_path, folder=tmp_path)


def test_fixed_columns_empty_in_every_row_are_left_out() -> None:
    plain, budgeted = strategy("a"), strategy("b")
    assert table_lines([plain, budgeted])[1].split() == [
        "test",
        "forward",
        "backward",
        "total",
        "call",
        "peak",
        "status",
    ]
    budgeted = budgeted.replaced(budget_text="50 MiB", verdict=compared())  # NEW: a baseline run, nothing compared
    assert "budget" in table_lines([plain, budgeted])[1] and "baseline" not in table_lines([plain, budgeted])[1]


def test_one_compared_test_keeps_its_whole_id_at_80_columns() -> None:
    # 1250 float32 = 5,000 B = 4.9 KiB against a baseline of 4,000 B = 3.9 KiB: +25.0%
    made = phase_result("made", 5000)
    verdict = compared((None, 4000, 25.0, BaselineStatus.REGRESSED))
    result = TestResult.of("test_suite.py::test_alloc[a]", "tracker", "cpu", made, {"made": made},
                           status=Status.REGRESSED, verdict=verdict)  # fmt: skip
    lines = table_lines([result], 80)
    assert lines[0].split() == ["test", "made", "call", "peak", "baseline", "change", "status"]
    assert lines[2].split() == [
        "test_suite.py::test_alloc[a]",
        "4.9",
        "KiB",
        "4.9",
        "KiB",
        "3.9",
        "KiB",
        "+25.0%",
        "REGRESSED",
    ]


def test_per_rank_phases_fold_into_their_phase_column() -> None:
    ranks = {p.name: p for p in (phase("forward@rank0", 3, 0), phase("forward@rank1", 5, 1), phase("load@rank0", 1, 0))}
    results = [
        strategy("a"),
        strategy("b"),
        TestResult.of("t.py::test_ranks", "tracker", "cpu", phase("call", 9), ranks),
    ]
    head, _, *rows = table_lines(results, 120)  # no common prefix, no caption
    assert head.split()[:2] == ["test", "forward"]
    assert rows[-1].split()[:4] == ["t.py::test_ranks", "5.0", "MiB", "@rank1"]  # rank 1's, the worst
    assert rows[-1].endswith("load 1.0 MiB @rank0")


def world(peaks: dict[str, list[float]]) -> TestResult:
    """A result as gpumem.distributed records it: `phase@rankN` of each rank, each phase's worst rank as
    `phase`, the run of the ranks as `ranks@rankN` and `ranks`, the call taken from the worst run."""
    phases: dict[str, PhaseResult] = {}
    for name, by_rank in {**peaks, "ranks": [sum(v) for v in zip(*peaks.values(), strict=True)]}.items():
        for r, mib in enumerate(by_rank):
            phases[f"{name}@rank{r}"] = phase(f"{name}@rank{r}", mib, r)
        worst = max(range(len(by_rank)), key=lambda r: (by_rank[r], -r))
        phases[name] = phase(name, by_rank[worst], worst)
    run = phases["ranks"]
    return TestResult.of("t.py::test_world", "tracker", "cpu", phase("call", run.peak_bytes / MIB, run.rank), phases)


def test_a_distributed_run_is_its_call_peak_and_agreeing_ranks_are_not_named() -> None:
    def rows(peaks: dict[str, list[float]]) -> list[str]:
        head, _, _, run = table_lines([world(peaks), strategy("a")], 120)  # ids apart from "t.py::": no caption
        assert head.split() == ["test", "call", "peak", "status", "phases"]  # the run is the call peak, no phase
        return [cell.strip() for cell in run.split("  ")]

    alike = [cell for cell in rows({"ddp.forward": [4, 4], "ddp.backward": [16, 16]}) if cell]
    assert alike[1:] == ["20.0 MiB", "ok", "ddp.forward 4.0 MiB · ddp.backward 16.0 MiB"]  # 4 + 16 MiB on each rank
    apart = [cell for cell in rows({"ddp.forward": [4, 6], "ddp.backward": [16, 16]}) if cell]
    assert apart[1:] == ["22.0 MiB @rank1", "ok", "ddp.forward 6.0 MiB @rank1 · ddp.backward 16.0 MiB"]


def test_device_column_only_when_tests_differ() -> None:
    cpu, meta = strategy("a"), strategy("b")
    assert "device" not in table_lines([cpu, meta])[1] and "backend" not in table_lines([cpu, meta])[1]
    meta = meta.replaced(device="meta")  # the same backend: only the device is said
    assert table_lines([cpu, meta])[1].split()[:2] == ["test", "device"]
    assert table_lines([cpu, meta])[-1].split()[1] == "meta"
    meta = meta.replaced(backend="cuda")  # both differ: both said
    assert table_lines([cpu, meta])[1].split()[:2] == ["test", "backend"]
    assert "cuda meta" in table_lines([cpu, meta])[-1]
    meta = meta.replaced(device="cpu")  # only the backend differs
    assert table_lines([cpu, meta])[-1].split()[1] == "cuda"


# pytester: a suite whose tests name their phases differently, one with per-rank phases as
# gpumem.distributed names them, ids long enough to need cutting
MIXED = """
import pytest, torch

@pytest.mark.parametrize("size", ["small_batch_of_sequences", "large_batch_of_sequences", "one_sequence"])
def test_a_training_step_whose_name_is_long_enough_to_be_cut(gpumem, size):
    with gpumem.phase("forward"):
        torch.ones(1024)
    with gpumem.phase("backward"):
        torch.ones(2048)

def test_ranks(gpumem):
    for rank in (0, 1):
        with gpumem.phase(f"ddp.forward.rank{rank}"):
            torch.ones(1024 * (rank + 1))
        with gpumem.phase(f"ddp.backward.rank{rank}"):
            torch.ones(4096 * (1 + 6 * rank))

def test_other_phases(gpumem):
    with gpumem.phase("load"):
        torch.ones(256)
    with gpumem.phase("decode"):
        torch.ones(512)
"""


# test_ranks stands in for gpumem.distributed (whose ranks are spawned processes): its phases "x.rankN"
# become rank N's phase "x@rankN", as a distributed run records them
RANKS_CONFTEST = """
import dataclasses

def pytest_gpumem_result(item, result):
    renamed = {}
    for name, phase in result.phases.items():
        base, _, rank = name.rpartition(".rank")
        if base and rank.isdigit():
            phase = dataclasses.replace(phase, name=f"{base}@rank{rank}", rank=int(rank))
        renamed[phase.name] = phase
    result.phases = renamed
"""


def mixed(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_mixed=MIXED)
    tracker.makeconftest(RANKS_CONFTEST)


def _report(result: pytest.RunResult) -> list[str]:
    lines = result.outlines
    start = next(i for i, line in enumerate(lines) if "= gpumem report =" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("gpumem: ") and i > start)
    return lines[start + 1 : end]


@pytest.mark.parametrize("columns", [None, "100"])
def test_report_fits_the_terminal(tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, columns: str) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)  # no terminal, no COLUMNS: 120
    else:
        monkeypatch.setenv("COLUMNS", columns)
    mixed(tracker)
    result = tracker.runpytest("--gpumem-report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    report = _report(result)
    assert max(map(display_width, report)) <= int(columns or 120), "\n".join(report)
    assert report[0] == "test ids without their common prefix test_mixed.py::"
    assert len(report) == 3 + 5  # caption, header, rule, a row per test
    assert len({line.split()[0] for line in report[3:]}) == 5  # ids cut where they stay apart
    # the 57 characters of the function's name whole in each row, the parameters cut in the middle
    assert all(line.startswith("test_a_training_step_whose_name_is_long_enough_to_be_cut[") for line in report[3:6])
    assert report[3].split()[0].endswith("…quences]")
    # at 120 columns, the phases shared by 3 tests of 5 keep their columns; at 100 they do not fit beside
    # that name and are counted in the cell
    assert report[1].split()[1:3] == (["call", "peak"] if columns else ["forward", "backward"])
    # rank 1's backward: 4 * 4096 * 7 = 114,688 B = 112.0 KiB, the worst; only the count where it is cut
    ranks = next(line for line in report if line.startswith("test_ranks "))
    assert "ddp.forward 8.0 KiB @rank1 · ddp.backward 112.0 KiB @rank1" in ranks or ranks.endswith(" more")


# pytester: CPU tests and a meta test in one run, a long id (tests/models/...), a name in Japanese
DEVICES = """
import pytest, torch

@pytest.mark.parametrize("dtype", ["bf16-seq2048", "fp32-seq512"])
def test_forward_backward(gpumem, dtype):
    with gpumem.phase("forward"):
        torch.ones(1024)
    with gpumem.phase("backward"):
        torch.ones(2048)

def test_日本語の名前(gpumem):
    with gpumem.phase("forward"):
        torch.ones(1024)
    with gpumem.phase("backward"):
        torch.ones(4096)

@pytest.mark.max_memory("1 GiB", capacity="3 GiB", device="meta")
def test_predicted_on_meta(gpumem):
    with gpumem.phase("forward"):
        torch.ones(1024, device=gpumem.device)
    with gpumem.phase("backward"):
        torch.ones(4096, device=gpumem.device)
"""
SMALL = "import torch\n\ndef test_small(gpumem):\n    with gpumem.phase('forward'):\n        torch.ones(10)\n"


def test_a_run_mixing_cpu_and_meta_fits_80_columns_with_whole_names_and_its_phases(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    (tracker.path / "tests" / "models").mkdir(parents=True)
    (tracker.path / "tests" / "models" / "test_llama_memory.py").write_text(DEVICES, encoding="utf-8")
    tracker.makepyfile(test_small=SMALL)
    result = tracker.runpytest("--gpumem-report", "-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=5)
    report = _report(result)
    assert max(map(display_width, report)) <= 80, "\n".join(report)  # "test_日本語の名前" takes 17 columns
    head, _, *rows, said = report
    # the phases keep their columns beside the device's: the budget is left out for them, and said so
    assert head.split() == ["test", "device", "forward", "backward", "call", "peak", "status"]
    assert said == "left out to fit 80 columns: budget"
    names = ["test_small", "test_forward_backward[bf16-", "test_forward_backward[fp32-seq512]",
             "test_predicted_on_meta", "test_日本語の名前"]  # fmt: skip
    assert [row.split()[0] for row in rows] == [
        "test_small.py::test_small",  # short enough to keep its module
        "test_forward_backward[bf16-…q2048]",  # the longest: its parameters cut in the middle, its name whole
        "test_forward_backward[fp32-seq512]",
        "…::test_predicted_on_meta",
        "…::test_日本語の名前",
    ]  # all "ok": by test id
    assert all(name in row for name, row in zip(names, rows, strict=True))
    assert [row.split()[1] for row in rows] == ["cpu", "cpu", "cpu", "meta", "cpu"]
    # 1024 float32 = 4.0 KiB forward and on meta; 4096 float32 = 16.0 KiB backward
    assert rows[-2].split()[2:] == ["4.0", "KiB", "16.0", "KiB", "16.0", "KiB", "ok"]


def test_verbose_report_and_markdown_have_a_row_per_phase(tracker: pytest.Pytester) -> None:
    mixed(tracker)
    (tracker.path / "reports").mkdir()
    result = tracker.runpytest("--gpumem-report", "--gpumem-markdown=reports/m.md", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    report = _report(result)
    ranks = next(i for i, line in enumerate(report) if line.startswith("test_ranks "))
    rows = [line.split()[0] for line in report[ranks + 1 : ranks + 5]]
    assert rows == ["ddp.forward@rank0", "ddp.backward@rank0", "ddp.forward@rank1", "ddp.backward@rank1"]
    markdown_lines = table_of((tracker.path / "reports" / "m.md").read_text())
    phases = [line.split("|")[2].strip() for line in markdown_lines[2:]]
    assert phases.count("call") == 5 and len(phases) == 5 + 3 * 2 + 4 + 2  # each test's call and phases


def test_markdown_links_pictures_relative_to_its_own_folder(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_pic="import torch\n\ndef test_pic(gpumem):\n    torch.ones(1000)\n")
    (tracker.path / "reports" / "ci").mkdir(parents=True)
    args = ("--gpumem-explain", "--gpumem-html=pictures", "--gpumem-markdown=reports/ci/m.md", "--gpumem-json=o.json")
    tracker.runpytest(*args).assert_outcomes(passed=1)
    text = (tracker.path / "reports" / "ci" / "m.md").read_text(encoding="utf-8")
    link = text.split("[picture](<", 1)[1].split(">)", 1)[0]
    assert link.startswith("../../pictures/test_pic.py_test_pic-") and link.endswith(".html")
    assert (tracker.path / "reports" / "ci" / link).is_file()
    html = json.loads((tracker.path / "o.json").read_text(encoding="utf-8"))["tests"][0]["html"]
    assert (tracker.path / html).resolve() == (tracker.path / "reports" / "ci" / link).resolve()  # rootdir-relative


def test_the_end_of_the_run_says_what_it_writes_unless_quiet(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_two="import torch\n\ndef test_a(gpumem):\n    torch.ones(10)\n\ndef test_b(gpumem):\n    pass\n"
    )
    args = ("--gpumem-update", "--gpumem-json=out.json", "--gpumem-markdown=m.md", "-p", "no:cacheprovider")
    result = tracker.runpytest(*args)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["gpumem: writing 2 results to out.json and m.md", "gpumem: updating gpumem-baselines.json from 2 passed tests"]
    )
    quiet = tracker.runpytest(*args, "-q")
    quiet.assert_outcomes(passed=2)
    assert not [line for line in quiet.outlines if line.startswith(("gpumem: writing", "gpumem: updating"))]


def test_each_end_of_run_file_is_asked_for_by_the_option_its_writer_declares() -> None:
    rows = [option for option in OPTIONS if option.writer is not None]
    assert [(row.flag, row.help, row.writer) for row in rows] == [(w.flag, w.help, w) for w in WRITERS]
    assert {(row.field, row.metavar, row.ini) for row in rows} == {("writers", "PATH", row.dest) for row in rows}
    assert "writers" in Options._fields
    assert [writer.flag for writer in WRITERS] == ["--gpumem-json", "--gpumem-markdown"]  # written in order


def test_each_file_a_test_leaves_is_chosen_by_the_folder_option_that_names_it() -> None:
    folders = {option.field: option.flag for option in OPTIONS if option.metavar == "DIR"}
    assert {field: folders.get(field) for field in TEST_FILES} == {field: f.flag for field, f in TEST_FILES.items()}
    assert set(TEST_FILES) <= set(Options._fields)


def test_the_json_report_names_the_first_result_s_backend_when_the_run_made_none(tmp_path: Path) -> None:
    result = TestResult.of("test_a.py::test_a", "tracker", "meta", phase("call", 1), {})
    made_none, made_cuda = RunInfo(None, None, tmp_path, False, None), RunInfo("cuda", "cuda:0", tmp_path, False, None)
    for run, named in ((made_none, ["tracker", "meta"]), (made_cuda, ["cuda", "cuda:0"])):
        doc = json.loads(JsonReport(tmp_path / "r.json").text([result], run))
        assert [doc["backend"], doc["device"], doc["commit"], len(doc["tests"])] == [*named, None, 1]  # no git here


UNICODE_IDS = """
import pytest, torch

@pytest.mark.parametrize("model", ["小さいモデル", "大きいモデル-e\u0301-😀"])
def test_日本語で書かれたとても長いテストの名前(gpumem, model):
    with gpumem.phase("前向き"):
        torch.ones(1024)
    with gpumem.phase("backward"):
        torch.ones(2048)
"""


def test_a_japanese_name_with_unicode_parameter_ids_fits_80_columns(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    pytester.makeini(
        "[pytest]\ngpumem_backend = tracker\n"
        "disable_test_id_escaping_and_forfeit_all_rights_to_community_support = true\n"  # the ids as written
    )
    pytester.makepyfile(test_ja=UNICODE_IDS)
    result = pytester.runpytest("--gpumem-report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    report = _report(result)
    assert max(map(display_width, report)) <= 80, "\n".join(report)  # the name: 5 + 2 * 20 columns, 25 characters
    rows = [line.split("  ")[0] for line in report[3:]]
    assert rows == [
        "test_日本語で書かれたとても長いテストの名前[大…-😀]",  # by id: 大 (U+5927) before 小 (U+5C0F)
        "test_日本語で書かれたとても長いテストの名前[小…ル]",
    ]


def test_rows_go_by_status_the_failures_first_then_by_test_id() -> None:
    statuses = {"c": Status.OK, "a": Status.NEW, "b": Status.OK, "d": Status.REGRESSED, "e": Status.OVER_BUDGET}
    results = [
        TestResult.of(f"t.py::test_{n}", "tracker", "cpu", phase("call", 1), status=s) for n, s in statuses.items()
    ]
    rows = [line.split()[0] for line in table_lines(results, 120)[3:]]  # a caption, the header, the rule
    assert rows == ["test_e", "test_d", "test_a", "test_b", "test_c"]  # in xdist's order: c, a, b, d, e


def test_the_change_shown_is_the_largest_regression_with_its_phase() -> None:
    result = strategy("dot")
    ok, regressed, improved = BaselineStatus.OK, BaselineStatus.REGRESSED, BaselineStatus.IMPROVED
    # the call +2% (within the tolerance); forward +3 MiB (+300%), backward +4 MiB (+100%): the most bytes
    result = replace(
        result,
        verdict=compared(
            (None, 40 * MIB, 2.0, ok), ("forward", MIB, 300.0, regressed), ("backward", 4 * MIB, 100.0, regressed)
        ),
    )
    assert largest_change(result) == "+100.0% backward"
    result = result.replaced(status=Status.REGRESSED)
    row = next(line for line in table_lines([result], None) if "dot" in line)
    assert row.split()[-3:] == ["+100.0%", "backward", "REGRESSED"]
    result = result.replaced(verdict=compared((None, 40 * MIB, -1.0, ok), ("forward", 4 * MIB, -50.0, improved)))
    assert largest_change(result) == "-50.0% forward"
    result = result.replaced(verdict=compared((None, 40 * MIB, 2.0, ok), ("forward", 4 * MIB, 4.0, ok)))
    assert largest_change(result) == "+2.0%"  # nothing regressed or improved: the call's


BUDGETED = """
import pytest, torch

@pytest.mark.parametrize("size", [1024, 4096])
@pytest.mark.max_memory("1 MiB", forward="512 KiB")
def test_a_forward_and_backward_step(gpumem, size):
    with gpumem.phase("forward"):
        torch.ones(size)
    with gpumem.phase("backward"):
        torch.ones(2 * size)
"""


def test_what_the_peak_is_made_of_is_left_out_before_the_budget(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the composition (at least 24 columns) the table would take 127 columns: it goes, whole; the
    budget stays whole."""
    monkeypatch.setenv("COLUMNS", "120")
    tracker.makepyfile(test_budgeted=BUDGETED)
    result = tracker.runpytest("--gpumem-report", "--gpumem-explain", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    _, head, _, *rows, said = _report(result)  # a caption: the ids without "test_budgeted.py::"
    assert head.split() == ["test", "forward", "backward", "call", "peak", "budget", "status"]
    assert all(row.endswith("  1 MiB, forward=512 KiB  ok") for row in rows), rows
    assert said == "left out to fit 120 columns: call peak made of"
