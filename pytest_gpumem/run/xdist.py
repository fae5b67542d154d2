"""pytest-xdist: each measured test's result reaches the controller with its report, so a worker that
dies takes at most the test it was running; the controller alone reports and writes files.

The result rides on the report as an attribute (JSON text): pytest serializes a report's attributes for
xdist (`pytest_report_to_serializable`), and junitxml, which prints `user_properties`, never sees it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

    from pytest_gpumem.results import TestResult


def worker_id(config: pytest.Config) -> str | None:
    """This process's xdist worker id ("gw0"), or None on the controller or without xdist."""
    found = getattr(config, "workerinput", {}).get("workerid")
    return None if found is None else str(found)


def distributes(config: pytest.Config) -> bool:
    """Whether this process is the controller of an xdist run (`-n N`, `--dist` with `--tx`): the only one
    whose reports carry the workers' results (pytest-xdist's own test for a distributed run)."""
    if not config.pluginmanager.hasplugin("xdist") or worker_id(config) is not None:
        return False
    return config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))


class XdistResults:
    """Registered only on an xdist controller (`distributes`); collects the results that workers' reports carry."""

    def __init__(self, add: Callable[[TestResult], None]) -> None:
        self.add = add

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" or getattr(report, "node", None) is None:  # local: serial run, or a worker
            return
        from pytest_gpumem.results import REPORT_ATTRIBUTE, TestResult

        carried = getattr(report, REPORT_ATTRIBUTE, None)
        if isinstance(carried, str):
            self.add(TestResult.from_json(json.loads(carried)))
