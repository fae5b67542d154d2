"""The package's imports run one way: no module reaches, even inside a function, a module that reaches it
back, and no layer imports a layer above it (backends know no pytest, measuring knows no reporting)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_gpumem"
PRIVATE_TORCH = re.compile(r"torch\._[A-Za-z]|\b_cdata\b|\b_schema\b|\b_should_skip_dynamo\b")
"""A private torch name, in code, a comment or a docstring alike."""
REFERENCE = PACKAGE.parent / "reference_losses"  # a user of the plugin, shipped beside it
MODEL = PACKAGE.parent / "cuda_allocator_model"  # the allocator's model, a package of its own
MODEL_PUBLIC = {MODEL.name, f"{MODEL.name}.snapshots"}  # where its public names (`__all__`) are

# lowest first; a module may import its own layer and the layers below it
LAYERS = (
    ("errors", "constants", "files", "private_torch", "marker"),
    ("results",),
    ("budget", "reasons"),
    ("backends",),
    ("gradients",),
    ("explain",),
    ("measure",),
    ("advise",),
    ("distributed",),
    ("baselines",),
    ("report",),
    ("history",),
    ("outcome",),
    ("config", "options", "values"),
    ("run",),
    ("hookspecs", "plugin", "cli", "__main__", "__init__"),
)
WITHOUT_PYTEST = (
    "errors",
    "private_torch",
    "marker",
    "constants",
    "files",
    "results",
    "reasons",
    "backends",
    "gradients",
    "explain",
    "baselines",
    "report",
    "history",
    "outcome",
    "options",
    "values",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path | None = None) -> set[str]:
    """Every module of the package or outside it that `name` (at `path`, a module outside the package)
    imports anywhere in its text: relative imports resolved, `importlib.import_module("...")` of a literal
    name too, and a name of the package's own `__init__` (its lazy public names) as an import of
    `pytest_gpumem` itself."""
    path = path or modules()[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(package, node.level, node.module)
            found.update(imported_from(base, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Call) and called(node.func) in {"import_module", "__import__"} and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
    return found


def absolute(package: str, level: int, module: str | None) -> str:
    """The module that `from <level dots><module> import ...` in `package` names."""
    base = package.split(".")[: len(package.split(".")) - level + 1] if level else []
    return ".".join([*base, *([module] if module else [])])


def imported_from(base: str, names: list[str]) -> set[str]:
    """`from base import names`: base and each name that is a module of base; from the package's root, a
    name that is no module is one of its `__init__`."""
    submodules = {f"{base}.{name}" for name in names if f"{base}.{name}" in modules()}
    if base == PACKAGE.name:
        return submodules | ({base} if len(submodules) < len(names) else set())
    return {base, *(f"{base}.{name}" for name in names)}


def called(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def package_imports(name: str) -> set[str]:
    return {other for other in imported(name) if other in modules() and other != name}


def layer(name: str) -> int:
    first = name.split(".")[1] if "." in name else "__init__"
    return next(index for index, members in enumerate(LAYERS) if first in members)


def test_relative_imports_are_resolved() -> None:
    assert absolute("pytest_gpumem.run", 1, "judge") == "pytest_gpumem.run.judge"
    assert absolute("pytest_gpumem.run", 2, "budget") == "pytest_gpumem.budget"
    assert absolute("pytest_gpumem.run", 1, None) == "pytest_gpumem.run"
    assert absolute("pytest_gpumem", 0, "pytest_gpumem.budget") == "pytest_gpumem.budget"


def test_a_lazy_public_name_is_an_import_of_the_top_layer() -> None:
    assert imported_from("pytest_gpumem", ["budget"]) == {"pytest_gpumem.budget"}
    assert imported_from("pytest_gpumem", ["budget", "GpuMem"]) == {"pytest_gpumem.budget", "pytest_gpumem"}
    assert layer("pytest_gpumem") == len(LAYERS) - 1


def test_every_module_has_a_layer() -> None:
    assert [
        name
        for name in modules()
        if name != "pytest_gpumem" and not any([*name.split("."), "__init__"][1] in members for members in LAYERS)
    ] == []


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
                circles.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other, [*path, other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


@pytest.mark.parametrize("top", WITHOUT_PYTEST)
def test_the_lower_layers_work_without_pytest(top: str) -> None:
    users = sorted(
        name
        for name in modules()
        if name.split(".")[1:2] == [top] and {"pytest", "_pytest"} & {other.split(".")[0] for other in imported(name)}
    )
    assert users == []


def test_the_reference_package_imports_only_the_public_names() -> None:
    private = sorted(
        f"{module_name(path)} -> {other}"
        for path in REFERENCE.rglob("*.py")
        for other in imported(module_name(path), path)
        if other.startswith(f"{PACKAGE.name}.")
    )
    assert private == []


def test_the_plugin_never_imports_the_reference_package() -> None:
    users = sorted(name for name in modules() if any(other.split(".")[0] == REFERENCE.name for other in imported(name)))
    assert users == []


def test_only_private_torch_names_private_torch() -> None:
    roots = (PACKAGE, PACKAGE.parent / "reference_losses")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for root in roots
        for path in sorted(root.rglob("*.py"))
        if path != PACKAGE / "private_torch.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PRIVATE_TORCH.search(line)
    ]
    assert found == []


def test_the_allocator_model_imports_neither_torch_nor_pytest_nor_the_plugin() -> None:
    outside = {"torch", "pytest", "_pytest", PACKAGE.name, REFERENCE.name}
    users = sorted(
        f"{module_name(path)} -> {other}"
        for path in MODEL.rglob("*.py")
        for other in imported(module_name(path), path)
        if other.split(".")[0] in outside
    )
    assert users == []


def test_the_plugin_uses_only_the_allocator_models_public_names() -> None:
    private = sorted(
        f"{module_name(path)} -> {other}"
        for path in [*PACKAGE.rglob("*.py"), *REFERENCE.rglob("*.py")]
        for other in imported(module_name(path), path)
        if other.split(".")[0] == MODEL.name
        and other not in MODEL_PUBLIC
        and other.rpartition(".")[0] not in MODEL_PUBLIC
    )
    assert private == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> list[str]:
    """`a.b.c` as ["a", "b", "c"]; [] for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def private_names(path: Path, roots: tuple[str, ...]) -> list[str]:
    """Where the module at `path` names a private attribute of a module under `roots` (or of a name it
    imported from one): imports, attributes and getattr-family literals. Operators reached through
    `torch.ops` are the dispatcher's names (`aten._softmax`), not Python's private API."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in roots:
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in roots:
            for alias in node.names:
                if any(_private(part) for part in [*node.module.split("."), alias.name]):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        target, name = None, None
        if not isinstance(node, ast.expr):
            continue
        if isinstance(node, ast.Attribute):
            target, name = node.value, node.attr
        elif isinstance(node, ast.Call) and _chain(node.func)[-1:] in (["getattr"], ["hasattr"], ["setattr"]):
            literal = node.args[1] if len(node.args) > 1 else None
            if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                target, name = node.args[0], literal.value
        chain = [] if target is None else _chain(target)
        if name and _private(name) and chain and chain[0] in bound and "ops" not in chain:
            found.append(f"{node.lineno}: {'.'.join(chain)}.{name}")
    return sorted(set(found))


def test_no_module_but_private_torch_names_a_private_torch_attribute() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{where}"
        for root in (PACKAGE, REFERENCE, MODEL)
        for path in sorted(root.rglob("*.py"))
        if path != PACKAGE / "private_torch.py"
        for where in private_names(path, ("torch",))
    ]
    assert found == []


def test_cpythons_multiprocessing_internals_stay_in_the_fork_server() -> None:
    server = PACKAGE / "distributed" / "server.py"
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{where}"
        for root in (PACKAGE, REFERENCE, MODEL)
        for path in sorted(root.rglob("*.py"))
        if path != server
        for where in private_names(path, ("multiprocessing",))
    ]
    assert found == [] and private_names(server, ("multiprocessing",)) != []


def test_the_fence_sees_what_the_text_search_did_not(tmp_path: Path) -> None:
    source = (
        "import torch\nfrom torch import nn\nfrom torch.overrides import _pop_mode\n"
        "x = nn.modules.dropout._DropoutNd\ny = getattr(torch.optim, '_hidden')\nz = torch.ops.aten._softmax\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    assert private_names(path, ("torch",)) == [
        "3: from torch.overrides import _pop_mode",
        "4: nn.modules.dropout._DropoutNd",
        "5: torch.optim._hidden",
    ]
