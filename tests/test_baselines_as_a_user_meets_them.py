"""Stored baselines as a user meets them: record, pass, regress, improve, prune, refuse bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import BASELINES, run, stored_entries

# Each test allocates N float32 in a phase "made" (4N bytes, exactly, with the tracker).
SUITE = """
import pytest, torch

SIZES = {sizes}

@pytest.mark.parametrize("name", sorted(SIZES))
def test_alloc(gpumem, name):
    with gpumem.phase("made"):
        torch.ones(SIZES[name])
"""


def suite(pytester: pytest.Pytester, **sizes: int) -> None:
    pytester.makepyfile(test_suite=SUITE.format(sizes=sizes))


def test_record_then_pass(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000, b=2000)
    result = run(tracker, "--gpumem-update")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*- gpumem baselines -*", f"wrote */{BASELINES}: 2 added, 0 updated, 0 unchanged, 0 removed"]
    )
    entries = stored_entries(tracker)
    assert entries["test_suite.py::test_alloc[a]"]["phases"] == {"made": 4000}
    assert entries["test_suite.py::test_alloc[b]"]["phases"] == {"made": 8000}
    assert entries["test_suite.py::test_alloc[b]"]["torch"] is not None
    before = (tracker.path / BASELINES).read_bytes()
    result = run(tracker, "--gpumem-report")
    result.assert_outcomes(passed=2)
    # no test has a budget: no budget column
    result.stdout.fnmatch_lines(["test*made*call peak*baseline*change  status*", "*test_alloc?a?*+0.0%*ok*"])
    assert (tracker.path / BASELINES).read_bytes() == before
    run(tracker, "--gpumem-update").stdout.fnmatch_lines([f"*{BASELINES} unchanged: 0 added, 0 updated, 2 unchanged*"])
    assert (tracker.path / BASELINES).read_bytes() == before


def test_regression_fails_with_one_sentence(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update").assert_outcomes(passed=1)
    suite(tracker, a=1250)
    result = run(tracker, "--gpumem-report")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "call peak 4.9 KiB is 25.0% above baseline 3.9 KiB (tolerance 5%): "
            "(outside modules) +1000 B, inputs and other",
            "made peak 4.9 KiB is 25.0% above baseline 3.9 KiB (tolerance 5%): "  # past 120 characters: the section's
            "(outside modules) +1000 B, inputs and other",
            "*test_alloc?a?*+25.0%*REGRESSED*",
        ]
    )
    assert stored_entries(tracker)["test_suite.py::test_alloc[a]"]["phases"] == {"made": 4000}
    # a baseline recorded without its composition (by an older version) says how to record one
    path = tracker.path / BASELINES
    data = json.loads(path.read_text())
    del data["entries"]["test_suite.py::test_alloc[a]"]["tracker | cpu"]["composition"]
    path.write_text(json.dumps(data))
    bare = run(tracker, "--gpumem-report")
    bare.assert_outcomes(failed=1)
    bare.stdout.fnmatch_lines(
        [
            "call peak 4.9 KiB is 25.0% above baseline 3.9 KiB (tolerance 5%)",
            "*Captured gpumem call*",
            "also: to see what grew, record the baseline with its composition: "  # past 120 characters
            "pytest --gpumem-backend=tracker 'test_suite.py::test_alloc[a]' --gpumem-update",
        ]
    )


def test_improvement_passes_and_says_so(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update")
    suite(tracker, a=500)
    result = run(tracker, "--gpumem-report", "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_alloc?a?*-50.0%*IMPROVED*"])
    updated = run(tracker, "--gpumem-update")
    updated.stdout.fnmatch_lines(["wrote *: 0 added, 1 updated, 0 unchanged, 0 removed"])
    assert stored_entries(tracker)["test_suite.py::test_alloc[a]"]["phases"] == {"made": 2000}


def test_tolerance_option_sets_the_edge(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update")
    suite(tracker, a=1100)  # 10% of 4000 bytes is 400 bytes: 100 float32
    run(tracker, "--gpumem-tolerance=10").assert_outcomes(passed=1)
    suite(tracker, a=1101)
    run(tracker, "--gpumem-tolerance=10").assert_outcomes(failed=1)


def test_slack_is_added_to_the_tolerance(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update")
    suite(tracker, a=1100)
    tracker.runpytest("--gpumem-tolerance=0", "--gpumem-slack=400 B").assert_outcomes(passed=1)
    tracker.runpytest("--gpumem-tolerance=0", "--gpumem-slack=399").assert_outcomes(failed=1)
    tracker.runpytest("--gpumem-tolerance=0").assert_outcomes(passed=1)  # the default slack: 1 MiB


def test_growth_that_passes_only_by_the_slack_is_named_with_the_slack_that_fails_it(tracker: pytest.Pytester) -> None:
    """A tiny config's 20% growth passes under the 1 MiB default slack, and the run says so."""
    suite(tracker, a=100_000, b=1000)
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=2)
    suite(tracker, a=120_000, b=1000)  # 400,000 B -> 480,000 B: 60,000 B past 5%, passed by the slack
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "warning: 1 test grew past the tolerance and passed only by the 1.0 MiB slack: "
            "test_suite.py::test_alloc[[]a[]] made +20.0%; --gpumem-slack=58KiB fails it"
        ]
    )
    tracker.runpytest("--gpumem-slack=58KiB").assert_outcomes(passed=1, failed=1)  # 59,392 B < 60,000 B
    tracker.runpytest("--gpumem-slack=59KiB").assert_outcomes(passed=2)  # 60,416 B
    suite(tracker, a=100_000, b=1000)
    tracker.runpytest().stdout.no_fnmatch_line("*passed only by*")


