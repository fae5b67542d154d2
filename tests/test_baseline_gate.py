"""The README's memory gate as a contributor meets it: a unit test that allocates nothing needs no baseline,
the documented record command stores what a regression needs to name the modules that grew,
`--gpumem-update=new` never waves a stored test through, `--gpumem-update PATH` records PATH's tests, and
`pytest-gpumem compare --markdown` lists what changed."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
from builders import BASELINES, stored_entries

from pytest_gpumem.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"


def _gate_commands() -> tuple[list[str], list[str]]:
    """The pytest arguments of the README's two gate commands: (record, enforce), the step summary a file."""
    section = README.read_text(encoding="utf-8").split("## Gate pull requests on memory", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    record, enforce = (shlex.split(line.split("#", 1)[0]) for line in block.splitlines())
    assert record[0] == enforce[0] == "pytest"
    enforce = [arg.replace("$GITHUB_STEP_SUMMARY", "summary.md") for arg in enforce]
    return record[1:], enforce[1:]


RECORD, ENFORCE = _gate_commands()


def test_a_test_that_allocates_nothing_needs_no_baseline(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_units="""
        import torch

        def test_arithmetic():
            assert 1 + 1 == 2

        def test_parsing():
            assert int("3") == 3

        def test_tensor():  # 1,200,000 B: past the slack, so it needs a baseline
            assert torch.ones(300_000).sum() == 300_000
        """
    )
    recorded = pytester.runpytest(*RECORD)
    recorded.assert_outcomes(passed=3)
    recorded.stdout.fnmatch_lines(
        [
            "2 measured tests allocate nothing (0 B in every phase): no baseline needed",
            f"wrote {pytester.path / BASELINES}: 1 added, 0 updated, 0 unchanged, 0 removed",
        ]
    )
    assert list(stored_entries(pytester)) == ["test_units.py::test_tensor"]
    gate = pytester.runpytest(*ENFORCE)
    gate.assert_outcomes(passed=3)
    gate.stdout.fnmatch_lines(
        ["2 measured tests allocate nothing (0 B in every phase): no baseline needed", "gpumem: 3 measured: 3 ok"]
    )
    assert "MISSING" not in (pytester.path / "summary.md").read_text(encoding="utf-8")


def test_an_update_drops_the_baseline_of_a_test_that_now_allocates_nothing(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_one="import os, torch\n\ndef test_one(gpumem):\n    torch.ones(int(os.environ['N']))\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("N", "1000")
        tracker.runpytest("--gpumem-update").assert_outcomes(passed=1)
        assert list(stored_entries(tracker)) == ["test_one.py::test_one"]
        env.setenv("N", "0")
        emptied = tracker.runpytest("--gpumem-update")
    emptied.assert_outcomes(passed=1)
    emptied.stdout.fnmatch_lines(
        [
            "1 measured test allocates nothing (0 B in every phase): no baseline needed",
            f"wrote {tracker.path / BASELINES}: 0 added, 0 updated, 0 unchanged, 1 removed",
        ]
    )
    assert stored_entries(tracker) == {}


MODEL = """
import torch
from torch import nn

HIDDEN = {hidden}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(256, 256)
        self.head = nn.Linear(256, HIDDEN)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))

def test_step():
    model = Net()
    model(torch.randn(8, 256)).sum().backward()
"""


def test_the_documented_record_command_lets_a_regression_name_the_module_that_grew(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_model=MODEL.format(hidden=256))
    pytester.runpytest(*RECORD).assert_outcomes(passed=1)
    assert "composition" in stored_entries(pytester)["test_model.py::test_step"]
    pytester.makepyfile(test_model=MODEL.format(hidden=4096))  # head: 4096 x 256 float32, 4 MiB, and its grad
    grown = pytester.runpytest(*ENFORCE)
    grown.assert_outcomes(failed=1)
    grown.stdout.fnmatch_lines(
        [
            "_* test_step _*",
            "call peak 8.5 MiB is 738.5% above baseline 1.0 MiB (tolerance 5% + 1.0 MiB):",  # the section's line,
            "  head +7.5 MiB: gradients +3.8 MiB, parameters +3.8 MiB",  # past 120 columns, goes on here
        ]
    )


def test_a_baseline_without_composition_gives_the_command_that_records_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_model=MODEL.format(hidden=256))
    pytester.runpytest(*RECORD).assert_outcomes(passed=1)
    path = pytester.path / BASELINES
    data = json.loads(path.read_text(encoding="utf-8"))
    del data["entries"]["test_model.py::test_step"]["tracker | cpu"]["composition"]  # as an older version wrote
    path.write_text(json.dumps(data), encoding="utf-8")
    pytester.makepyfile(test_model=MODEL.format(hidden=4096))
    grown = pytester.runpytest(*ENFORCE)
    grown.assert_outcomes(failed=1)
    grown.stdout.fnmatch_lines(
        [
            "_* test_step _*",
            "call peak 8.5 MiB is 738.5% above baseline 1.0 MiB (tolerance 5% + 1.0 MiB)",
            "also: to see what grew, record the baseline with its composition: "  # past 120 characters
            "pytest --gpumem-backend=tracker --gpumem-all test_model.py::test_step --gpumem-update",
        ]
    )


STORED = """
import os, torch

N = int(os.environ.get("N", "1000"))
SCALE = float(os.environ.get("SCALE", "1"))

def test_grows(gpumem):
    torch.ones(N)

def test_grads(gpumem):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    (model(torch.ones(2, 4)).sum() * SCALE).backward()
    gpumem.check_gradients(model)
"""


def test_update_new_fails_a_stored_test_as_a_run_without_it_would(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_stored=STORED)
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=2)
    before = (tracker.path / BASELINES).read_bytes()
    tracker.makepyfile(test_stored=STORED, test_added="import torch\n\ndef test_added(gpumem):\n    torch.ones(10)\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("N", "2000")  # test_grows makes twice as much
        env.setenv("SCALE", "2")  # test_grads' gradients double
        result = tracker.runpytest("--gpumem-update=new", "--gpumem-slack=0", "--gpumem-report", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "_* test_grows _*",
            "call peak 7.8 KiB is 100.0% above baseline 3.9 KiB (tolerance 5%): "
            "(outside modules) +3.9 KiB, inputs and other",
            "_* test_grads _*",
            "gradients changed in 2 of 2 parameters; "
            "worst: gradient 'bias' L2 norm +100.0%, gradient 'weight' L2 norm +100.0%",
        ]
    )
    result.stdout.fnmatch_lines(["*test_grows*REGRESSED*", "*test_grads*GRADIENTS CHANGED*"])
    result.stdout.fnmatch_lines([f"wrote {tracker.path / BASELINES}: 1 added, 0 updated, 0 unchanged, 0 removed"])
    entries = stored_entries(tracker)
    assert sorted(entries) == ["test_added.py::test_added", "test_stored.py::test_grads", "test_stored.py::test_grows"]
    stored_before = json.loads(before)["entries"]
    assert all(entries[n] == stored_before[n]["tracker | cpu"] for n in stored_before)


