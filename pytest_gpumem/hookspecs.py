"""pytest-gpumem's own hooks; implement them in a conftest.py or a plugin.

Example conftest.py::

    def pytest_gpumem_make_backend(config, name):
        if name == "mydevice":
            return MyDeviceBackend()      # any object with the methods of pytest_gpumem.Backend

    def pytest_gpumem_result(item, result):
        dashboard.send(result.nodeid, result.peak_bytes, {n: p.peak_bytes for n, p in result.phases.items()})
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import pytest

    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.results import TestResult

hookspec = pluggy.HookspecMarker("pytest")


@hookspec(firstresult=True)
def pytest_gpumem_make_backend(config: pytest.Config, name: str) -> Backend | None:
    """Return the backend for `--gpumem-backend=name`, or None to leave the choice to others.

    The first non-None answer wins; pytest-gpumem's own implementation runs last and builds the
    built-in backends (auto, cuda, accelerator, tracker). Raise `pytest_gpumem.GpuMemError` with one
    line to say that the named backend cannot run on this machine.
    """


@hookspec
def pytest_gpumem_result(item: pytest.Item, result: TestResult) -> None:
    """Called with the result of every measured test, right after its call (in the process that ran it)."""