def test_marker_tolerance_overrides(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_suite="""
        import pytest, torch

        N = 1000

        @pytest.mark.max_memory("1 MB", tolerance="50%")
        def test_loose(gpumem):
            with gpumem.phase("made"):
                torch.ones(N)
        """
    )
    run(tracker, "--gpumem-update")
    (tracker.path / "test_suite.py").write_text((tracker.path / "test_suite.py").read_text().replace("1000", "1400"))
    run(tracker).assert_outcomes(passed=1)
    run(tracker, "--gpumem-tolerance=50").assert_outcomes(passed=1)
    (tracker.path / "test_suite.py").write_text((tracker.path / "test_suite.py").read_text().replace("1400", "1600"))
    run(tracker).assert_outcomes(failed=1)


def test_missing_baseline_is_new_unless_strict_then_missing_baseline(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update")
    suite(tracker, a=1000, b=10)
    result = run(tracker, "--gpumem-report")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_alloc?b?*NEW*"])
    strict = run(tracker, "--gpumem-strict", "--gpumem-report")
    strict.assert_outcomes(passed=1, failed=1)
    strict.stdout.fnmatch_lines(
        [
            "*no baseline for this test on tracker | cpu "
            "(record one with pytest --gpumem-backend=tracker --gpumem-update=new)*"
        ]
    )
    strict.stdout.fnmatch_lines(["*test_alloc?b?*MISSING BASELINE*"])
    strict.stdout.no_fnmatch_line("*test_alloc?b?*NEW*")
    recorded = run(tracker, "--gpumem-strict", "--gpumem-update", "--gpumem-report")
    recorded.assert_outcomes(passed=2)
    recorded.stdout.fnmatch_lines(["wrote *: 1 added, 0 updated, 1 unchanged, 0 removed", "*test_alloc?b?*NEW*"])


def test_no_file_means_no_baselines(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    result = run(tracker, "--gpumem-report")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*gpumem baselines*")
    result.stdout.no_fnmatch_line("*call peak*baseline*")
    assert not (tracker.path / BASELINES).exists()


def test_unused_reported_and_pruned_only_in_a_full_run(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000, b=2000)
    run(tracker, "--gpumem-update")
    suite(tracker, a=1000)
    result = run(tracker)
    result.stdout.fnmatch_lines(
        ["1 baselines for tracker | cpu were used by no test: test_suite.py::test_alloc[[]b[]]*"]
    )
    partial = run(tracker, "-k", "a", "--gpumem-prune")
    partial.stdout.fnmatch_lines(["--gpumem-prune needs a full run*nothing removed"])
    assert "test_suite.py::test_alloc[b]" in stored_entries(tracker)
    run(tracker, "--gpumem-prune").stdout.fnmatch_lines(["wrote *: 0 added, 0 updated, 0 unchanged, 1 removed"])
    assert list(stored_entries(tracker)) == ["test_suite.py::test_alloc[a]"]


def test_failed_tests_are_not_recorded(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_suite="""
        import torch

        def test_fails(gpumem):
            with gpumem.phase("made"):
                torch.ones(10)
            assert False
        """
    )
    result = run(tracker, "--gpumem-update")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"nothing to record (no measured test passed): */{BASELINES} left as it was"])
    assert not (tracker.path / BASELINES).exists()


