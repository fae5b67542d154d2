"""Reading the autograd graph and nested outputs without changing them: the nodes reachable from some
roots, what each node saved for backward (never unpacked), and the storages of the tensors found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pytest_gpumem.private_torch import SAVED_VARIABLE_PREFIX, node_sequence_nr, pytree_leaves, storage_key

if TYPE_CHECKING:
    import torch

ACCUMULATE_GRAD_SEQUENCE = 2**64 - 1
"""The sequence number autograd reports for AccumulateGrad nodes, which carry none of their own."""


def storage_keys(tensor: object) -> Iterator[int]:
    """The key of the storage holding `tensor` (`storage_key`, what the ledger follows it by), if it has one."""
    try:
        yield storage_key(tensor.untyped_storage())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, NotImplementedError, ValueError):  # sparse, a Lazy module's parameter
        return


def autograd_nodes(roots: list[Any], outside: Callable[[Any], bool]) -> Iterator[Any]:
    """The autograd nodes reachable from `roots`, not entering those `outside` says to leave out."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or outside(node):
            continue
        seen.add(id(node))
        yield node
        stack.extend(child for child, _ in node.next_functions)


def node_key(node: Any) -> tuple[int, Any]:
    """What tells autograd nodes apart (the Python objects for one node come and go, and their ids with
    them): the sequence number, or for an AccumulateGrad node (which has none) its leaf."""
    sequence = node_sequence_nr(node)
    return (sequence, id(getattr(node, "variable", None))) if sequence == ACCUMULATE_GRAD_SEQUENCE else (sequence, 0)


def tensors_in(output: object) -> list[torch.Tensor]:
    """The tensors in `output` (an op's result or arguments, a module's output): itself, or inside what
    torch's pytree (`pytree_leaves`) walks (tuples, lists, dicts, namedtuples and registered types such as a
    registered dataclass or a transformers `ModelOutput`) and inside unregistered tuple, list and dict
    subclasses; other objects hold none."""
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    found: list[torch.Tensor] = []
    if type(output) in _PLAIN and _plain(output, found, torch.Tensor):  # type: ignore[arg-type]
        return found
    return list(_leaves(output, torch.Tensor))


_PLAIN = (tuple, list)
_ATOMS = frozenset((int, float, bool, complex, str, type(None)))


def _plain(items: tuple[object, ...] | list[object], found: list[torch.Tensor], tensor: type[torch.Tensor]) -> bool:
    """Collect into `found` the tensors of plain tuples and lists of tensors, numbers and None (most ops'
    results and arguments, walked here at less than half the cost of a pytree walk); False at anything else."""
    for item in items:
        if isinstance(item, tensor):
            found.append(item)
        elif type(item) in _PLAIN:
            if not _plain(item, found, tensor):  # type: ignore[arg-type]
                return False
        elif type(item) not in _ATOMS:
            return False
    return True


def _leaves(output: object, tensor: type[torch.Tensor]) -> Iterator[torch.Tensor]:
    for leaf in pytree_leaves(output):
        if isinstance(leaf, tensor):
            yield leaf
        elif isinstance(leaf, (list, tuple)):  # a subclass pytree does not know
            for item in leaf:
                yield from _leaves(item, tensor)
        elif isinstance(leaf, dict):
            for item in leaf.values():
                yield from _leaves(item, tensor)


_SAVED_ATTRIBUTES: dict[type, tuple[str, ...]] = {}


def saved_tensors(node: Any) -> Iterator[object]:
    """The tensors a node holds for backward, read from its raw saved variables: a variable packed by a
    hook (checkpointing, offloading) is never unpacked, and its packed form counts only if a tensor."""
    names = _SAVED_ATTRIBUTES.get(type(node))
    if names is None:
        names = _SAVED_ATTRIBUTES[type(node)] = tuple(a for a in dir(node) if a.startswith(SAVED_VARIABLE_PREFIX))
    for name in names:
        try:
            raw = getattr(node, name)
        except RuntimeError:  # released by an earlier backward pass
            continue
        for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
            data = getattr(saved, "data", None)
            if data is not None:
                yield data
