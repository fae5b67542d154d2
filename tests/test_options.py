"""Command-line and ini options, the header, the report, the JSON and Markdown files, start-up errors,
what an idle plugin costs (no torch, no measuring modules), and the package as published (one version, its
licence)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from builders import Reported

import pytest_gpumem
from pytest_gpumem import options as options_table
from pytest_gpumem import values
from pytest_gpumem.config import BaselineOptions, Options

HAS_CUDA = torch.cuda.is_available()

TWO_TESTS = """
import pytest, torch

@pytest.mark.max_memory(forward="1 MiB")
def test_step(gpumem):
    x = torch.randn(1000, requires_grad=True)
    y = torch.randn(1000)
    with gpumem.phase("forward"):
        loss = (x * y).sum()
    with gpumem.phase("backward"):
        loss.backward()

def test_plain():
    pass
"""

PIPE_IN_ID = """
import pytest

@pytest.mark.parametrize("p", ["a|b"])
def test_it(gpumem, p):
    pass
"""


def test_help_lists_every_option_with_its_ini_twin(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "GPU memory budgets (pytest-gpumem):",
            "*--gpumem-backend=NAME*",
            "*--gpumem-round=auto|none|cuda*",
            "*--gpumem-report*",
            "*--gpumem-json=PATH*",
            "*gpumem_backend (string)*",
        ]
    )
    shown = result.stdout.str()
    assert [o.flag for o in options_table.OPTIONS if o.flag not in shown] == []
    assert [o.ini for o in options_table.OPTIONS if o.ini is not None and f"{o.ini} (" not in shown] == []


def test_each_option_fills_one_field_and_each_field_but_backend_given_is_filled_by_one() -> None:
    filled = [option.field for option in options_table.OPTIONS if option.writer is None] + ["writers"]
    fields = [name for cls in (Options, BaselineOptions) for name in cls._fields]
    assert sorted(filled) == sorted(set(fields) - {"backend_given"})
    assert len(fields) == len(set(fields))


def test_the_report_table_the_json_file_and_the_markdown_table(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(test_two=TWO_TESTS, test_pipe=PIPE_IN_ID)
    result = tracker.runpytest("--gpumem-report", "--gpumem-json=out.json", "--gpumem-markdown=m.md")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "*= gpumem report =*",
            "test*call peak*budget*status*phases",
            "*",
            "test_pipe.py::test_it[[]a|b[]]*0 B*ok",
            "test_two.py::test_step*11.7 KiB*forward=1 MiB*ok*forward 3.9 KiB · backward 3.9 KiB",
        ]
    )
    result.stdout.no_fnmatch_line("*::test_plain*")
    test = reported()["test_step"]
    assert (test["backend"], test["device"], test["status"]) == ("tracker", "cpu", "ok")
    assert test["phases"]["forward"]["peak_bytes"] == 4004  # x*y (4000) and the sum (4)
    assert test["phases"]["backward"]["peak_bytes"] == 4004  # seed (4) and grad*y (4000)
    assert (test["budget"], test["budget_text"]) == ({"forward": 1024**2}, "forward=1 MiB")
    # x, y and x.grad (4000 each), the loss and the backward seed (4 each), all made in the call
    assert test["peak_bytes"] == test["call"]["peak_bytes"] == 12008
    doc = json.loads((tracker.path / "out.json").read_text())
    assert (doc["version"], doc["backend"], doc["device"], len(doc["tests"])) == (1, "tracker", "cpu", 2)
    lines = (tracker.path / "m.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| test "))
    (row,) = [line for line in lines if "test_it" in line]
    assert "test_it[a\\|b]" in row
    assert row.count(" | ") == header.count(" | ")


def test_a_report_asked_for_in_the_ini_with_nothing_measured(tracker: pytest.Pytester) -> None:
    tracker.makeini("[pytest]\ngpumem_backend = tracker\ngpumem_report = true\n")
    tracker.makepyfile("def test_plain():\n    pass\n")
    result = tracker.runpytest()
    result.stdout.fnmatch_lines(
        ["gpumem: tracker (*rounding none), device cpu", "*= gpumem report =*", "no test was measured*"]
    )


@pytest.mark.parametrize(
    ("folder", "given", "message"),
    [
        (False, "nowhere/out.json", "ERROR: --gpumem-json=nowhere/out.json: folder */nowhere does not exist"),
        (True, "out", "ERROR: --gpumem-json=out: */out is a folder, not a file"),
        (False, "a" * 300, "ERROR: --gpumem-json=aaa*: cannot write a file there: File name too long"),
    ],
)
def test_a_json_file_that_cannot_be_written_is_refused_before_the_run(
    tracker: pytest.Pytester, folder: bool, given: str, message: str
) -> None:
    if folder:
        (tracker.path / given).mkdir()
    result = tracker.runpytest(f"--gpumem-json={given}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(
    ("parse", "value", "message"),
    [
        (values.rounding, "banana", "invalid rounding 'banana' (choose from auto, none, cuda)"),
        (values.backend_name, "no such", "invalid backend name 'no such' (auto, cuda, accelerator, tracker)"),
        (values.device_name, "gpu", "invalid device 'gpu' (cpu, or meta: a prediction without data)"),
        (values.code_paths, "tpu", "invalid paths 'tpu' (cpu or gpu: whose code paths the tracker runs)"),
        (values.tolerance, "lots", "invalid tolerance 'lots' (a percentage, e.g. 5 or 2.5%)"),
        (values.seconds, "0", "invalid timeout '0' (a number of seconds above 0)"),
        (values.devices_spec, "0,0", "invalid devices '0,0': a device is named twice"),
    ],
)
def test_a_bad_option_value_is_named(parse: Callable[[str], object], value: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(value)
    assert str(refused.value) == message


def test_a_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "a file").touch()
    inside_a_file = tmp_path / "a file" / "snapshots"
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        values.folder_to_make(inside_a_file)
    assert str(refused.value).startswith(f"cannot make folder {inside_a_file}: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--gpumem-round=banana"],
            "*argument --gpumem-round: invalid rounding 'banana' (choose from auto, none, cuda)",
        ),
        (["--gpumem-backend=warp"], "ERROR: --gpumem-backend=warp: no such backend (built in: *"),
        (
            ["--gpumem-disable", "--gpumem-update"],
            "ERROR: --gpumem-update: nothing is measured under --gpumem-disable; drop one of the two",
        ),
    ],
)
def test_bad_option_values_are_usage_errors(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize(
    ("ini", "message"),
    [
        ("gpumem_round = square", "ERROR: ini option gpumem_round: invalid rounding 'square'*"),
        ("gpumem_report = maybe", "ERROR: ini option gpumem_report: *maybe*"),
        ("gpumem_json = nowhere/out.json", "ERROR: ini option gpumem_json=nowhere/out.json: folder *nowhere does not*"),
    ],
)
def test_a_bad_ini_value_is_a_usage_error_naming_the_option(pytester: pytest.Pytester, ini: str, message: str) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_option_overrides_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_backend = warp\ngpumem_round = cuda\n")
    pytester.makepyfile("def test_it(gpumem):\n    assert gpumem.backend.rounding == 'none'\n")
    pytester.runpytest("--gpumem-backend=tracker", "--gpumem-round=none").assert_outcomes(passed=1)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_backend_without_gpu_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpumem-backend=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-backend=cuda: no CUDA device is available (torch *)"])
    assert len(result.stderr.lines) <= 2


def test_header_only_when_used(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_a="def test_plain():\n    pass\n", test_b=TWO_TESTS)
    pytester.runpytest("test_a.py").stdout.no_fnmatch_line("gpumem:*")
    expected = "gpumem: cuda*" if HAS_CUDA else "gpumem: tracker (*rounding none), device cpu"
    pytester.runpytest("test_b.py").stdout.fnmatch_lines([expected])


# what a run that measures nothing loads of the package: the hooks, the option table, the marker (the header and
# the end of a run that writes files are run.header's and run.session_end's, loaded only where used)
IDLE = {
    "",
    "config",
    "constants",
    "hookspecs",
    "marker",  # its name and signature; a Budget is read only where a test is measured
    "options",
    "plugin",
    "run",
    "values",
}
IDLE |= {"run.regression", "run.session", "run.xdist"}  # not the results: read where a test was measured
IDLE |= {"report", "report.writers"}  # the writers' table: a report must not overwrite the baselines
IDLE |= {"run.late_markers"}  # a max_memory marker added too late fails its test, also in a run that measures nothing


def test_an_idle_plugin_imports_neither_torch_nor_the_measuring_modules(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import sys

        def pytest_sessionfinish(session):
            print("torch imported:", "torch" in sys.modules)
            names = (m.removeprefix("pytest_gpumem").lstrip(".") for m in sys.modules if m.startswith("pytest_gpumem"))
            print("gpumem modules:", " ".join(sorted(names)))
        """
    )
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-s", "-p", "no:xdist", "-p", "no:randomly")
    result.stdout.fnmatch_lines(["*torch imported: False*"])
    (line,) = [line for line in result.outlines if line.startswith("gpumem modules:")]
    loaded = set(line.removeprefix("gpumem modules:").split()) | {""}
    assert sorted(loaded - IDLE) == []
    assert sorted(IDLE - loaded) == []  # the list is what an idle run loads: a module moved out leaves it


PROJECT_ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pytest_gpumem.__version__"}
    assert importlib.metadata.version("pytest-gpumem") == pytest_gpumem.__version__


def test_the_declared_licence_ships() -> None:
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "MIT"
    assert (PROJECT_ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License\n")
    assert "setuptools>=77" in project["build-system"]["requires"][0]
