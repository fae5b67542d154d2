"""pytest hooks of pytest-gpumem; each delegates to the run's `GpuMemSession`."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

from cuda_allocator_model import ModelError
from pytest_gpumem import hookspecs
from pytest_gpumem.config import add_options, read_options
from pytest_gpumem.marker import MARKER, MARKER_SIGNATURE
from pytest_gpumem.run.late_markers import calling, refuse_late_markers, setting_up
from pytest_gpumem.run.regression import BaselineRun
from pytest_gpumem.run.session import BASELINES, MEASUREMENT_KEY, REGISTERED, XDIST, GpuMemSession
from pytest_gpumem.run.xdist import distributes, worker_id

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.measure.meter import GpuMem

SESSION_KEY = pytest.StashKey[GpuMemSession]()

# The reference strategies' fixtures, --gpumem-scale option and report section: loaded only for
# `pytest --pyargs reference_losses` (here, before the command line is parsed) or on request.
_REFERENCE_PACKAGE = "reference_losses"
_REFERENCE_PLUGIN = "reference_losses.fixtures"


def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # not tryfirst: the `pythonpath` ini option's paths (tryfirst) must be in sys.path, so that a
    # project's own reference_losses is found (and left alone) instead of ours
    if _runs_reference_suite(early_config):
        early_config.pluginmanager.import_plugin(_REFERENCE_PLUGIN)


def _runs_reference_suite(config: pytest.Config) -> bool:
    """`--pyargs` naming our reference_losses (not a project's own package of that name)."""
    known = config.known_args_namespace
    if not known.pyargs or config.pluginmanager.has_plugin(_REFERENCE_PLUGIN):
        return False
    named = {str(arg).split("::")[0].split(".")[0] for arg in known.file_or_dir or ()}
    return _REFERENCE_PACKAGE in named and _is_ours(_REFERENCE_PACKAGE)


def _is_ours(package: str) -> bool:
    """Whether `package` resolves (without importing it) to the one installed beside pytest_gpumem."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec(package)
    if spec is None or spec.origin is None:
        return False
    return Path(spec.origin).resolve().parent.parent == Path(__file__).resolve().parent.parent


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_SIGNATURE)
    options, baseline_options = read_options(config)
    store = None
    if baseline_options.wanted and not options.disabled:
        from pytest_gpumem.baselines.file import load

        try:
            store = load(baseline_options.path)
        except ModelError as exc:
            raise pytest.UsageError(str(exc)) from None
    session = GpuMemSession(config, options, BaselineRun(baseline_options, store))
    config.stash[SESSION_KEY] = session
    session.assign_device()
    if session.baselines.active:
        config.pluginmanager.register(session.baselines, BASELINES)
    if options.backend_given:
        _header(session)
    if distributes(config):
        from pytest_gpumem.run.xdist import XdistResults

        config.pluginmanager.register(XdistResults(session.add), XDIST)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The plugins this run registered leave with it (as pytest's own junitxml does): an in-process run
    that follows, under pytester, starts without them."""
    for name in REGISTERED:
        plugin = config.pluginmanager.get_plugin(name)
        if plugin is not None:
            config.pluginmanager.unregister(plugin, name)


@pytest.hookimpl(trylast=True)
def pytest_gpumem_make_backend(config: pytest.Config, name: str) -> Backend | None:
    from pytest_gpumem.backends import make_builtin

    options = config.stash[SESSION_KEY].options
    # unmeasured, only its device is read: no allocator is modelled, so none of its settings is read
    rounding = "none" if options.disabled else options.rounding
    return make_builtin(name, rounding, options.device, options.paths)


def pytest_report_header(config: pytest.Config) -> str | list[str] | None:
    session = config.stash[SESSION_KEY]
    options = session.options
    if options.disabled:
        return "gpumem: off (--gpumem-disable): tests run unmeasured; no budget, leak or baseline is judged"
    said = any(writer.names_backend for writer in options.writers)  # the JSON report records the backend
    if options.backend_given or options.report or said or session.baselines.active:
        return _header(session)
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    session = config.stash[SESSION_KEY]
    if session.options.disabled:
        return
    if session.options.measure_all or any(_measures(item) for item in items):
        _measure_calls(session)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """A fixture may mark its test with max_memory: measure calls from then on, when nothing else did; from
    then on, a max_memory marker added inside the test function fails it (one hook a test: the idle path)."""
    setting_up(item)
    yield
    session = item.config.stash[SESSION_KEY]
    if session.options.disabled:
        return
    refuse_late_markers(item)
    if _measures(item) and not session.measuring:
        _measure_calls(session)


def pytest_report_collectionfinish(config: pytest.Config) -> list[str] | None:
    session = config.stash[SESSION_KEY]
    if session.header_shown or not session.measuring:
        return None
    return _header(session)


def _header(session: GpuMemSession) -> list[str]:
    try:
        return session.header()
    except ModelError as exc:
        raise pytest.UsageError(str(exc)) from None


def _measure_calls(session: GpuMemSession) -> None:
    from pytest_gpumem.run.judge import measure_calls

    measure_calls(session)


def _measures(item: pytest.Item) -> bool:
    return _marked(item) or "gpumem" in getattr(item, "fixturenames", ())


_MARKER_READERS = ("get_closest_marker", "iter_markers", "iter_markers_with_node", "iter_parents")
_PYTEST_READS_MARKERS = {pytest.Item: True}  # per item class: whether pytest's own methods read its markers


def _marked(item: pytest.Item) -> bool:
    """`item.get_closest_marker(MARKER) is not None`, read without its generators (an idle run asks it twice a
    test): the item's or a parent's own markers, unless the item's class reads its markers its own way."""
    kind = type(item)
    ours = _PYTEST_READS_MARKERS.get(kind)
    if ours is None:
        ours = _PYTEST_READS_MARKERS[kind] = all(
            getattr(kind, name, None) is getattr(pytest.Item, name, None) for name in _MARKER_READERS
        )
    if not ours:
        return item.get_closest_marker(MARKER) is not None
    node: pytest.Item | pytest.Collector | None = item
    while node is not None:
        if node.own_markers:  # mostly empty: no iterator made (1.2 instead of 1.6 us a test)
            for mark in node.own_markers:
                if getattr(mark, "name", None) == MARKER:
                    return True
        node = node.parent
    return False


@pytest.fixture
def gpumem(request: pytest.FixtureRequest) -> GpuMem:
    """Measure peak memory of the test call and of named phases: `with gpumem.phase("forward"): ...`."""
    session = request.config.stash[SESSION_KEY]
    if session.options.disabled:
        from pytest_gpumem.run.unmeasured import unmeasured

        return unmeasured(request.node.nodeid, session.backend)
    if calling(request.node):
        pytest.fail(
            f"{request.node.nodeid}: request the gpumem fixture as a test argument or from a fixture; "
            "asked for inside the test function, its call can no longer be measured",
            pytrace=False,
        )
    _measure_calls(session)  # also when a fixture asks for it with request.getfixturevalue
    try:
        measured = session.measurement(request.node, fresh=True)
    except ModelError as exc:
        pytest.fail(f"{request.node.nodeid}: {exc}", pytrace=False)
    from pytest_gpumem.advise.run import advise
    from pytest_gpumem.distributed.world import Worlds
    from pytest_gpumem.measure.meter import GpuMem

    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    verbose = request.config.get_verbosity() >= 1  # -v: a line per test, none broken into
    say = reporter.write_line if reporter is not None and verbose else None
    measured.run_worlds_with(Worlds(session.options.dist_timeout, say))
    return GpuMem(measured, advise)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[SESSION_KEY].finish(session, exitstatus)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    session = config.stash[SESSION_KEY]
    for line in session.problems:
        terminalreporter.write_line(f"gpumem: {line}", red=True)
    if session.baseline_lines:
        terminalreporter.write_sep("-", "gpumem baselines")
        for line in session.baseline_lines:
            terminalreporter.write_line(line, yellow=line.startswith("warning"))
    if session.options.report and worker_id(config) is None:
        terminalreporter.write_sep("=", "gpumem report")
        for line in session.report_lines(_report_width(terminalreporter), config.get_verbosity() > 0):
            terminalreporter.write_line(line)
    if session.results and worker_id(config) is None:
        from pytest_gpumem.report.terminal import counts_line

        terminalreporter.write_line(f"gpumem: {counts_line(session.results)}")


def _report_width(terminalreporter: pytest.TerminalReporter) -> int:
    """pytest's terminal width, or 120 columns when it writes to no terminal (a CI log)."""
    from pytest_gpumem.report.terminal import DEFAULT_WIDTH

    if terminalreporter.isatty or os.environ.get("COLUMNS", "").strip().isdigit():
        return max(int(terminalreporter.config.get_terminal_writer().fullwidth), 40)
    return DEFAULT_WIDTH


__all__ = ["MEASUREMENT_KEY", "SESSION_KEY", "gpumem"]
