"""Loads the shipped suite's fixtures and `--gpumem-scale` option (reference_losses.fixtures) for runs
that collect this package by path, e.g. `pytest reference_losses` from a checkout.

`pytest --pyargs reference_losses` does not load this file before the command line is parsed, so
pytest-gpumem loads the same plugin itself for that command. Registering from `pytest_addoption`
(called before parsing for a conftest found from the arguments, at registration for one found while
collecting) works in both cases, where `pytest_plugins` here would be refused when this conftest is
found while collecting (pytest allows `pytest_plugins` only in top-level conftests).
"""

from __future__ import annotations

import pytest

PLUGIN = "reference_losses.fixtures"


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if not pluginmanager.has_plugin(PLUGIN):
        pluginmanager.import_plugin(PLUGIN)
