"""pytest-xdist: workers hand their results to the controller, which alone reports and writes files."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_gpumem.results import TestResult

if TYPE_CHECKING:
    from pytest_gpumem.session import GpuMemSession

WORKER_RESULTS = "gpumem_results"


class XdistResults:
    """Registered on the controller (and harmlessly on workers) only when pytest-xdist is installed."""

    def __init__(self, session: GpuMemSession) -> None:
        self.session = session

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        output = getattr(node, "workeroutput", None) or {}
        for data in output.get(WORKER_RESULTS, ()):
            self.session.add(TestResult.from_dict(data))
