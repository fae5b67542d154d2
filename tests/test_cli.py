"""`pytest-gpumem compare` and `merge` over real `--gpumem-json` reports (tracker, exact bytes); compare fails on
a test that failed in the new run, and only warns about one measured on another backend or device."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_gpumem.cli import main
from pytest_gpumem.results import PhaseResult, Status, TestResult
from pytest_gpumem.results.report_file import read_report

SUITE = """
import os
import pytest, torch

N = int(os.environ["N"])  # float32 elements made in phase "made" by test_a

def test_a(gpumem):
    with gpumem.phase("made"):
        torch.ones(N)

@pytest.mark.skipif(os.environ.get("ONLY_A") == "1", reason="left out")
def test_b(gpumem):
    torch.ones(10)
"""


def _report(pytester: pytest.Pytester, name: str, n: int, only_a: bool = False) -> Path:
    pytester.makepyfile(test_suite=SUITE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("N", str(n))
        mp.setenv("ONLY_A", "1" if only_a else "0")
        pytester.runpytest(f"--gpumem-json={name}", "-p", "no:randomly")
    return pytester.path / name


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def _cli(*args: object) -> Run:
    """`pytest-gpumem ARGS` in this process (the installed command is tested once, below)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in args])
    return Run(code, out.getvalue(), err.getvalue())


def test_same_figures_pass(tracker: pytest.Pytester) -> None:
    old, new = _report(tracker, "old.json", 1000), _report(tracker, "new.json", 1000)
    run = _cli("compare", old, new)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "2 tests compared (3 peaks); 0 added, 0 removed"


def test_growth_beyond_the_tolerance_fails_with_the_baselines_arithmetic(tracker: pytest.Pytester) -> None:
    old = _report(tracker, "old.json", 1000)  # 4,000 B
    at_limit, over = _report(tracker, "limit.json", 1100), _report(tracker, "over.json", 1101)  # 4,400 / 4,404 B
    assert _cli("compare", old, at_limit, "--tolerance", "10", "--slack", "0").returncode == 0
    run = _cli("compare", old, over, "--tolerance", "10", "--slack", "0")
    assert run.returncode == 1
    assert (
        "regressed: test_suite.py::test_a: made peak 4.3 KiB is 10.1% above baseline 3.9 KiB (tolerance 10%)"
        in run.stdout
    )
    assert "2 tests compared (3 peaks): 2 regressed; 0 added, 0 removed" in run.stdout  # phase and call
    assert _cli("compare", old, over, "--tolerance", "10").returncode == 0  # the default 1 MiB slack


def test_added_removed_and_markdown(tracker: pytest.Pytester) -> None:
    old, new = _report(tracker, "old.json", 1000), _report(tracker, "new.json", 500, only_a=True)
    run = _cli("compare", old, new, "--markdown", tracker.path / "diff.md")
    assert run.returncode == 0
    assert "removed: test_suite.py::test_b" in run.stdout
    assert "IMPROVED" not in run.stdout  # 2,000 B below 4,000 B is within the default 1 MiB slack
    md = (tracker.path / "diff.md").read_text(encoding="utf-8")
    assert md.startswith("| test ")
    assert "| test_suite.py::test_a | made    | 3.9 KiB | 2.0 KiB | -50.0%   | ok       |" in md
    assert "- removed: `test_suite.py::test_b`" in md


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "not a file"),
        ("{", "cannot read a gpumem report"),
        ("[]", "not a gpumem report"),
        ('{"tests": 3}', 'report has no "version"'),
    ],
)
def test_unreadable_input_exits_2_naming_the_file(tmp_path: Path, content: str | None, problem: str) -> None:
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    good.write_text('{"version": 1, "backend": null, "device": null, "commit": null, "tests": []}', encoding="utf-8")
    if content is not None:
        bad.write_text(content, encoding="utf-8")
    run = _cli("compare", good, bad)
    assert run.returncode == 2
    assert run.stderr.startswith(f"pytest-gpumem compare: error: {bad}: {problem}")
    assert len(run.stderr.splitlines()) == 1


