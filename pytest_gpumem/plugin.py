"""pytest hooks of pytest-gpumem; each delegates to the run's `GpuMemSession`."""

from __future__ import annotations

import argparse
from collections.abc import Generator
from pathlib import Path

import pytest

from pytest_gpumem import hookspecs
from pytest_gpumem.backends import make_builtin
from pytest_gpumem.backends.base import Backend
from pytest_gpumem.backends.tracker import ROUNDINGS
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.markers import MARKER, MARKER_SIGNATURE
from pytest_gpumem.meter import GpuMem
from pytest_gpumem.report import table
from pytest_gpumem.session import METER_KEY, GpuMemSession, Options
from pytest_gpumem.xdist import WORKER_RESULTS

SESSION_KEY = pytest.StashKey[GpuMemSession]()

# the reference strategies' fixtures, option and report section (they import torch only when used)
pytest_plugins = ["reference_losses.fixtures"]


def _backend_name(value: str) -> str:
    if not value.strip() or not value.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"invalid backend name {value!r} (auto, cuda, accelerator, tracker)")
    return value.strip()


def _rounding(value: str) -> str:
    if value not in ROUNDINGS:
        raise argparse.ArgumentTypeError(f"invalid rounding {value!r} (choose from {', '.join(ROUNDINGS)})")
    return value


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory budgets (pytest-gpumem)")
    group.addoption(
        "--gpumem-backend",
        type=_backend_name,
        default=None,
        metavar="NAME",
        help="how to measure: auto (cuda, else another accelerator, else tracker), cuda, accelerator, "
        "tracker, or a name a plugin provides. Default: auto (ini gpumem_backend).",
    )
    group.addoption(
        "--gpumem-round",
        type=_rounding,
        default=None,
        metavar="none|cuda",
        help="tracker only: 'cuda' rounds sizes as the CUDA caching allocator does, to predict GPU "
        "figures. Default: none (ini gpumem_round).",
    )
    group.addoption(
        "--gpumem-report",
        action="store_true",
        default=None,
        help="print a table of every measured test at the end. Default: off (ini gpumem_report).",
    )
    group.addoption(
        "--gpumem-json",
        default=None,
        metavar="PATH",
        help="write every measured test's figures to PATH as JSON. Default: none (ini gpumem_json).",
    )
    parser.addini("gpumem_backend", "default for --gpumem-backend", default="auto")
    parser.addini("gpumem_round", "default for --gpumem-round", default="none")
    parser.addini("gpumem_report", "default for --gpumem-report", type="bool", default=False)
    parser.addini("gpumem_json", "default for --gpumem-json", default="")


def _ini_checked(config: pytest.Config, name: str, check: object) -> str:
    value = str(config.getini(name)).strip()
    try:
        return check(value)  # type: ignore[operator, no-any-return]
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {name}: {exc}") from None


def _options(config: pytest.Config) -> Options:
    backend = config.getoption("gpumem_backend")
    rounding = config.getoption("gpumem_round")
    report = config.getoption("gpumem_report")
    json_path = config.getoption("gpumem_json") or (config.getini("gpumem_json") or "").strip() or None
    if json_path is not None:
        path = Path(config.invocation_params.dir, json_path)
        if not path.parent.is_dir():
            raise pytest.UsageError(f"--gpumem-json={json_path}: folder {path.parent} does not exist")
    return Options(
        backend=backend or _ini_checked(config, "gpumem_backend", _backend_name),
        backend_given=backend is not None or config.getini("gpumem_backend") != "auto",
        rounding=rounding or _ini_checked(config, "gpumem_round", _rounding),
        report=bool(report if report is not None else config.getini("gpumem_report")),
        json_path=None if json_path is None else Path(config.invocation_params.dir, json_path),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_SIGNATURE)
    session = GpuMemSession(config, _options(config))
    config.stash[SESSION_KEY] = session
    if session.options.backend_given:
        try:
            session.backend()
        except GpuMemError as exc:
            raise pytest.UsageError(str(exc)) from None
    if config.pluginmanager.hasplugin("xdist"):
        from pytest_gpumem.xdist import XdistResults

        config.pluginmanager.register(XdistResults(session), "gpumem-xdist")


@pytest.hookimpl(trylast=True)
def pytest_gpumem_make_backend(config: pytest.Config, name: str) -> Backend | None:
    return make_builtin(name, config.stash[SESSION_KEY].options.rounding)


def pytest_report_header(config: pytest.Config) -> str | None:
    session = config.stash[SESSION_KEY]
    options = session.options
    if options.backend_given or options.report or options.json_path:
        return _header(session)
    return None


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str | None:
    session = config.stash[SESSION_KEY]
    if session.header_shown or not any(_measures(item) for item in items):
        return None
    return _header(session)


def _header(session: GpuMemSession) -> str:
    try:
        return session.header()
    except GpuMemError as exc:
        raise pytest.UsageError(str(exc)) from None


def _measures(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None or "gpumem" in getattr(item, "fixturenames", ())


@pytest.fixture
def gpumem(request: pytest.FixtureRequest) -> GpuMem:
    """Measure peak memory of the test call and of named phases: `with gpumem.phase("forward"): ...`."""
    session = request.config.stash[SESSION_KEY]
    try:
        return session.meter(request.node)
    except GpuMemError as exc:
        pytest.fail(f"{request.node.nodeid}: {exc}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from item.config.stash[SESSION_KEY].measure_call(item))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    session = config.stash[SESSION_KEY]
    if session.json_error:
        terminalreporter.write_line(f"gpumem: {session.json_error}", red=True)
    if not session.options.report or hasattr(config, "workerinput"):
        return
    terminalreporter.write_sep("=", "gpumem report")
    if not session.results:
        terminalreporter.write_line("no test was measured (use the gpumem fixture or @pytest.mark.max_memory)")
        return
    for line in table(session.results).splitlines():
        terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    state = config.stash[SESSION_KEY]
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[WORKER_RESULTS] = [result.to_dict() for result in state.results]
        return
    if state.options.json_path is not None:
        try:
            state.write_json(state.options.json_path)
        except OSError as exc:
            state.json_error = f"--gpumem-json: cannot write {state.options.json_path}: {exc.strerror or exc}"


__all__ = ["METER_KEY", "SESSION_KEY", "gpumem"]
