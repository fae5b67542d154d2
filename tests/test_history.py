"""`pytest-gpumem history`: the baseline file's committed versions, per test and phase, and the growth gate,
on scratch git repositories with fixed dates."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pytest_gpumem.baselines.compare import Tolerance
from pytest_gpumem.baselines.schema import BaselineError, loads
from pytest_gpumem.cli import main
from pytest_gpumem.history.git import Commit, Head, Version, head
from pytest_gpumem.history.series import Gate, Series, SeriesPoint, offenders, read
from pytest_gpumem.history.table import sparkline
from pytest_gpumem.report.width import display_width
from pytest_gpumem.results import PhaseResult, TestResult
from pytest_gpumem.results.baseline import DeviceIdentity, Entry

FILE = "gpumem-baselines.json"
IDENTITY = {"backend": "tracker", "device": "cpu", "capability": None, "total_memory": None}


def git(repo: Path, *args: str, day: int = 1) -> str:
    date = f"2026-11-{day:02d}T12:00:00+00:00"
    env = {**os.environ, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    done = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return done.stdout


def baselines(peaks: dict[str, int]) -> str:
    entries = {
        nodeid: {"tracker | cpu": {"cuda": None, "torch": "2.13.0", "identity": IDENTITY, "peak_bytes": peak,
                                  "phases": {"forward": peak // 2}}}
        for nodeid, peak in peaks.items()
    }  # fmt: skip
    return json.dumps({"schema": "pytest-gpumem-baselines", "version": 1, "entries": entries}, indent=2) + "\n"


def commit(repo: Path, text: str, subject: str, day: int, name: str = FILE) -> str:
    (repo / name).write_text(text)
    git(repo, "add", "-A", day=day)
    git(repo, "commit", "-q", "-m", subject, day=day)
    return git(repo, "rev-parse", "--short", "HEAD").strip()


def make_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty repository, the current folder."""
    path = tmp_path / "project"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Tester")
    git(path, "config", "user.email", "tester@example.com")
    git(path, "config", "commit.gpgsign", "false")
    monkeypatch.chdir(path)
    return path


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return make_repo(tmp_path, monkeypatch)


def creep(repo: Path) -> list[str]:
    """A test that grows 4% per commit over 6 commits (each within a 5% tolerance, the sum not)."""
    peak, shorts = 1_000_000, []
    for day in range(1, 7):
        shorts.append(commit(repo, baselines({"t.py::test_grows": peak, "t.py::test_steady": 4096}), f"c{day}", day))
        peak = peak * 104 // 100
    return shorts


