"""Command-line and ini options, the header, the report, the JSON file and start-up errors."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_help_lists_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "GPU memory budgets (pytest-gpumem):",
            "*--gpumem-backend=NAME*",
            "*--gpumem-round=none|cuda*",
            "*--gpumem-report*",
            "*--gpumem-json=PATH*",
            "*gpumem_backend (string)*",
        ]
    )


def test_report_table(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(TWO_TESTS)
    result = tracker.runpytest("--gpumem-report")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*= gpumem report =*",
            "test*forward*backward*call peak*budget*status",
            "test_report_table.py::test_step*3.9 KiB*3.9 KiB*forward=1 MiB*ok",
        ]
    )
    result.stdout.no_fnmatch_line("*::test_plain*")


def test_report_from_ini(tracker: pytest.Pytester) -> None:
    tracker.makeini("[pytest]\ngpumem_backend = tracker\ngpumem_report = true\n")
    tracker.makepyfile(TWO_TESTS)
    tracker.runpytest().stdout.fnmatch_lines(["*= gpumem report =*"])


def test_report_with_nothing_measured(tracker: pytest.Pytester) -> None:
    tracker.makepyfile("def test_plain():\n    pass\n")
    tracker.runpytest("--gpumem-report").stdout.fnmatch_lines(["no test was measured*"])


def test_json(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(TWO_TESTS)
    tracker.runpytest("--gpumem-json=out.json").assert_outcomes(passed=2)
    data = json.loads((tracker.path / "out.json").read_text())
    assert data["version"] == 1
    assert (data["backend"], data["device"]) == ("tracker", "cpu")
    (test,) = data["tests"]
    assert test["nodeid"] == "test_json.py::test_step"
    assert (test["backend"], test["device"], test["status"]) == ("tracker", "cpu", "ok")
    assert test["phases"]["forward"]["peak_bytes"] == 4004  # x*y (4000) and the sum (4)
    assert test["phases"]["backward"]["peak_bytes"] == 4004  # seed (4) and grad*y (4000)
    assert test["budget"] == {"forward": 1024**2}
    assert test["budget_text"] == "forward=1 MiB"
    # x, y and x.grad (4000 each), the loss and the backward seed (4 each), all made in the call
    assert test["peak_bytes"] == test["call"]["peak_bytes"] == 12008


def test_json_into_missing_folder_is_a_usage_error(tracker: pytest.Pytester) -> None:
    result = tracker.runpytest("--gpumem-json=nowhere/out.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-json=nowhere/out.json: folder */nowhere does not exist"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpumem-round=banana"], "*argument --gpumem-round: invalid rounding 'banana' (choose from none, cuda)"),
        (["--gpumem-backend=no such"], "*argument --gpumem-backend: invalid backend name 'no such'*"),
        (["--gpumem-backend=warp"], "ERROR: --gpumem-backend=warp: no such backend (built in: *"),
    ],
)
def test_bad_option_values_are_usage_errors(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


def test_bad_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_round = square\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option gpumem_round: invalid rounding 'square'*"])


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


def test_header_when_backend_given(tracker: pytest.Pytester) -> None:
    tracker.runpytest().stdout.fnmatch_lines(["gpumem: tracker (*rounding none), device cpu"])


def test_torch_not_imported_when_unused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import sys

        def pytest_sessionfinish(session):
            print("torch imported:", "torch" in sys.modules)
        """
    )
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-s", "-p", "no:xdist", "-p", "no:randomly")
    result.stdout.fnmatch_lines(["*torch imported: False*"])
    assert "gpumem" in result.stdout.str()  # the plugin was loaded (listed among plugins)


def test_bad_ini_flag_names_the_option(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_report = maybe\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option gpumem_report: *maybe*"])


def test_a_folder_given_as_the_json_file_is_refused_before_the_run(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(TWO_TESTS)
    (tracker.path / "out").mkdir()
    result = tracker.runpytest("--gpumem-json=out")
    result.stderr.fnmatch_lines(["ERROR: --gpumem-json=out: */out is a folder, not a file"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_markdown_escapes_pipes(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("p", ["a|b"])
        def test_it(gpumem, p):
            pass
        """
    )
    tracker.runpytest("--gpumem-markdown=m.md").assert_outcomes(passed=1)
    row = (tracker.path / "m.md").read_text().splitlines()[2]
    assert "test_it[a\\|b]" in row
    assert row.count(" | ") == len((tracker.path / "m.md").read_text().splitlines()[0].split(" | ")) - 1
