"""Repeated blocks: a list of modules of one class (`h.0`, `h.1`, ...) is one group (`h.*`) wherever
memory is summed by module, so a transformer's twelve layers read as one part with a block count."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def repeated_blocks(kinds: Mapping[str, str]) -> dict[str, int]:
    """Lists of one kind of module: each parent whose numbered children (`h.0`, `h.1`, ...) are two or
    more of one class, as its group (`h.*`) with how many there are."""
    classes: dict[str, set[str]] = {}
    numbers: dict[str, set[str]] = {}
    for name, kind in kinds.items():
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            classes.setdefault(parent, set()).add(kind)
            numbers.setdefault(parent, set()).add(last)
    return {
        _group_of(parent): len(numbers[parent])
        for parent, found in classes.items()
        if len(found) == 1 and len(numbers[parent]) > 1
    }


def fold(module: str, folds: Collection[str]) -> str:
    """The group of `module`: the path up to its first number in a folded list, the number made `*`
    (`transformer.h.3.mlp` -> `transformer.h.*`); other modules are their own group."""
    if not folds:
        return module
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.isdigit() and _group_of(".".join(parts[:index])) in folds:
            return _group_of(".".join(parts[:index]))
    return module


def _group_of(parent: str) -> str:
    """The name of the group of `parent`'s numbered children."""
    return f"{parent}.*" if parent else "*"


def numbered_lists(modules: Collection[str]) -> dict[str, int]:
    """Where no module classes are known, by name alone: each parent whose numbered children (`h.0`, `h.1`,
    ...) are two or more and hold the same submodules among `modules`, as its group with how many."""
    below: dict[str, dict[str, set[str]]] = {}  # parent -> number -> the paths below that child
    for module in modules:
        parts = module.split(".")
        for index, part in enumerate(parts):
            if part.isdigit():
                parent = ".".join(parts[:index])
                below.setdefault(parent, {}).setdefault(part, set()).add(".".join(parts[index + 1 :]))
                break
    return {
        _group_of(parent): len(children)
        for parent, children in below.items()
        if len(children) > 1 and len({frozenset(paths) for paths in children.values()}) == 1
    }
