"""The report's layout: pure functions from results to lines that fit a width, and one run of each form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpumem.report.markdown import markdown
from pytest_gpumem.report.terminal import (
    cell_rank,
    common_prefix,
    elide,
    fold_ranks,
    join_fitting,
    shared_phases,
    shorten_ids,
    table_lines,
)
from pytest_gpumem.results import PhaseResult, Status, TestResult
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison, Verdict

MIB = 1024 * 1024


def phase(name: str, mib: float, rank: int | None = None) -> PhaseResult:
    return PhaseResult(name, int(mib * MIB), int(mib * MIB), None, 0, rank=rank)


def strategy(name: str, test: str = "test_training_strategy") -> TestResult:
    phases = {p.name: p for p in (phase("forward", 4), phase("backward", 8), phase("total", 8))}
    nodeid = f"reference_losses/test_strategies.py::{test}[{name}]"
    return TestResult(nodeid, "tracker", "cpu", phase("call", 40), phases)


def distributed(world: int = 2) -> TestResult:
    """Two ranks' `ddp.*` phases, then each phase's worst rank (rank 1 has 28 MiB in backward, rank 0 16)."""
    per_rank = [phase(f"ddp.{p}@rank{r}", 16 if p == "setup" else 16 + 12 * r, r) for r in range(world)
                for p in ("setup", "forward", "backward", "step")]  # fmt: skip
    worst = [phase(f"ddp.{p}", 16 if p == "setup" else 16 + 12 * (world - 1), 0 if p == "setup" else world - 1)
             for p in ("setup", "forward", "backward", "step")]  # fmt: skip
    phases = {p.name: p for p in per_rank + worst}
    return TestResult(
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
            ["…TestC::test_x[p]", "…TestC::test_y[p]"],
        ),
        (["a/test_m.py::test_x[1]", "a/test_m.py::test_x[2]"], 13, ["…test_x[1]", "…test_x[2]"]),
        (["test_m.py::test_x[a/b::c]", "short"], 20, ["…test_x[a/b::c]", "short"]),  # never into the parameters
        (["a.py::test_x", "b.py::test_x"], 10, ["a.py…est_x", "b.py…est_x"]),  # would read the same: cut apart
        (["t.py::test_a_long_name[p1]", "t.py::test_a_long_name[p2]"], 14, ["test_a…ame[p1]", "test_a…ame[p2]"]),
    ],
)
def test_ids_lose_whole_leading_parts_before_they_are_cut(ids: list[str], width: int, shown: list[str]) -> None:
    assert shorten_ids(ids, width) == shown


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_every_line_fits_the_width(width: int) -> None:
    for long in (False, True):
        lines = table_lines(main_job(), width, long)
        assert max(map(len, lines)) <= width, "\n".join(lines)


def test_short_form_at_120_columns() -> None:
    lines = table_lines(main_job(), 120)
    assert lines[0] == "test ids without their common prefix reference_losses/"
    head, rule, ddp, *strategies = lines[1:]
    # every shared phase keeps its column, no budget column (no test has one); ids lose their module
    # first, and are cut in the middle only where the name still does not fit, so that the cell shows a
    # phase of the distributed test (the 28 MiB ones of rank 1 need 37 columns with the count)
    assert head.split() == ["test", "forward", "backward", "total", "call", "peak", "status", "other", "phases"]
    assert ddp.startswith("test_distributed.py::test_data_parallel[2] ")
    assert ddp.endswith("128.0 MiB  ok      ddp.setup 16.0 MiB · +3 more")
    assert strategies[0].startswith("…test_training_strategy[naive_sum]  ")
    assert strategies[-1].startswith("test_training_strateg…selective_checkpoint]  4.0 MiB   8.0 MiB")
    assert len(rule) == 120


def test_phases_leave_their_columns_when_the_width_is_short() -> None:
    lines = table_lines(main_job(), 80)
    # at 80 columns the ids keep 35% (28), the least shared phase (total) goes to the cell, which says so
    assert lines[1].split() == ["test", "forward", "backward", "call", "peak", "status", "other", "phases"]
    assert lines[-1].endswith("4.0 MiB   8.0 MiB   40.0 MiB  ok      +1 more")
    assert max(map(len, lines)) <= 80


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
    rows = tuple(PhaseComparison(p, base, None, None, change, status) for p, base, change, status in comparisons)
    regressed = any(c.status == BaselineStatus.REGRESSED for c in rows)
    return Verdict("t", BaselineStatus.REGRESSED if regressed else BaselineStatus.OK, rows, (), ())


def test_long_form_shows_each_phase_against_its_baseline() -> None:
    result = strategy("dot")
    result.baseline = compared(
        (None, 40 * MIB, 0.0, BaselineStatus.OK), ("backward", 4 * MIB, 100.0, BaselineStatus.REGRESSED)
    )
    lines = table_lines([result], 120, long=True)
    assert lines[0].split() == ["test", "phase", "peak", "net", "baseline", "change", "status"]
    backward = next(line for line in lines if " backward " in line)
    assert backward.split()[-3:] == ["MiB", "+100.0%", "REGRESSED"]


def test_short_markdown_keeps_whole_ids_and_every_phase() -> None:
    lines = markdown(main_job()).splitlines()
    assert lines[0].replace(" ", "") == "|test|forward|backward|total|callpeak|status|otherphases|"
    assert "reference_losses/test_strategies.py::test_training_strategy[selective_checkpoint]" in lines[-1]
    assert "ddp.backward 28.0 MiB @rank1 · ddp.step 28.0 MiB @rank1" in lines[2]


def test_long_markdown_has_a_row_per_phase() -> None:
    lines = markdown([strategy("dot")], long=True).splitlines()
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["call", "forward", "backward", "total"]


def test_markdown_links_pictures_from_its_own_folder(tmp_path: Path) -> None:
    result = strategy("dot")
    result.html = "pictures/dot.html"  # relative to the rootdir
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
    budgeted.budget_text = "50 MiB"
    budgeted.baseline = compared()  # NEW: a baseline run, nothing to compare with
    assert "budget" in table_lines([plain, budgeted])[1] and "baseline" not in table_lines([plain, budgeted])[1]


def test_one_compared_test_keeps_its_whole_id_at_80_columns() -> None:
    # 1250 float32 = 5,000 B = 4.9 KiB against a baseline of 4,000 B = 3.9 KiB: +25.0%
    made = PhaseResult("made", 5000, 5000, None, 0)
    result = TestResult("test_suite.py::test_alloc[a]", "tracker", "cpu", made, {"made": made}, status=Status.REGRESSED)
    result.baseline = compared((None, 4000, 25.0, BaselineStatus.REGRESSED))
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
    results = [strategy("a"), strategy("b"), TestResult("t.py::test_ranks", "tracker", "cpu", phase("call", 9), ranks)]
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
    return TestResult("t.py::test_world", "tracker", "cpu", phase("call", run.peak_bytes / MIB, run.rank), phases)


def test_a_distributed_run_is_its_call_peak_and_agreeing_ranks_are_not_named() -> None:
    def rows(peaks: dict[str, list[float]]) -> list[str]:
        head, _, run, _ = table_lines([world(peaks), strategy("a")], 120)  # ids apart from "t.py::": no caption
        assert head.split() == ["test", "call", "peak", "status", "phases"]  # the run is the call peak, no phase
        return [cell.strip() for cell in run.split("  ")]

    alike = [cell for cell in rows({"ddp.forward": [4, 4], "ddp.backward": [16, 16]}) if cell]
    assert alike[1:] == ["20.0 MiB", "ok", "ddp.forward 4.0 MiB · ddp.backward 16.0 MiB"]  # 4 + 16 MiB on each rank
    apart = [cell for cell in rows({"ddp.forward": [4, 6], "ddp.backward": [16, 16]}) if cell]
    assert apart[1:] == ["22.0 MiB @rank1", "ok", "ddp.forward 6.0 MiB @rank1 · ddp.backward 16.0 MiB"]


def test_backend_column_only_when_tests_differ() -> None:
    cpu, meta = strategy("a"), strategy("b")
    assert "backend" not in table_lines([cpu, meta])[1]
    meta.device = "meta"
    assert table_lines([cpu, meta])[1].split()[:2] == ["test", "backend"]
    assert "tracker meta" in table_lines([cpu, meta])[-1]


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
        with gpumem.phase(f"ddp.forward@rank{rank}"):
            torch.ones(1024 * (rank + 1))
        with gpumem.phase(f"ddp.backward@rank{rank}"):
            torch.ones(4096 * (1 + 6 * rank))

def test_other_phases(gpumem):
    with gpumem.phase("load"):
        torch.ones(256)
    with gpumem.phase("decode"):
        torch.ones(512)
"""


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
    tracker.makepyfile(test_mixed=MIXED)
    result = tracker.runpytest("--gpumem-report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    report = _report(result)
    assert max(map(len, report)) <= int(columns or 120), "\n".join(report)
    assert report[0] == "test ids without their common prefix test_mixed.py::"
    assert report[1].split()[:3] == ["test", "forward", "backward"]  # shared by 3 tests of 5
    assert len(report) == 3 + 5  # caption, header, rule, a row per test
    assert len({line.split()[0] for line in report[3:]}) == 5  # ids cut where they stay apart
    # rank 1's backward: 4 * 4096 * 7 = 114,688 B = 112.0 KiB, the worst; only the count where it is cut
    ranks = next(line for line in report if line.startswith("test_ranks "))
    assert "ddp.forward 8.0 KiB @rank1 · ddp.backward 112.0 KiB @rank1" in ranks or ranks.endswith(" more")


def test_verbose_report_and_markdown_have_a_row_per_phase(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_mixed=MIXED)
    (tracker.path / "reports").mkdir()
    result = tracker.runpytest("--gpumem-report", "--gpumem-markdown=reports/m.md", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    report = _report(result)
    ranks = next(i for i, line in enumerate(report) if line.startswith("test_ranks "))
    rows = [line.split()[0] for line in report[ranks + 1 : ranks + 5]]
    assert rows == ["ddp.forward@rank0", "ddp.backward@rank0", "ddp.forward@rank1", "ddp.backward@rank1"]
    markdown_lines = (tracker.path / "reports" / "m.md").read_text().splitlines()
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
