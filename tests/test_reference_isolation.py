"""The reference package is loaded only where it is asked for: other projects see none of its fixtures
or options, and a project with its own `reference_losses` package runs as if ours were not there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what each subprocess here needs not load: the cache, and hypothesis's plugin (it imports hypothesis, seconds)
UNPLUGGED = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")
OUR_FIXTURES = ("gpumem_net_model", "gpumem_lm_head", "gpumem_loss_case", "gpumem_scale", "net_model", "loss_case")

THEIR_TEST = """
import sys

import reference_losses


def test_theirs(net_model):
    assert net_model == "mine"
    assert reference_losses.OWNER == "them"
    assert "reference_losses.fixtures" not in sys.modules  # nothing of ours under their package's name
"""


def _their_project(pytester: pytest.Pytester, layout: str) -> None:
    """A project with a fixture `net_model` and its own package `reference_losses`, either at its root
    or under src/ with `pythonpath = src` (then our plugin is loaded before that path is added)."""
    pytester.makeconftest("import pytest\n\n@pytest.fixture\ndef net_model():\n    return 'mine'\n")
    if layout == "src":
        pytester.makeini("[pytest]\npythonpath = src\n")
    package = (pytester.mkdir("src") if layout == "src" else pytester.path) / "reference_losses"
    package.mkdir()
    (package / "__init__.py").write_text("OWNER = 'them'\n")
    (package / "test_own.py").write_text(THEIR_TEST)
    pytester.makepyfile(test_project=THEIR_TEST)


@pytest.mark.parametrize("layout", ["root", "src"])
def test_project_with_its_own_reference_losses_runs(pytester: pytest.Pytester, layout: str) -> None:
    """Their test module and their package by name (--pyargs), in one run."""
    _their_project(pytester, layout)
    result = pytester.runpytest_subprocess("-v", "--pyargs", "test_project.py", "reference_losses", *UNPLUGGED)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random(["test_project.py::test_theirs PASSED*", "*test_own.py::test_theirs PASSED*"])


def test_unrelated_project_sees_no_reference_fixtures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--fixtures", *UNPLUGGED)
    result.stdout.fnmatch_lines(["gpumem -- *"])  # the plugin's own fixture is listed
    listed = result.stdout.str()
    assert not [name for name in OUR_FIXTURES if re.search(rf"^{name}\b", listed, re.MULTILINE)]


def test_unrelated_project_has_no_scale_option(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help", *UNPLUGGED)
    assert "--gpumem-scale" not in result.stdout.str()
    result = pytester.runpytest_subprocess("--gpumem-scale=2", *UNPLUGGED)
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_unrelated_run_does_not_import_the_package(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("import sys\n\ndef test_clean():\n    assert 'reference_losses' not in sys.modules\n")
    result = pytester.runpytest_subprocess(*UNPLUGGED)
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("how", ["-p", "pytest_plugins"])
def test_fixtures_on_request(tracker: pytest.Pytester, how: str) -> None:
    pytester = tracker
    pytester.makepyfile(
        "def test_batch(gpumem_net_model, gpumem_scale):\n"
        "    assert gpumem_scale == 0.5 and gpumem_net_model.batch == 256\n"
    )
    args = ["-p", "reference_losses.fixtures"] if how == "-p" else []
    if how == "pytest_plugins":
        pytester.makeconftest("pytest_plugins = ['reference_losses.fixtures']\n")
    result = pytester.runpytest(*args, "--gpumem-scale=0.5", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.slow  # a fresh interpreter imports torch and runs the reference suite
def test_main_job_from_the_repository_root() -> None:
    command = [sys.executable, "-m", "pytest", "--pyargs", "reference_losses", "-k", "naive_sum or dot"]
    command += ["--gpumem-scale=0.5", "--gpumem-report", *UNPLUGGED, "-o", "gpumem_backend=tracker"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "naive_sum" in done.stdout and "2 passed" in done.stdout
    assert "reference_losses: peak bytes per strategy" in done.stdout
