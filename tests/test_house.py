"""The package's imports run one way: no module reaches, even inside a function, a module that reaches it
back, and no layer imports a layer above it (backends know no pytest, measuring knows no reporting)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_gpumem"

# lowest first; a module may import its own layer and the layers below it
LAYERS = (
    ("errors", "constants", "sizes"),
    ("results",),
    ("budget",),
    ("backends",),
    ("gradients",),
    ("explain",),
    ("measure",),
    ("distributed",),
    ("baselines",),
    ("report",),
    ("config",),
    ("run",),
    ("hookspecs", "plugin", "cli", "__main__", "__init__"),
)
WITHOUT_PYTEST = ("errors", "constants", "sizes", "results", "backends", "gradients", "explain", "baselines", "report")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(name: str) -> set[str]:
    """Every module of the package or outside it that `name` imports anywhere in its text."""
    tree = ast.parse(modules()[name].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_imports(name: str) -> set[str]:
    return {other for other in imported(name) if other in modules() and other != name and other != "pytest_gpumem"}


def layer(name: str) -> int:
    first = name.split(".")[1] if "." in name else "__init__"
    return next(index for index, members in enumerate(LAYERS) if first in members)


def test_every_module_has_a_layer() -> None:
    assert [name for name in modules() if name != "pytest_gpumem" and not any(
        (name.split(".") + ["__init__"])[1] in members for members in LAYERS
    )] == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = sorted(
        f"{name} -> {other}"
        for name in modules()
        if name != "pytest_gpumem"
        for other in package_imports(name)
        if layer(other) > layer(name)
    )
    assert upward == []


def test_the_import_graph_has_no_circle() -> None:
    graph = {name: package_imports(name) for name in modules()}
    circles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, [*path, other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


@pytest.mark.parametrize("top", WITHOUT_PYTEST)
def test_the_lower_layers_work_without_pytest(top: str) -> None:
    users = sorted(name for name in modules() if name.split(".")[1:2] == [top] and {"pytest", "_pytest"} & {
        other.split(".")[0] for other in imported(name)
    })
    assert users == []