def test_merge_shards_and_refuse_disagreeing_duplicates(tracker: pytest.Pytester) -> None:
    a = _report(tracker, "a.json", 1000, only_a=True)
    b = _report(tracker, "b.json", 1000)
    run = _cli("merge", a, b, "-o", tracker.path / "all.json")
    assert run.returncode == 0, run.stderr
    merged = json.loads((tracker.path / "all.json").read_text(encoding="utf-8"))
    assert sorted(t["nodeid"] for t in merged["tests"]) == ["test_suite.py::test_a", "test_suite.py::test_b"]
    assert (merged["version"], merged["backend"]) == (1, "tracker")
    c = _report(tracker, "c.json", 2000)
    run = _cli("merge", a, c, "-o", tracker.path / "bad.json")
    assert run.returncode == 2
    assert f"test_suite.py::test_a is in {a} and in {c} with different figures" in run.stderr
    assert not (tracker.path / "bad.json").exists()


RICH = """
import pytest, torch

@pytest.mark.max_memory("1 MiB", forward="64 KiB")
def test_phases(gpumem):
    gpumem.info["rows"] = [1, 2.5, None, "x"]
    with gpumem.phase("forward"):
        a = torch.ones(1000)
    with gpumem.phase("backward"):
        b = torch.ones(250)

@pytest.mark.max_memory("1 KiB")
def test_over_budget(gpumem):
    torch.ones(1000)

def test_unmeasured():
    pass
"""


class Kept:
    """The session's results as the plugin hands them over (`pytest_gpumem_session_results`)."""

    results: tuple[TestResult, ...] = ()

    def pytest_gpumem_session_results(self, config: pytest.Config, results: tuple[TestResult, ...]) -> None:
        self.results = tuple(results)


def test_a_report_reads_back_as_the_results_the_run_wrote(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_rich=RICH)
    tracker.runpytest("--gpumem-update", "-p", "no:randomly")
    kept = Kept()
    tracker.runpytest("--gpumem-json=run.json", "--gpumem-explain", "-p", "no:randomly", plugins=[kept])
    read = read_report(tracker.path / "run.json").tests
    assert [t.status.value for t in read] == ["ok", "OVER BUDGET"]
    assert read[0].verdict is not None and read[0].baseline_entry is not None and read[0].explanation is not None
    assert read == kept.results


SHA = "0adb9b476b4034e0bb7f5986d859d26be9607eb1"
OTHER = "1f3e2d10c9b8a7f6e5d4c3b2a1f0e9d8c7b6a5f4"


def _shard(path: Path, nodeid: str, commit: object) -> Path:
    """A one-test report as --gpumem-json writes it, made at ``commit``."""
    test = TestResult.of(nodeid, "tracker", "cpu", PhaseResult("call", 4000, 4000, None, 0)).to_json()
    doc = {"version": 1, "backend": "tracker", "device": "cpu", "commit": commit, "tests": [test]}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_merge_keeps_the_commit_every_shard_was_made_at(tmp_path: Path) -> None:
    commit = {"sha": SHA, "dirty": False}
    a, b = _shard(tmp_path / "a.json", "t.py::test_a", commit), _shard(tmp_path / "b.json", "t.py::test_b", commit)
    run = _cli("merge", a, b, "-o", tmp_path / "all.json")
    assert (run.returncode, run.stderr) == (0, "")
    assert json.loads((tmp_path / "all.json").read_text(encoding="utf-8"))["commit"] == commit


@pytest.mark.parametrize(
    ("commit", "said"),
    [
        ({"sha": OTHER, "dirty": False}, "at 1f3e2d1"),
        ({"sha": SHA, "dirty": True}, "at 0adb9b4 with uncommitted changes"),
        (None, "with no commit recorded"),
    ],
)
def test_merge_of_shards_made_at_other_commits_records_none_and_says_so(
    tmp_path: Path, commit: object, said: str
) -> None:
    a = _shard(tmp_path / "a.json", "t.py::test_a", {"sha": SHA, "dirty": False})
    b = _shard(tmp_path / "b.json", "t.py::test_b", commit)
    out = tmp_path / "all.json"
    run = _cli("merge", a, b, "-o", out)
    assert run.returncode == 0
    assert json.loads(out.read_text(encoding="utf-8"))["commit"] is None
    assert run.stderr == f"pytest-gpumem merge: {a} was made at 0adb9b4, {b} {said}: {out} records no commit\n"


