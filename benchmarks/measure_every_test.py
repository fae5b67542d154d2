"""A pytest plugin module for benchmarks: every collected test gets a `max_memory` limit no test reaches,
so the plugin measures each one (load it with `-p measure_every_test`)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.max_memory("1 TiB"))
