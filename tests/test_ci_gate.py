"""The CI gate's baseline flow: record only what is new, and never prune after a run that did not finish."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from pytest_gpumem.backends.tracker import autocast_lists

BASELINES = "gpumem-baselines.json"

TWO = """
import os, torch

def test_old(gpumem):
    torch.ones(int(os.environ.get("N", "1000")))

def test_new(gpumem):
    torch.ones(10)
"""


def _entries(pytester: pytest.Pytester) -> dict[str, object]:
    entries: dict[str, object] = json.loads((pytester.path / BASELINES).read_text(encoding="utf-8"))["entries"]
    return entries


def test_update_new_records_only_tests_without_a_baseline(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker.makepyfile(test_suite=TWO.replace("def test_new", "def _later"))
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=1)
    before = (tracker.path / BASELINES).read_bytes()
    old_entry = json.dumps(_entries(tracker)["test_suite.py::test_old"], sort_keys=True)
    tracker.makepyfile(test_suite=TWO)
    monkeypatch.setenv("N", "2000")  # test_old now uses twice as much: =new must not take that, and fails it
    result = tracker.runpytest("--gpumem-update=new", "--gpumem-slack=0")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "_* test_old _*",
            "call peak 7.8 KiB is 100.0% above baseline 3.9 KiB (tolerance 5%): "
            "(outside modules) +3.9 KiB, inputs and other",
        ]
    )
    entries = _entries(tracker)
    assert sorted(entries) == ["test_suite.py::test_new", "test_suite.py::test_old"]
    assert json.dumps(entries["test_suite.py::test_old"], sort_keys=True) == old_entry
    assert (tracker.path / BASELINES).read_bytes() != before
    result.stdout.fnmatch_lines(["wrote *gpumem-baselines.json: 1 added, 0 updated, 0 unchanged, 0 removed"])
    tracker.runpytest("--gpumem-update=all", "--gpumem-slack=0").assert_outcomes(passed=2)
    assert json.dumps(_entries(tracker)["test_suite.py::test_old"], sort_keys=True) != old_entry


def test_a_failed_test_never_writes_its_figures(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory("1 kB")
        def test_over(gpumem):
            torch.ones(1000)

        def test_assert(gpumem):
            torch.ones(10)
            assert False
        """
    )
    for mode in ("new", "all"):
        tracker.runpytest(f"--gpumem-update={mode}").assert_outcomes(failed=2)
        assert not (tracker.path / BASELINES).exists()


def test_a_bad_update_mode_is_a_usage_error(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(TWO)
    result = tracker.runpytest("--gpumem-update", "tests/")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*: error: argument --gpumem-update: invalid mode 'tests/' "
            "(new or all; or a test path, but there is no file or folder of that name)"
        ]
    )


SKIPPING = """
import pytest
pytest.skip("not on this machine", allow_module_level=True)

def test_gpu_only(gpumem):
    pass
"""


def _recorded_two(tracker: pytest.Pytester) -> bytes:
    tracker.makepyfile(
        test_main="import torch\n\ndef test_main(gpumem):\n    torch.ones(10)\n",
        test_other="import torch\n\ndef test_gpu_only(gpumem):\n    torch.ones(10)\n",
    )  # a test that allocates nothing would need no baseline
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=2)
    return (tracker.path / BASELINES).read_bytes()


def test_prune_keeps_the_baselines_of_a_module_that_skipped_itself(tracker: pytest.Pytester) -> None:
    before = _recorded_two(tracker)
    tracker.makepyfile(test_other=SKIPPING)
    result = tracker.runpytest("--gpumem-prune")
    result.stdout.fnmatch_lines(["*--gpumem-prune needs a full run*nothing removed"])
    assert (tracker.path / BASELINES).read_bytes() == before


@pytest.mark.parametrize("returncode", [None, 0])
def test_prune_keeps_everything_after_pytest_exit(tracker: pytest.Pytester, returncode: int | None) -> None:
    before = _recorded_two(tracker)
    tracker.makepyfile(
        test_main=f"import pytest\n\ndef test_main(gpumem):\n    pytest.exit('stop', returncode={returncode})\n"
    )
    tracker.runpytest("--gpumem-prune", "-p", "no:randomly")
    assert (tracker.path / BASELINES).read_bytes() == before


# ------------------------------------------------------------------- the example workflow, end to end

WORKFLOW = Path(__file__).parent.parent / "examples" / "github-actions.yml"