@pytest.mark.parametrize("update", [False, True], ids=["compare", "update"])
def test_bad_file_is_refused_and_left_alone(tracker: pytest.Pytester, update: bool) -> None:
    """One refused file for the run; every kind of refusal is a unit test (test_baselines_unit.py)."""
    suite(tracker, a=1000)
    path = tracker.path / BASELINES
    content = '{"schema": "pytest-gpumem-baselines", "version": 1, "entries": {'
    path.write_text(content)
    result = run(tracker, *(["--gpumem-update"] if update else []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    (line,) = [line for line in result.stderr.lines if line.strip()]
    assert line.startswith("ERROR: ") and BASELINES in line and "not valid JSON" in line
    assert path.read_text() == content


def test_interrupted_write_leaves_the_old_file(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update")
    before = (tracker.path / BASELINES).read_bytes()
    tracker.makeconftest(
        """
        import os

        def pytest_configure(config):
            config._real_replace = os.replace
            def broken(src, dst):
                raise OSError(28, "No space left on device")
            os.replace = broken

        def pytest_unconfigure(config):
            os.replace = config._real_replace
        """
    )
    suite(tracker, a=2000)
    result = run(tracker, "--gpumem-update")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"gpumem: *{BASELINES}*"])
    assert (tracker.path / BASELINES).read_bytes() == before
    assert [p.name for p in tracker.path.iterdir() if p.name.endswith(".tmp")] == []


def test_other_versions_warned_once(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000, b=2000)
    run(tracker, "--gpumem-update")
    path = tracker.path / BASELINES
    path.write_text(
        path.read_text().replace(
            json.dumps(stored_entries(tracker)["test_suite.py::test_alloc[a]"]["torch"]), '"1.0.0"'
        )
    )
    result = run(tracker)
    result.assert_outcomes(passed=2)
    assert result.stdout.str().count("were recorded with torch 1.0.0") == 1


GRADIENTS = """
import torch

FACTOR = {factor}
DTYPE = torch.{dtype}

def test_grads(gpumem):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(DTYPE)
    x = torch.randn(16, 64, dtype=DTYPE)
    with gpumem.phase("forward"):
        loss = (model(x) * FACTOR).float().sum()
    with gpumem.phase("backward"):
        loss.backward()
    gpumem.check_gradients(model)
"""


def test_gradient_change_caught(tracker: pytest.Pytester) -> None:
    """float32 end to end; the tolerance of each dtype is a unit test (test_gradients_unit.py)."""
    tracker.makepyfile(test_suite=GRADIENTS.format(factor=1.0, dtype="float32"))
    run(tracker, "--gpumem-update").assert_outcomes(passed=1)
    assert "gradients" in stored_entries(tracker)["test_suite.py::test_grads"]
    run(tracker).assert_outcomes(passed=1)
    tracker.makepyfile(test_suite=GRADIENTS.format(factor=1.001, dtype="float32"))
    result = run(tracker, "--gpumem-report")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*gradient*weight*", "*test_grads*GRADIENTS CHANGED*"])


def test_check_gradients_is_not_measured(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_it(gpumem):
            model = torch.nn.Linear(256, 256)
            with gpumem.phase("backward"):
                model(torch.ones(1, 256)).sum().backward()
                gpumem.check_gradients(model)
            with gpumem.phase("after"):
                gpumem.check_gradients({"w": model.weight}, rtol=0.1)
            assert gpumem.peak("after") == 0
            assert gpumem.peak("backward") < 2 * 4 * (256 * 256 + 256 + 256)

        def test_bad(gpumem):
            gpumem.check_gradients([1, 2])
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*::test_bad: gpumem.check_gradients(): fingerprint() takes an nn.Module*"])


def test_markdown(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-markdown=summary.md").assert_outcomes(passed=1)
    lines = [line for line in (tracker.path / "summary.md").read_text().splitlines() if line.startswith("|")]
    assert lines[0].startswith("| test ") and lines[1].startswith("|---")
    assert "test_suite.py::test_alloc[a]" in lines[2] and "3.9 KiB" in lines[2]


def test_help_lists_baseline_options(pytester: pytest.Pytester) -> None:
    pytester.runpytest("--help").stdout.fnmatch_lines(
        [
            "*--gpumem-markdown=PATH*",
            "*--gpumem-baseline-file=PATH*",
            "*--gpumem-update*",
            "*--gpumem-prune*",
            "*--gpumem-tolerance=PERCENT*",
            "*--gpumem-slack=SIZE*",
            "*--gpumem-strict*",
        ]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpumem-tolerance=lots"], "*invalid tolerance 'lots'*"),
        (["--gpumem-tolerance=-3"], "*invalid tolerance '-3'*"),
        (["--gpumem-slack=2 apples"], "*invalid slack '2 apples'*unknown unit 'apples'*"),
        (
            ["--gpumem-baseline-file=missing/b.json"],
            "ERROR: --gpumem-baseline-file=missing/b.json: folder * does not exist",
        ),
    ],
)
def test_bad_baseline_options(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_baseline_file_option(tracker: pytest.Pytester, tmp_path: Path) -> None:
    suite(tracker, a=1000)
    target = tmp_path / "elsewhere.json"
    run(tracker, "--gpumem-update", f"--gpumem-baseline-file={target}")
    assert target.exists() and not (tracker.path / BASELINES).exists()


def test_prune_never_removes_what_the_run_did_not_select(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_backend = tracker\ntestpaths = tests\n")
    (pytester.path / "tests" / "sub").mkdir(parents=True)
    a = "import torch\n\ndef test_a(gpumem):\n    torch.ones(1000)\n"
    b = "import torch\n\ndef test_b(gpumem):\n    torch.ones(2000)\n"
    (pytester.path / "tests" / "test_a.py").write_text(a)
    (pytester.path / "tests" / "sub" / "test_b.py").write_text(b)
    pytester.runpytest("--gpumem-update").assert_outcomes(passed=2)
    before = (pytester.path / BASELINES).read_bytes()
    for args in (["--ignore=tests/sub"], ["--deselect=tests/test_a.py::test_a"], ["-k", "test_a"], ["tests/sub"]):
        result = pytester.runpytest("--gpumem-prune", *args)
        result.stdout.fnmatch_lines(["--gpumem-prune needs a full run*nothing removed"])
        assert (pytester.path / BASELINES).read_bytes() == before
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(pytester.path / "tests" / "sub")
    try:
        result = pytester.runpytest("--gpumem-prune")
    finally:
        monkeypatch.undo()
    result.stdout.fnmatch_lines(["--gpumem-prune needs a full run*nothing removed"])
    assert (pytester.path / BASELINES).read_bytes() == before


def test_prune_after_every_measured_test_is_gone(tracker: pytest.Pytester) -> None:
    suite(tracker, a=1000)
    run(tracker, "--gpumem-update")
    tracker.makepyfile(test_suite="def test_plain():\n    pass\n")
    result = run(tracker, "--gpumem-prune")
    result.stdout.fnmatch_lines(["wrote *: 0 added, 0 updated, 0 unchanged, 1 removed"])
    assert stored_entries(tracker) == {}
