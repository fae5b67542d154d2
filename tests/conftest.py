from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

# Inductor compiles and loads a probe per vector ISA the CPU lists before its first compile in a cache
# folder (12 s of a cold 25 s run of four compiled tests); trusted here, in this process and the runs it
# starts, since the ISA is not what the suite tests. Before torch._dynamo, which reads the setting.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import hypothesis  # noqa: F401
import pytest
import torch
import torch._dynamo
import torch._dynamo.repro.after_dynamo  # what torch.compile imports for any backend
from builders import Reported
from filelock import FileLock

import pytest_gpumem
from pytest_gpumem.backends.tracker.backend import TrackerBackend

# pytester's in-process runs drop the modules first imported inside them, so what inner runs import
# lazily is imported here, once. torch registers operator libraries on import (torch._dynamo ->
# torch._inductor.test_operators) and torch.compile's cache artifacts (torch._inductor.runtime.
# autotune_cache), which must not happen twice. The others cost time in every inner run: hypothesis
# (its plugin imports it at the end of each run, and pytest rewrites the asserts of a plugin's whole
# distribution), this package's lazily imported modules and the reference strategies were about 90% of
# a trivial run.
torch.utils.checkpoint.checkpoint  # noqa: B018
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script_method, in torch's own modules
    import torch._inductor.compile_fx  # what the default backend imports


def _import_once(names: Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(Exception):  # a module that cannot be imported fails the tests that use it
            importlib.import_module(name)


_import_once(
    module.name
    for module in pkgutil.walk_packages(pytest_gpumem.__path__, "pytest_gpumem.", onerror=lambda name: None)
    if not module.name.endswith(".__main__")
)
# not reference_losses.fixtures: inner runs load it as a plugin (its asserts rewritten)
_import_once(f"reference_losses.{name}" for name in ("losses", "training", "distributed", "report"))


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner runs fit their report to COLUMNS: without it they use the width of no terminal, whatever
    the terminal the suite runs in (a test that wants a width sets it). Under CI (or BUILD_NUMBER) pytest
    prints whole summary lines: inner runs print what a person's terminal shows."""
    for name in ("COLUMNS", "CI", "BUILD_NUMBER"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def tracker(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester whose runs measure with the exact tracker, whatever the machine has."""
    pytester.makeini("[pytest]\ngpumem_backend = tracker\n")
    return pytester


def _tests_of(report: Path) -> dict[str, dict[str, Any]]:
    doc = json.loads(report.read_text(encoding="utf-8"))
    return {test["nodeid"].split("::", 1)[1]: test for test in doc["tests"]}


@pytest.fixture(scope="session")
def read_report() -> Callable[[Path], dict[str, dict[str, Any]]]:
    """`read_report(path)`: the tests of a JSON report (`--gpumem-json`), by the name after the file's."""
    return _tests_of


@pytest.fixture
def reported(pytester: pytest.Pytester) -> Reported:
    """The tests of an inner run's JSON report (`--gpumem-json=out.json`), by the name after the file's."""

    def read(name: str = "out.json") -> dict[str, dict[str, Any]]:
        return _tests_of(pytester.path / name)

    return read


@pytest.fixture
def runpytest_bound_by_file_modes(pytester: pytest.Pytester) -> Callable[..., pytest.RunResult]:
    """`pytester.runpytest_subprocess`, in a process that file modes bind: as root (CI runs as root), one
    without the capabilities that read and search any file (setpriv, of util-linux)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return pytester.runpytest_subprocess
    setpriv = shutil.which("setpriv")
    unbound = "--bounding-set=-dac_override,-dac_read_search"
    if setpriv is None or subprocess.run([setpriv, unbound, "true"], check=False).returncode != 0:
        pytest.skip("root reads files whatever their mode, and setpriv cannot take that away here")

    def run(*args: str) -> pytest.RunResult:
        basetemp = tempfile.mkdtemp(prefix="basetemp-", dir=pytester.path)
        return pytester.run(setpriv, unbound, sys.executable, "-m", "pytest", f"--basetemp={basetemp}", *args)

    return run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first (the order is otherwise kept): the run then ends on short tests that any worker
    can take, instead of on one worker's long one. xdist's worksteal hands each of its N workers an equal
    slice of this order at the start (and a worker that runs dry takes the end of another's): so each slice
    begins with every N-th slow test, and the workers start on the slow tests together."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    fast = [item for item in items if item.get_closest_marker("slow") is None]
    ordered: list[pytest.Item] = []
    for worker in range(workers):
        size = (len(items) - len(ordered)) // (workers - worker)  # as worksteal slices its queue
        dealt = slow[worker::workers]
        taken = max(0, size - len(dealt))
        ordered += dealt + fast[:taken]
        del fast[:taken]
    items[:] = ordered + fast


Shared = Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> Shared:
    """`shared_run(name, make)`: a run that several tests read, made once per suite run even on several
    xdist workers (the others wait for it). `make(folder)` runs it in `folder` and returns what to keep,
    as JSON; every caller gets the folder and that value back."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder the workers' temp folders share

    def shared(name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
        folder = root / f"shared-{name}"
        kept = folder / "kept.json"
        with FileLock(f"{folder}.lock"):
            if not kept.is_file():
                folder.mkdir(exist_ok=True)
                kept.write_text(json.dumps(make(folder)), encoding="utf-8")
        return folder, json.loads(kept.read_text(encoding="utf-8"))

    return shared


RunReference = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def run_reference(shared_run: Shared) -> RunReference:
    """`run_reference(pytester, *args)`: `pytest --pyargs reference_losses *args` in `pytester` (whose ini
    sets the tracker), run once per suite run by whichever test asks first. The docs' examples and the tests
    of the suite's options read the same runs: its printed lines (`lines`), outcome counts (`outcomes`)
    and the names after the file's of the tests that passed (`passed`)."""

    def run(pytester: pytest.Pytester, *args: str) -> dict[str, Any]:
        def make(folder: Path) -> dict[str, Any]:
            result = pytester.runpytest("-p", "no:cacheprovider", "--pyargs", "reference_losses", *args)
            reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
            passed = [r.nodeid.split("::", 1)[1] for r in reports if r.when == "call" and r.passed]
            lines = [*result.outlines, *result.errlines]
            return {"lines": lines, "outcomes": result.parseoutcomes(), "passed": passed}

        key = hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
        kept: dict[str, Any] = shared_run(f"reference-{key}", make)[1]
        return kept

    return run


@pytest.fixture
def cuda_rounding() -> Iterator[TrackerBackend]:
    """A started tracker whose ledger serves the CUDA caching allocator's model (`--gpumem-round=cuda`)."""
    backend = TrackerBackend(rounding="cuda")
    backend.start()
    yield backend
    backend.stop()
