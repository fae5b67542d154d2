"""The package as it is published: one version, the licence it declares."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

import pytest_gpumem

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pytest_gpumem.__version__"}
    assert importlib.metadata.version("pytest-gpumem") == pytest_gpumem.__version__


def test_the_declared_licence_ships() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License\n")
    assert "setuptools>=77" in project["build-system"]["requires"][0]