def test_the_table_shows_the_creep_with_exact_figures(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shorts = creep(repo)
    assert main(["history", "--no-sparklines"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "  phase        first     latest      change       %  steps  largest step  commit",
        "t.py::test_grows  [tracker cpu]",
        f"  call     976.6 KiB    1.2 MiB  +211.6 KiB  +21.7%      5     +45.7 KiB  {shorts[5]} 2026-11-06 c6",
        f"  forward  488.3 KiB  594.1 KiB  +105.8 KiB  +21.7%      5     +22.8 KiB  {shorts[5]} 2026-11-06 c6",
        "t.py::test_steady  [tracker cpu]",
        "  call       4.0 KiB    4.0 KiB         0 B   +0.0%      0             -  -",
        "  forward    2.0 KiB    2.0 KiB         0 B   +0.0%      0             -  -",
    ]
    assert all(len(line) <= 120 for line in out)


def test_sparklines_when_asked(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    creep(repo)
    assert main(["history", "--sparklines"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].endswith("▁▂▃▅▆█")
    assert sparkline([5, 5, 5]) == "▁▁▁"
    assert sparkline(list(range(100)), 4) == "▁▃▅█"


def test_the_gate_fails_above_the_threshold_and_passes_below(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shorts = creep(repo)
    git(repo, "tag", "v1", shorts[0])
    assert main(["history", "--since", "v1", "--max-growth", "10", "--slack", "0"]) == 1
    lines = capsys.readouterr().out.splitlines()
    steps = ", ".join(
        f"{s} +{k}"
        for s, k in zip(shorts[1:], ["39.1 KiB", "40.6 KiB", "42.2 KiB", "43.9 KiB", "45.7 KiB"], strict=True)
    )
    half = ", ".join(
        f"{s} +{k}"
        for s, k in zip(shorts[1:], ["19.5 KiB", "20.3 KiB", "21.1 KiB", "22.0 KiB", "22.8 KiB"], strict=True)
    )
    assert lines[-2:] == [
        f"grew since v1: t.py::test_grows [tracker cpu] call: 976.6 KiB -> 1.2 MiB (+21.7%, more than 10%) "
        f"in 5 steps: {steps}",
        f"grew since v1: t.py::test_grows [tracker cpu] forward: 488.3 KiB -> 594.1 KiB (+21.7%, more than 10%) "
        f"in 5 steps: {half}",
    ]
    assert main(["history", "--since", "v1", "--max-growth", "30", "--slack", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no phase grew more than 30% since v1"


def test_since_a_date_starts_from_the_version_of_that_day(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shorts = creep(repo)
    assert main(["history", "--since", "2026-11-05", "--max-growth", "5", "--slack", "0"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("grew since 2026-11-05: t.py::test_grows [tracker cpu] call: 1.1 MiB -> 1.2 MiB")
    assert lines[-2].endswith(f"(+8.2%, more than 5%) in 2 steps: {shorts[4]} +43.9 KiB, {shorts[5]} +45.7 KiB")
    assert main(["history", "--since", "2026-11-05", "--max-growth", "9", "--slack", "0"]) == 0


def test_a_rename_is_followed(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = commit(repo, baselines({"t.py::test_a": 1000}), "old name", 1, name="old.json")
    git(repo, "mv", "old.json", FILE)
    git(repo, "commit", "-q", "-m", "rename", day=2)
    renamed = git(repo, "rev-parse", "--short", "HEAD").strip()
    last = commit(repo, baselines({"t.py::test_a": 1500}), "grow", 3)
    assert main(["history", "--json", "h.json"]) == 0
    doc = json.loads((repo / "h.json").read_text())
    call = doc["series"][0]
    assert (call["phase"], call["first"], call["latest"], call["percent"]) == ("call", 1000, 1500, 50.0)
    assert [short for short, _ in call["points"]] == [first, renamed, last]
    assert f"{last} 2026-11-03 grow" in capsys.readouterr().out


def test_an_unparseable_version_is_named_and_skipped(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commit(repo, baselines({"t.py::test_a": 1000}), "good", 1)
    bad = commit(repo, "{ not json", "broken by hand", 2)
    commit(repo, baselines({"t.py::test_a": 2000}), "fixed", 3)
    assert main(["history"]) == 0
    captured = capsys.readouterr()
    assert (
        f"pytest-gpumem history: skipped {bad} (2026-11-02 broken by hand): baseline file {bad}:{FILE}" in captured.err
    )
    assert "  call     1000 B  2.0 KiB" in captured.out
    assert " 1  " in captured.out.splitlines()[2]


def test_a_version_equal_to_the_last_but_for_json_types_is_checked_as_the_file_reader_checks_it() -> None:
    good = baselines({"t.py::test_a": 1})
    assert '"peak_bytes": 1,' in good
    changed = ['"peak_bytes": 1.0,', '"peak_bytes": true,', '"peak_bytes": 7, "peak_bytes": 1,']  # == 1, or 1 at last
    texts = [good, *(good.replace('"peak_bytes": 1,', text) for text in changed), good]
    versions = [
        Version(Commit(f"{i:040x}", f"{i:07x}", "2026-11-01", f"c{i}"), FILE, t.encode()) for i, t in enumerate(texts)
    ]
    parsed = read(versions)
    assert [c.short for c, _ in parsed.stores] == ["0000000", "0000004"]
    assert [entries["t.py::test_a"]["tracker | cpu"].peak_bytes for _, entries in parsed.stores] == [1, 1]
    expected = []
    for version in versions[1:4]:
        with pytest.raises(BaselineError) as refused:
            loads(version.data or b"", f"{version.commit.short}:{FILE}")
        expected.append(f"skipped {version.commit.short} (2026-11-01 {version.commit.subject}): {refused.value}")
    assert parsed.skipped == expected
    assert [line.split(": ", 3)[-1] for line in expected] == [
        "peak_bytes: expected an integer 0 <= n < 2**63 (bytes), got 1.0",
        "peak_bytes: expected an integer 0 <= n < 2**63 (bytes), got True",
        'duplicate key "peak_bytes"; fix or delete it',
    ]


def test_outside_git_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert main(["history"]) == 2
    assert capsys.readouterr().err == f"pytest-gpumem history: error: {FILE}: not inside a git repository\n"


def test_a_file_never_committed(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commit(repo, "x\n", "something else", 1, name="README")
    assert main(["history"]) == 2
    err = capsys.readouterr().err
    assert err == f"pytest-gpumem history: error: {FILE}: never committed (history reads its committed versions)\n"


def test_a_shallow_clone_says_how_far_back(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shorts = creep(repo)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "2", f"file://{repo}", str(clone)], check=True)
    monkeypatch.chdir(clone)
    assert main(["history"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"pytest-gpumem history: shallow clone: the history goes back to 2026-11-05 ({shorts[4]}); "
        "run `git fetch --unshallow` to read all of it\n"
    )
    assert "+4.0%      1" in captured.out


def test_markdown_and_json_outputs(repo: Path) -> None:
    creep(repo)
    assert main(["history", "--markdown", "top.md", "--top", "1", "--json", "all.json"]) == 0
    md = (repo / "top.md").read_text().splitlines()
    assert md[0].startswith("| test ") and "`t.py::test_grows`" in md[2] and "+21.7%" in md[2]
    assert md[-1] == "3 more series (the top 1 growers shown)"
    doc = json.loads((repo / "all.json").read_text())
    assert len(doc["series"]) == 4 and doc["skipped"] == []
    assert [s["after"] - s["before"] for s in doc["series"][0]["steps"]] == [40000, 41600, 43264, 44994, 46794]


def test_json_lists_each_commit_once_and_the_points_name_them(repo: Path) -> None:
    shorts = creep(repo)
    assert main(["history", "--json", "all.json"]) == 0
    text = (repo / "all.json").read_text()
    doc = json.loads(text)
    assert (doc["version"], doc["skipped"]) == (1, [])
    assert doc["commits"][0] == {
        "short": shorts[0],
        "sha": git(repo, "rev-parse", shorts[0]).strip(),
        "date": "2026-11-01",
        "subject": "c1",
    }
    assert [c["short"] for c in doc["commits"]] == shorts
    grows = doc["series"][0]
    peaks = [1_000_000, 1_040_000, 1_081_600, 1_124_864, 1_169_858, 1_216_652]  # +4% a commit, rounded down
    assert grows["points"] == [[short, peak] for short, peak in zip(shorts, peaks, strict=True)]
    assert grows["steps"][0] == {"commit": shorts[1], "before": 1_000_000, "after": 1_040_000}
    assert grows["largest_step"] == {"commit": shorts[5], "change": 1_216_652 - 1_169_858}
    assert doc["series"][3]["largest_step"] is None  # test_steady's forward phase never changed
    assert len(text.splitlines()) == 1 + 6 + 1 + 4 + 2  # each list's opening, its items, skipped, version


def test_a_since_that_is_neither_ref_nor_date(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    creep(repo)
    assert main(["history", "--since", "nowhere", "--max-growth", "10"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "pytest-gpumem history: error: --since nowhere: neither a commit, branch or tag nor a date like 2026-11-01\n"
    )


def test_without_git_one_line_and_exit_2(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(repo / "no-bin"))
    assert main(["history"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "pytest-gpumem history: error: git is not installed (history reads the baseline file's versions from git)\n"
    )


def test_long_names_and_sparklines_fit_120_columns(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "tests/test_a_rather_long_module_name.py::test_with_parameters[" + "日本" * 30 + "]"
    for day in range(1, 21):
        commit(repo, baselines({name: 10_000 * day}), "a subject long enough to be cut at the edge " * 3, day)
    assert main(["history", "--sparklines"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(display_width(line) for line in out) <= 120
    assert out[2].endswith("▁▁▂▂▃▄▄▅▆▆▇█") and "+1900.0%" in out[2]


# ------------------------------------------------------------------- CI reports join in (--reports)

GPU = DeviceIdentity("cuda", "NVIDIA H200", "9.0", 150754820096)


def report(sha: str | None, peak: int, dirty: bool = False) -> str:
    """A --gpumem-json report of a GPU runner, made at `sha`, with one test."""
    record = Entry(
        DeviceIdentity("cuda", "NVIDIA H200", "9.0", 150754820096), peak, {"forward": peak // 2}, "2.13.0", "12.8"
    )
    phases = {"forward": PhaseResult("forward", peak // 2, peak // 2, None, 0)}
    call = PhaseResult("call", peak, peak, None, 0)
    test = TestResult.of("t.py::test_grows", "cuda", "cuda:0", call, phases, baseline_entry=record)
    commit = None if sha is None else {"sha": sha, "dirty": dirty}
    doc = {"version": 1, "backend": "cuda", "device": "cuda:0", "commit": commit, "tests": [test.to_json()]}
    return json.dumps(doc)


def test_reports_join_at_their_commits_and_the_others_are_named(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shorts = creep(repo)
    shas = [git(repo, "rev-parse", short).strip() for short in shorts]
    ci = repo / "ci"
    ci.mkdir()
    (ci / "a-gpu.json").write_text(report(shas[1], 10 << 20))
    (ci / "b-gpu.json").write_text(report(shas[4], 12 << 20))
    (ci / "c-again.json").write_text(report(shas[4], 13 << 20))  # a rerun that disagrees: the first file wins
    (ci / "d-local.json").write_text(report(None, 1))
    (ci / "e-elsewhere.json").write_text(report("f" * 40, 1))
    (ci / "f-dirty.json").write_text(report(shas[5], 1, dirty=True))
    (ci / "g-package.json").write_text('{"name": "not a report"}')
    (ci / "notes.txt").write_text("not read")
    assert main(["history", "--no-sparklines", "--reports", "ci", "--max-growth", "21", "--slack", "0"]) == 1
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[4:7] == [
        "t.py::test_grows  [cuda NVIDIA H200 cc 9.0 140.4 GiB (reports)]",
        f"  call      10.0 MiB   12.0 MiB    +2.0 MiB  +20.0%      1      +2.0 MiB  {shorts[4]} 2026-11-05 c5",
        f"  forward    5.0 MiB    6.0 MiB    +1.0 MiB  +20.0%      1      +1.0 MiB  {shorts[4]} 2026-11-05 c5",
    ]
    assert out[-1].startswith("grew: t.py::test_grows [tracker cpu] forward: 488.3 KiB -> 594.1 KiB (+21.7%")
    assert captured.err.splitlines() == [
        "pytest-gpumem history: skipped ci/d-local.json: it records no commit (made outside a git work tree, "
        "or by an older pytest-gpumem)",
        "pytest-gpumem history: skipped ci/e-elsewhere.json: made at ffffffffffff, which is not in the history read "
        f"(its commits: {shorts[0]} to HEAD)",
        f"pytest-gpumem history: skipped ci/f-dirty.json: made at {shorts[5]} with uncommitted changes "
        "(its figures are not that commit's)",
        "pytest-gpumem history: skipped ci/g-package.json: not a gpumem report "
        "(no list of tests; written by --gpumem-json?)",
        f"pytest-gpumem history: ci/c-again.json: other figures than b-gpu.json for 1 test at {shorts[4]}; "
        "b-gpu.json's are kept",
    ]
    assert main(["history", "--reports", "ci", "--max-growth", "19", "--slack", "0"]) == 1
    assert "grew: t.py::test_grows [cuda NVIDIA H200 cc 9.0 140.4 GiB (reports)] call: 10.0 MiB -> 12.0 MiB" in (
        capsys.readouterr().out
    )


def test_a_report_before_the_range_read_is_not_in_the_history(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shorts = creep(repo)
    (repo / "ci").mkdir()
    (repo / "ci" / "old.json").write_text(report(git(repo, "rev-parse", shorts[0]).strip(), 1))
    assert main(["history", "--since", shorts[2], "--reports", "ci"]) == 0
    assert capsys.readouterr().err == (
        f"pytest-gpumem history: skipped ci/old.json: made at {shorts[0]}"
        f"{git(repo, 'rev-parse', shorts[0]).strip()[7:12]}, which is not in the history read "
        f"(its commits: {shorts[2]} to HEAD)\n"
    )


def cpu_report(sha: str, peaks: dict[str, int]) -> str:
    """A --gpumem-json report of the CPU job, made at `sha`: the committed file's identity and figures."""
    tests = []
    for nodeid, peak in peaks.items():
        phases = {"forward": PhaseResult("forward", peak // 2, peak // 2, None, 0)}
        entry = Entry(DeviceIdentity("tracker", "cpu"), peak, {"forward": peak // 2}, "2.13.0", None)
        call = PhaseResult("call", peak, peak, None, 0)
        test = TestResult.of(nodeid, "tracker", "cpu", call, phases, baseline_entry=entry)
        tests.append(test.to_json())
    return json.dumps({"version": 1, "backend": "tracker", "device": "cpu", "commit": {"sha": sha, "dirty": False},
                       "tests": tests})  # fmt: skip


def test_the_gates_offenders_come_first_once_each_with_reports_of_the_same_figures(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """test_big grows 40% (past 20% + 1 MiB); test_small 50%, but by 31 KiB, within the slack."""
    (repo / "ci").mkdir()
    for day, (big, small) in enumerate([(10 << 20, 62 << 10), (14 << 20, 93 << 10)], start=1):
        peaks = {"t.py::test_big": big, "t.py::test_small": small}
        sha = git(repo, "rev-parse", commit(repo, baselines(peaks), f"c{day}", day)).strip()
        (repo / "ci" / f"{day}.json").write_text(cpu_report(sha, peaks))
    assert main(["history", "--no-sparklines", "--reports", "ci", "--max-growth", "20"]) == 1
    out = capsys.readouterr().out.splitlines()
    named = [line for line in out if line.startswith("t.py::")]
    assert named == [
        "t.py::test_big  [tracker cpu]",
        "t.py::test_big  [tracker cpu (reports)]",
        "t.py::test_small  [tracker cpu]",
        "t.py::test_small  [tracker cpu (reports)]",
    ]
    grew = [line.split(" (")[0] for line in out if line.startswith("grew:")]
    assert grew == ["grew: t.py::test_big [tracker cpu] call: 10.0 MiB -> 14.0 MiB"]  # forward: 7 MiB, at the gate


def test_reports_of_other_figures_are_said_on_the_committed_offenders_line() -> None:
    c1, c2 = Commit("a" * 40, "aaaaaaa", "2026-11-01", "c1"), Commit("b" * 40, "bbbbbbb", "2026-11-02", "c2")
    committed = Series("t.py::t", "tracker cpu", "call", [SeriesPoint(c1, 100), SeriesPoint(c2, 200)])
    reported = Series("t.py::t", "tracker cpu (reports)", "call", [SeriesPoint(c1, 100), SeriesPoint(c2, 300)], True)
    (line,) = offenders([committed, reported], Gate(Tolerance(10, 0)))
    assert line.startswith("t.py::t [tracker cpu] call: 100 B -> 200 B (+100.0%, more than 10%) in 1 step: bbbbbbb")
    assert line.endswith("; in the reports 100 B -> 300 B")


ENTRY = TestResult.of("t.py::x", "cuda", "cuda:0", PhaseResult("call", 1, 1, None, 0)).to_json()
AT = {"sha": "SHA", "dirty": False}


def doc(version: object = 1, commit: object = AT, tests: object = ()) -> str:
    """A report of the GPU runner with these in place (SHA: the head commit's hash)."""
    return json.dumps({"version": version, "backend": "cuda", "device": "cuda:0", "commit": commit, "tests": tests})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{ truncated", "cannot read a gpumem report: Expecting property name enclosed in double quotes"),
        ('{"version": 99, "tests": []}', 'report has no "backend"'),
        (doc(version=99), "version must be 1 (the report version this pytest-gpumem reads), got 99"),
        (doc(commit="HEAD"), 'commit must be {"sha": a full commit hash, '),
        (doc(commit={"sha": "SHA", "dirty": 0}), "commit.dirty must be true or false, got 0"),
        (doc(tests=[{"peak_bytes": 1}]), 'tests[0] has no "nodeid"'),
        (doc(tests=[{**ENTRY, "peak_bytes": -1}]), "tests[0].peak_bytes is not as pytest-gpumem writes it, got -1"),
        (doc(tests=[{**ENTRY, "backend": ["cuda"]}]), "tests[0].backend must be a backend's name, got ['cuda']"),
    ],
)
def test_a_broken_report_is_named_and_skipped(
    repo: Path, capsys: pytest.CaptureFixture[str], text: str, why: str
) -> None:
    creep(repo)
    (repo / "ci").mkdir()
    (repo / "ci" / "bad.json").write_text(text.replace("SHA", git(repo, "rev-parse", "HEAD").strip()))
    assert main(["history", "--reports", "ci"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"pytest-gpumem history: skipped ci/bad.json: {why}") and err.count("\n") == 1


def test_reports_from_a_folder_that_is_not_there(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    creep(repo)
    assert main(["history", "--reports", "nowhere"]) == 2
    assert capsys.readouterr().err == "pytest-gpumem history: error: --reports nowhere: not a folder\n"


# ------------------------------------------------------------------- the commit a report records

APP = "import torch\n\ndef test_zeros(gpumem):\n    torch.zeros(256, 256)  # 256 * 256 * 4 = 262,144 B\n"


def test_a_report_records_its_commit_and_joins_the_history(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    for args in (["init", "-q", "-b", "main"], ["config", "user.name", "T"], ["config", "user.email", "t@example.com"]):
        git(pytester.path, *args)
    pytester.makepyfile(test_recorded_app=APP)  # a module name of its own: inner runs share this process
    pytester.runpytest("--gpumem-backend=tracker", "--gpumem-update").assert_outcomes(passed=1)
    commit(pytester.path, (pytester.path / FILE).read_text(), "record", 1)
    (pytester.path / "ci").mkdir()
    pytester.runpytest("--gpumem-backend=tracker", "--gpumem-json=ci/run.json").assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "ci" / "run.json").read_text())
    assert doc["commit"] == {"sha": git(pytester.path, "rev-parse", "HEAD").strip(), "dirty": False}
    capsys.readouterr()
    assert main(["history", "--no-sparklines", "--reports", "ci"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "test_recorded_app.py::test_zeros  [tracker cpu (reports)]",
        "  call   256.0 KiB  256.0 KiB     0 B  +0.0%      0             -  -",
    ]


def test_a_report_outside_git_records_no_commit(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(pytester.path.parent))
    pytester.makepyfile(test_outside_app=APP)
    result = pytester.runpytest("--gpumem-backend=tracker", "--gpumem-json=run.json")
    result.assert_outcomes(passed=1)
    assert json.loads((pytester.path / "run.json").read_text())["commit"] is None
    assert "fatal" not in result.stdout.str() + result.stderr.str() and result.ret == 0


def test_head_is_dirty_for_tracked_changes_only(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert head(repo) is None  # no commit yet
    commit(repo, baselines({"t.py::test_a": 1}), "first", 1)
    sha = git(repo, "rev-parse", "HEAD").strip()
    (repo / "untracked.txt").write_text("x\n")
    assert head(repo) == Head(sha, dirty=False)
    (repo / FILE).write_text("changed\n")
    (repo / "sub").mkdir()
    assert head(repo / "sub") == Head(sha, dirty=True)  # any folder of the work tree
    monkeypatch.setenv("PATH", str(repo / "no-bin"))
    assert head(repo) is None