def _workflow() -> tuple[dict[str, str], dict[str, dict[str, str]], list[str]]:
    """The example's top-level env, each job's `run:` commands by step name (folded as YAML folds `>`),
    and the commands its comments document. A reader of this one file's shape, not of YAML in general."""
    env: dict[str, str] = {}
    runs: dict[str, dict[str, str]] = {}
    documented: list[str] = []
    section = job = step = ""
    lines = WORKFLOW.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(r"#\s+(\.venv/bin/)?pytest .*", line):
            documented.append(line.lstrip("# "))
        elif re.fullmatch(r"[a-z_]+:.*", line):
            section = line.split(":")[0]
        elif section == "env" and (found := re.fullmatch(r"  ([A-Z_]+): (.+)", line)):
            env[found[1]] = found[2]
        elif section == "jobs" and (found := re.fullmatch(r"  ([a-z-]+):", line)):
            job = found[1]
            runs[job] = {}
        elif found := re.fullmatch(r"\s+- name: (.+)", line):
            step = found[1].strip('"')
        elif found := re.fullmatch(r"(\s+)run: >", line):
            indent = len(found[1])
            block = [text.strip() for text in _indented(lines[i + 1 :], indent)]
            runs[job][step] = " ".join(block)
    return env, runs, documented


def _indented(lines: list[str], indent: int) -> list[str]:
    block = []
    for text in lines:
        if len(text) - len(text.lstrip()) <= indent:
            break
        block.append(text)
    return block


def _pytest_args(command: str, env: dict[str, str]) -> list[str]:
    """The pytest arguments of a workflow command, its variables and inputs filled in."""
    for name, value in env.items():
        command = command.replace(f'"${name}"', shlex.quote(value)).replace(f"${name}", value)
    command = command.replace("${{ inputs.mode }}", "new")
    program, *args = shlex.split(command)
    assert program.endswith("pytest"), command
    return args


APP = """
import torch

def test_annotated(gpumem):
    torch.zeros(256, 256)  # 256 * 256 * 4 = 262,144 B

def test_plain():
    torch.zeros({n}, 256)  # {n} * 256 * 4 B; measured only under --gpumem-all (a baseline above the slack)
"""


def test_the_example_workflow_records_what_it_enforces(pytester: pytest.Pytester) -> None:
    env, runs, documented = _workflow()
    env["GITHUB_STEP_SUMMARY"] = str(pytester.path / "summary.md")
    enforce_cpu = _pytest_args(runs["cpu"]["Memory tests on the tracker (exact, no GPU needed)"], env)
    enforce_gpu = runs["gpu"]["Memory tests on the GPU"]
    record_gpu = runs["gpu-record"]["Record the GPU baselines"]
    assert "$GPU_TESTS" in enforce_gpu and "$GPU_TESTS" in record_gpu  # one selection for both GPU jobs
    (record_cpu,) = (_pytest_args(c, env) for c in documented if "--gpumem-update=new" in c)
    assert shlex.split(env["CPU_TESTS"]) == [a for a in record_cpu if a != "--gpumem-update=new"]
    assert "--gpumem-strict" in enforce_cpu

    pytester.makepyfile(test_app=APP.format(n=2048))
    recorded = pytester.runpytest(*record_cpu)  # on the developer's machine
    recorded.assert_outcomes(passed=2)
    recorded.stdout.fnmatch_lines(["wrote *gpumem-baselines.json: 2 added, 0 updated, 0 unchanged, 0 removed"])
    pytester.runpytest(*enforce_cpu).assert_outcomes(passed=2)  # the pull request's CPU job
    summary = Path(env["GITHUB_STEP_SUMMARY"]).read_text(encoding="utf-8")
    assert re.search(r"\| test_app.py::test_plain +\| 2.0 MiB +\| 2.0 MiB +\|", summary), summary

    pytester.makepyfile(test_app=APP.format(n=32768))  # test_plain now makes 33,554,432 B: 16x
    regressed = pytester.runpytest(*enforce_cpu)
    regressed.assert_outcomes(passed=1, failed=1)
    regressed.stdout.fnmatch_lines(["call peak 32.0 MiB is * above baseline 2.0 MiB (tolerance 5% + 64.0 KiB)*"])

    pytester.makepyfile(
        test_app=APP.format(n=2048), test_later="import torch\n\ndef test_later():\n    torch.ones(300_000)\n"
    )
    before = (pytester.path / BASELINES).read_bytes()
    missing = pytester.runpytest(*enforce_cpu)  # a new test without a baseline fails under --gpumem-strict
    missing.assert_outcomes(passed=2, failed=1)
    missing.stdout.fnmatch_lines(
        [
            "*no baseline for this test on tracker | cpu (record one with "
            "pytest --gpumem-backend=tracker --gpumem-all --gpumem-slack=65536 --gpumem-update=new)",
            "1 measured test has no baseline for tracker | cpu in gpumem-baselines.json: record them, measuring "
            "what this run measures, with: pytest --gpumem-backend=tracker --gpumem-all --gpumem-slack=65536 "
            "--gpumem-update=new",
        ]
    )
    assert (pytester.path / BASELINES).read_bytes() == before
    added = pytester.runpytest(*record_cpu)
    added.stdout.fnmatch_lines(["wrote *: 1 added, 0 updated, 0 unchanged, 0 removed, 2 kept"])
    assert sorted(_entries(pytester)) == [
        "test_app.py::test_annotated",
        "test_app.py::test_plain",
        "test_later.py::test_later",
    ]
    pytester.runpytest(*enforce_cpu).assert_outcomes(passed=3)