def test_a_test_path_right_after_update_is_a_test_path(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_x="import torch\n\ndef test_x(gpumem):\n    torch.ones(10)\n",
        test_other="import torch\n\ndef test_other(gpumem):\n    torch.ones(10)\n",
    )
    result = tracker.runpytest("--gpumem-update", "test_x.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"wrote {tracker.path / BASELINES}: 1 added, 0 updated, 0 unchanged, 0 removed"])
    assert list(stored_entries(tracker)) == ["test_x.py::test_x"]
    again = tracker.runpytest("--gpumem-update=new", "test_other.py::test_other")
    again.assert_outcomes(passed=1)
    assert sorted(stored_entries(tracker)) == ["test_other.py::test_other", "test_x.py::test_x"]
    refused = tracker.runpytest("--gpumem-update", "nwe")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(
        [
            "*: error: argument --gpumem-update: invalid mode 'nwe' "
            "(new or all; or a test path, but there is no file or folder of that name)"
        ]
    )


SUITE = """
import os, pytest, torch

N = int(os.environ["N"])

@pytest.mark.parametrize("k", range(4))
def test_same(gpumem, k):
    with gpumem.phase("forward"):
        torch.ones(100 + k)

def test_moved(gpumem):
    with gpumem.phase("forward"):
        torch.ones(N)
"""


def _report(pytester: pytest.Pytester, name: str, n: int) -> Path:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("N", str(n))
        pytester.runpytest(f"--gpumem-json={name}", "-p", "no:randomly").assert_outcomes(passed=5)
    return pytester.path / name


def test_compare_markdown_lists_only_the_changed_peaks(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_suite=SUITE)
    old, new = _report(tracker, "old.json", 1000), _report(tracker, "new.json", 500_000)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["compare", str(old), str(new), "--markdown", str(tracker.path / "diff.md")])
    assert code == 1
    markdown = (tracker.path / "diff.md").read_text(encoding="utf-8")
    rows = [line for line in markdown.splitlines() if re.match(r"\| test_suite", line)]
    assert [row.split("|")[2].strip() for row in rows] == ["call", "forward"]
    assert all("test_moved" in row and "REGRESSED" in row for row in rows)
    assert "8 unchanged peaks (the same bytes in both reports) not listed" in markdown.splitlines()
    assert out.getvalue().count("test_same") == 8  # the terminal keeps every row
