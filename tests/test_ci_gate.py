"""The CI gate's baseline flow: record only what is new, and never prune after a run that did not finish."""

from __future__ import annotations

import json

import pytest

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
    monkeypatch.setenv("N", "2000")  # test_old now uses twice as much: =new must not take that
    result = tracker.runpytest("--gpumem-update=new", "--gpumem-slack=0")
    result.assert_outcomes(passed=2)
    entries = _entries(tracker)
    assert sorted(entries) == ["test_suite.py::test_new", "test_suite.py::test_old"]
    assert json.dumps(entries["test_suite.py::test_old"], sort_keys=True) == old_entry
    assert (tracker.path / BASELINES).read_bytes() != before
    result.stdout.fnmatch_lines(["wrote *gpumem-baselines.json: 1 added*"])
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
    result.stderr.fnmatch_lines(["*--gpumem-update: invalid mode 'tests/' (new or all; *--gpumem-update=all)"])


SKIPPING = """
import pytest
pytest.skip("not on this machine", allow_module_level=True)

def test_gpu_only(gpumem):
    pass
"""


def _recorded_two(tracker: pytest.Pytester) -> bytes:
    tracker.makepyfile(
        test_main="def test_main(gpumem):\n    pass\n", test_other="def test_gpu_only(gpumem):\n    pass\n"
    )
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