def test_the_example_workflow_keeps_forks_off_the_gpu_runner_pins_torch_and_names_the_lock() -> None:
    yaml = pytest.importorskip("yaml")
    text = WORKFLOW.read_text(encoding="utf-8")
    workflow = yaml.safe_load(text)
    jobs, version = workflow["jobs"], workflow["env"]["TORCH_VERSION"]
    # the torch the README pins, whose allocator and autocast tables the tracker models
    readme = (WORKFLOW.parent.parent / "README.md").read_text(encoding="utf-8")
    tables = autocast_lists.__doc__ or ""
    assert set(re.findall(r"torch==([\d.]+)", readme)) == {version}, version
    assert f"torch {version} registers them" in tables, version
    installs = [line for job in jobs.values() for step in job["steps"] for line in step.get("run", "").splitlines()]
    torch_installs = [line for line in installs if "install" in line and "torch" in line]
    assert len(torch_installs) == 3 and all('"torch==$TORCH_VERSION"' in line for line in torch_installs)
    self_hosted = {name: " ".join(job["if"].split()) for name, job in jobs.items() if "self-hosted" in job["runs-on"]}
    assert self_hosted == {
        "gpu": "github.event_name == 'push' || (github.event_name == 'pull_request' && "
        "github.event.pull_request.head.repo.full_name == github.repository)",
        "gpu-record": "github.event_name == 'workflow_dispatch'",
    }
    assert ".gpumem-baselines.json.lock" in text


# ------------------------------------------------------- what a pull request's reviewer reads

GROWING = """
import os, torch

def test_grows(gpumem):
    torch.ones(int(os.environ.get("N", "1000")))  # 1000 float32: 4,000 B; then 2000: 8,000 B

def test_steady(gpumem):
    torch.ones(10)
"""


def test_the_markdown_summary_leads_with_the_counts_the_failures_and_how_to_record(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker.makepyfile(test_suite=GROWING)
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=2)
    tracker.makepyfile(test_later="import torch\n\ndef test_later(gpumem):\n    torch.ones(10)\n")
    monkeypatch.setenv("N", "2000")
    args = ("--gpumem-strict", "--gpumem-slack=0", "--gpumem-markdown=summary.md", "-p", "no:randomly")
    tracker.runpytest(*args).assert_outcomes(passed=1, failed=2)
    summary = (tracker.path / "summary.md").read_text(encoding="utf-8").splitlines()
    record = "pytest --gpumem-backend=tracker --gpumem-update=new"
    assert summary[:12] == [
        "**gpumem: 2 failed, 1 passed** (3 measured: 1 regressed, 1 missing baseline, 1 ok)",
        "",
        "**Failed**",
        "",
        "- `test_suite.py::test_grows` REGRESSED: call peak 7.8 KiB is 100.0% above baseline 3.9 KiB (tolerance 5%): "
        "(outside modules) +3.9 KiB, inputs and other",
        "- `test_later.py::test_later` MISSING BASELINE: no baseline for this test on tracker \\| cpu "
        f"(record one with {record})",
        "",
        "Record the baselines of the 1 test without one, measuring what this run measures:",
        "",
        "```",
        record,
        "```",
    ]
    rows = [line.split("|")[1].strip() for line in summary if line.startswith("| test_")]
    assert rows == ["test_suite.py::test_grows", "test_later.py::test_later", "test_suite.py::test_steady"]


def test_an_update_says_which_regressions_it_accepted(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker.makepyfile(test_suite=GROWING)
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=2)
    monkeypatch.setenv("N", "2000")
    accepted = tracker.runpytest("--gpumem-update", "--gpumem-slack=0")
    accepted.assert_outcomes(passed=2)
    accepted.stdout.fnmatch_lines(
        [
            "wrote *gpumem-baselines.json: 0 added, 1 updated (1 of them a regression, accepted), 1 unchanged, "
            "0 removed",
            "accepted the regression of test_suite.py::test_grows: its larger peaks are its baseline now",
        ]
    )
    monkeypatch.setenv("N", "1000")  # smaller again: an improvement is updated without a word
    improved = tracker.runpytest("--gpumem-update", "--gpumem-slack=0")
    improved.stdout.fnmatch_lines(["wrote *: 0 added, 1 updated, 1 unchanged, 0 removed"])
    assert "accepted the regression" not in improved.stdout.str()