def test_merge_refuses_a_commit_that_is_no_commit(tmp_path: Path) -> None:
    a = _shard(tmp_path / "a.json", "t.py::test_a", None)
    b = _shard(tmp_path / "b.json", "t.py::test_b", "HEAD")
    run = _cli("merge", a, b, "-o", tmp_path / "all.json")
    assert run.returncode == 2
    assert run.stderr == (
        f'pytest-gpumem merge: error: {b}: commit must be {{"sha": a full commit hash, "dirty": true or false}} '
        "or null, got 'HEAD'\n"
    )
    assert not (tmp_path / "all.json").exists()


def test_installed_as_a_command() -> None:
    command = shutil.which("pytest-gpumem", path=str(Path(sys.executable).parent))
    launch = [sys.executable, "-m", "pytest_gpumem"] if command is None else [command]
    run = subprocess.run([*launch, "compare", "--help"], capture_output=True, text=True, check=False)
    assert run.returncode == 0
    assert "--tolerance PCT" in run.stdout


def test_help_names_each_command_on_a_line_that_fits_80_columns() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest_gpumem", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert run.returncode == 0
    described = {line.split()[0] for line in run.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert {"compare", "merge", "history", "replay"} <= described
    assert max(len(line) for line in run.stdout.splitlines()) <= 80


def test_the_example_workflow_uses_real_options(pytester: pytest.Pytester) -> None:
    import re

    example = Path(__file__).parent.parent / "examples" / "github-actions.yml"
    used = set(re.findall(r"--gpumem-[a-z-]+", example.read_text(encoding="utf-8")))
    assert {"--gpumem-backend", "--gpumem-strict", "--gpumem-update"} <= used
    help_text = pytester.runpytest("--help").stdout.str()
    assert sorted(option for option in used if option not in help_text) == []


def one_test_report(path: Path, status: str, peak: int, backend: str = "tracker") -> Path:
    test = TestResult.of(
        "t.py::test_a", backend, "cpu", PhaseResult("call", peak, peak, None, 0), status=Status(status)
    )
    doc = {"version": 1, "backend": backend, "device": "cpu", "commit": None, "tests": [test.to_json()]}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def compared(capsys: pytest.CaptureFixture[str], old: Path, new: Path) -> tuple[int, str]:
    code = main(["compare", str(old), str(new)])
    return code, capsys.readouterr().out


def test_a_test_that_failed_in_the_new_run_fails_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = one_test_report(tmp_path / "old.json", "ok", 80)
    code, out = compared(capsys, old, one_test_report(tmp_path / "new.json", "OUT OF MEMORY", 0))
    assert code == 1
    assert "failed in the new run: t.py::test_a (OUT OF MEMORY)" in out


def test_another_backend_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = one_test_report(tmp_path / "old.json", "ok", 80)
    code, out = compared(capsys, old, one_test_report(tmp_path / "other.json", "ok", 80, backend="cuda"))
    assert code == 0
    assert "warning: t.py::test_a was measured on another backend or device than before" in out


def test_growth_from_a_tiny_peak_is_said_in_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = one_test_report(tmp_path / "old.json", "ok", 8)
    code, out = compared(capsys, old, one_test_report(tmp_path / "new.json", "ok", 8 << 20))  # 8 B, then 8 MiB
    assert code == 1
    assert out.splitlines()[2].split("  ")[-2:] == ["+8.0 MiB", "REGRESSED"]  # not +104857500.0%
    assert "regressed: t.py::test_a: call peak 8.0 MiB is 8.0 MiB above baseline 8 B (tolerance 5% + 1.0 MiB)" in out
