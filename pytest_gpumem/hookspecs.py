"""pytest-gpumem's own hooks; implement them in a conftest.py or a plugin.

Example conftest.py::

    def pytest_gpumem_make_backend(config, name):
        if name == "mydevice":
            return MyDeviceBackend()      # a pytest_gpumem.Backend subclass

    def pytest_gpumem_result(item, result):
        dashboard.send(result.nodeid, result.peak_bytes, {n: p.peak_bytes for n, p in result.phases.items()})

    def pytest_gpumem_session_results(config, results):
        dashboard.send_run({result.nodeid: result.peak_bytes for result in results})
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Sequence

    import pytest

    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.results import TestResult

_hookspec = pluggy.HookspecMarker("pytest")


@_hookspec(firstresult=True)
def pytest_gpumem_make_backend(config: pytest.Config, name: str) -> Backend | None:
    """Return the backend for `--gpumem-backend=name`, or None to leave the choice to others.

    A backend subclasses `pytest_gpumem.Backend`: it implements the abstract members (its counters) and
    overrides what else it can do, each with a default that does nothing or says it cannot (the list is
    in docs/reference/hooks.md).

    The first non-None answer wins; pytest-gpumem's own implementation runs last and builds the
    built-in backends (auto, cuda, accelerator, tracker). Raise `pytest_gpumem.GpuMemError` with one
    line to say that the named backend cannot run on this machine.

    Args:
        config: the run's pytest config (its options, its plugins).
        name: the backend `--gpumem-backend` (or the `gpumem_backend` ini key) names, `auto` by default.
    """


@_hookspec
def pytest_gpumem_result(item: pytest.Item, result: TestResult) -> None:
    """Called with the final result of every measured test, once pytest has judged its call.

    It fires while pytest makes the call's report (in the process that ran the test, outside the test's
    output capture), after the measurement's verdict has been settled with pytest's: `result.status` is
    the word that `--gpumem-json` and the report show for the test (a failing unittest test, a strict
    XPASS and a plain failure are `error`, an xfail that fails `xfailed`, an XPASS `XPASS`). A teardown
    error does not change it. What the hook sets in `result` reaches the report, the JSON and the xdist
    controller; a hook that raises, sets a word that is no status, or leaves a value JSON cannot hold
    in `result` fails that one test in one line and its result stays as it was before the hook.

    Args:
        item: the measured test.
        result: its result, as the report and `--gpumem-json` will show it; the hook may change it.
    """


@_hookspec
def pytest_gpumem_session_results(config: pytest.Config, results: Sequence[TestResult]) -> None:
    """Called once per run with the final result of every measured test, in the order they finished.

    It fires in the process that writes the report: the xdist controller, whose `results` hold every
    worker's tests (never on a worker), or the run's one process. It comes at the end of the session (an
    interrupted one too, with the tests that finished): after every result has been settled with pytest
    (each is what `pytest_gpumem_result` saw and what the report shows) and `--gpumem-json`,
    `--gpumem-markdown` and the baselines have been written, and before pytest's terminal summary (so a
    `pytest_terminal_summary` can show what this hook kept). `results` is empty when no test was
    measured. They are the report's results: treat them as read-only.

    Args:
        config: the run's pytest config.
        results: every measured test's final result, in the order they finished.
    """
