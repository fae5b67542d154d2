"""Backward as torch runs it without a dispatch mode, under the tracker's mode.

While any Python dispatch mode is on, ATen's `isTensorSubclassLike` is true for every tensor (for a meta
tensor it always is), and backward then allocates more than it does without one:

- autograd's `InputBuffer` adds a gradient's second contribution out of place (`old + new`), where torch
  otherwise adds it into `old` when it holds the last reference to it (`can_accumulate_inplace`);
- some backward formulas fill a fresh tensor out of place (`new_zeros(...).scatter(...)` instead of
  `scatter_`): the nodes and ops of `_TWINS`, found by comparing torch.profiler's record of each op's
  backward with and without a mode.

The tracker's mode hands each candidate op (`CANDIDATES`) met in backward to `in_place_twin`, which runs
the in-place twin and returns its `self`, as torch without a mode does, when it can prove that torch would
have: grad mode off (create_graph keeps the out-of-place branches), a plain dense tensor, and nothing else
holding it or its storage (use counts read against a probe's, `calibrate`). Anything else runs as before.

Where backward is comes from hooks on the graph's nodes (`hooked`, around each engine run): a node's
formula runs between its pre- and post-hook; the engine adds what it returned into its consumers' buffers
after its post-hook, while it is still the node the engine runs (`current_autograd_node`), so an `add`
there of a tensor it returned is the buffer's accumulation. Only the nodes that need them are hooked: a
post-hook on those whose outputs meet another gradient in a buffer, a pre- and a post-hook on the nodes of
`_TWINS` (a hook, removed, leaves an empty dictionary on its node, which a retained graph keeps).

Not emulated: formulas whose subclass branch is another algorithm (`prod`, `cumprod`, the full `max`,
`min` and `median`), sparse gradients of leaves (cloned under a mode: their parts have Python references),
the branches of forward composites and of double backward.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pytest_gpumem import private_torch
from pytest_gpumem.private_torch import tensor_key

_VALUE_SELECTING = ("scatter.src",)  # value_selecting_reduction_backward: zeros, then scatter_
_TWIN_OPS: dict[str, tuple[str, ...]] = {
    "MaxBackward0": _VALUE_SELECTING,
    "MinBackward0": _VALUE_SELECTING,
    "MedianBackward1": _VALUE_SELECTING,
    "NanmedianBackward1": _VALUE_SELECTING,
    "KthvalueBackward0": _VALUE_SELECTING,
    "ModeBackward0": _VALUE_SELECTING,
    "TopkBackward0": _VALUE_SELECTING,
    "SortBackward0": _VALUE_SELECTING,
    "SortBackward1": _VALUE_SELECTING,
    "CummaxBackward0": ("scatter_add.default",),  # cummaxmin_backward
    "CumminBackward0": ("scatter_add.default",),
    "GatherBackward0": ("scatter_add.default",),  # gather_backward
    "IndexBackward0": ("index_put.default",),  # index_backward
    "IndexSelectBackward0": ("index_add.default",),  # index_select_backward
    "MaskedSelectBackward0": ("masked_scatter.default",),  # masked_select_backward
    "TraceBackward0": ("index_fill.int_Tensor",),  # trace_backward
    "TakeBackward0": ("put.default",),  # take_backward
    "Atan2Backward0": ("masked_fill.Scalar",),  # atan2_backward: the reciprocal's masked_fill_
    # binary_cross_entropy_with_logits_backward: sigmoid (or pos_weight's terms), then sub_ and mul_
    "BinaryCrossEntropyWithLogitsBackward0": ("sub.Tensor", "mul.Tensor"),
}
"""Per node, the ops its formula runs out of place under a mode, each on a tensor the formula has just
made and drops afterwards (read in FunctionsManual.cpp and ATen's composites; checked against the
profiler): without a mode each runs in place."""
_PASSED_BY_VALUE = {"IndexBackward0": 1}
"""References to the fresh tensor that a node's formula holds beyond a buffer's one: `index_backward`
takes it by value through the dispatcher."""


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _in_place(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet + "_"), overload)


_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor
_TWINS: dict[str, dict[Any, Any]] = {
    node: {_overload(op): _in_place(op) for op in ops} for node, ops in _TWIN_OPS.items()
}
"""Per node name, its out-of-place ops and their in-place twins."""
CANDIDATES = frozenset({_ADD, *(op for twins in _TWINS.values() for op in twins)})
"""The ops the tracker's mode hands to `in_place_twin` in backward."""

_NOTHING: frozenset[int] = frozenset()


class _Run:
    """Where one engine run is on its thread: the node of `_TWINS` whose formula runs (None outside
    them), the last post-hooked node that returned (held: its Python object stays the engine's), and the
    tensors (by TensorImpl) it returned. Hooks fired by another run through the same nodes (a backward
    inside a hook), or on another thread, are ignored."""

    __slots__ = ("node", "produced", "producer", "task", "thread")

    def __init__(self) -> None:
        self.node: str | None = None
        self.producer: object = None
        self.produced: frozenset[int] = _NOTHING
        self.thread = threading.get_ident()
        self.task: int | None = None  # the engine's graph task, known at the first hook (its root's)

    def starts(self, name: str, grad_outputs: object) -> None:
        if self._ours():
            self.node = name

    def returned(self, node: object, grad_inputs: Sequence[torch.Tensor | None], grad_outputs: object) -> None:
        if self._ours():
            self.node, self.producer = None, node
            self.produced = frozenset([tensor_key(t) for t in grad_inputs if t is not None])

    def _ours(self) -> bool:
        task = _graph_task()
        if self.task is None:
            self.task = task
        return task == self.task and _thread() == self.thread


_graph_task = private_torch.graph_task_reader()
"""The autograd engine's current graph task on this thread (-1 outside backward)."""
_thread = threading.get_ident
_current_node = private_torch.current_autograd_node


class _Local(threading.local):
    runs: list[_Run] | None = None  # this thread's runs, innermost last


_LOCAL = _Local()


def _runs() -> list[_Run]:
    runs = _LOCAL.runs
    if runs is None:
        runs = _LOCAL.runs = []
    return runs


def hooked(roots: Sequence[Any]) -> contextlib.AbstractContextManager[None]:
    """Within the block (one run of the autograd engine from `roots`, tensors or gradient edges), the
    nodes reachable from them tell this thread's `in_place_twin` where backward is."""
    try:
        graph = graph_of(roots)
    except (RuntimeError, TypeError, AttributeError):
        return _UNCHANGED
    _, _, joined, twins = graph
    if not joined and not twins:  # nothing in this graph runs differently without a mode
        # a run this one is nested in (a backward inside its hooks) must not judge this one's ops
        nested = _LOCAL.runs and not _engine_replaced()
        return _Hooked(_UNHOOKED, []) if nested else _UNCHANGED
    if _engine_replaced():
        return _UNCHANGED
    run = _Run()
    handles = _hook_graph(graph, run)
    return _UNCHANGED if handles is None else _Hooked(run, handles)


class _Hooked:
    """The run on this thread's stack within the block; its hooks removed after it."""

    __slots__ = ("handles", "run")

    def __init__(self, run: _Run, handles: list[Any]) -> None:
        self.run, self.handles = run, handles

    def __enter__(self) -> None:
        _runs().append(self.run)

    def __exit__(self, *exc: object) -> None:
        runs = _runs()
        for i in range(len(runs) - 1, -1, -1):  # the innermost: `_UNHOOKED` may stand more than once
            if runs[i] is self.run:
                del runs[i]
                break
        for handle in self.handles:
            handle.remove()


_UNHOOKED = _Run()
"""The run of a graph where nothing runs differently without a mode: no hook moves it from its start
(no node, nothing produced), so one serves every such run on every thread."""
_UNCHANGED = contextlib.nullcontext()
"""A run that needs no hooks and hides no other run (or whose graph refused a hook)."""


def _hook_graph(graph: _Graph, run: _Run) -> list[Any] | None:
    """The handles of the hooks put on the graph, or None where a node refuses one (none is left)."""
    handles: list[Any] = []
    try:
        _add_hooks(graph, run, handles)
    except (RuntimeError, TypeError, AttributeError):
        for handle in handles:
            handle.remove()
        return None
    return handles


def _add_hooks(graph: _Graph, run: _Run, handles: list[Any]) -> None:
    returning, starting = hook_plan(graph)
    for node in returning:
        handles.append(node.register_hook(functools.partial(run.returned, node)))
    for node, name in starting:
        handles.append(node.register_prehook(functools.partial(run.starts, name)))


def hook_plan(graph: _Graph) -> tuple[list[Any], list[tuple[Any, str]]]:
    """The nodes `_hook_graph` puts a post-hook on (those whose outputs meet another gradient in a buffer
    and those of `_TWINS`), and those it puts a pre-hook on (those of `_TWINS`), with their names."""
    nodes, feeds, joined, _ = graph
    returning: list[Any] = []
    starting: list[tuple[Any, str]] = []
    for node, edges in nodes.items():
        if _kind(node) == _TWIN:
            returning.append(node)
            starting.append((node, node.name()))
        elif joined and any(edge[0] is not None and feeds[edge] > 1 for edge in edges):
            returning.append(node)
    return returning, starting


_Graph = tuple[dict[Any, Any], dict[tuple[Any, int], int], bool, bool]
_TWIN, _OTHER = 1, 2
_KINDS: dict[type, int] = {}
"""Each node class: whether it is one of `_TWINS` (its name is its class's)."""


def _kind(node: Any) -> int:
    kind = _KINDS.get(type(node))
    if kind is None:
        kind = _KINDS[type(node)] = _TWIN if node.name() in _TWINS else _OTHER
    return kind


def graph_of(roots: Sequence[Any]) -> _Graph:
    """The graph's nodes reachable from `roots`, each once (held, keyed by identity: a node's Python object
    lives while it is held), with the edges (consumer, input) they send gradients along
    (`next_functions`); how many edges end in each buffer slot (consumer, input); whether any slot takes
    more than one; and whether any node is one of `_TWINS`. The slots are counted only where some node is
    reached twice (a tree's nodes are reached once each)."""
    nodes: dict[Any, Any] = {}
    twice = twins = False
    kinds = _KINDS
    pending = []
    for root in roots if isinstance(roots, (list, tuple)) else (roots,):
        node = root.grad_fn if isinstance(root, _TENSOR) else getattr(root, "node", None)  # or a GradientEdge
        if node is not None:
            pending.append(node)
    while pending:
        node = pending.pop()
        if node in nodes:
            twice = True
            continue
        nodes[node] = edges = node.next_functions
        if (kinds.get(type(node)) or _kind(node)) == _TWIN:
            twins = True
        for consumer, _ in edges:
            if consumer is not None:
                pending.append(consumer)
    feeds: dict[tuple[Any, int], int] = {}
    if not twice:
        return nodes, feeds, False, twins
    for edges in nodes.values():
        for edge in edges:
            if edge[0] is not None:
                feeds[edge] = feeds.get(edge, 0) + 1
    return nodes, feeds, any(count > 1 for count in feeds.values()), twins


_TENSOR = torch.Tensor


def _engine_replaced() -> bool:
    """Whether backward may run other than node by node on this engine: compiled autograd traces the
    graph, functorch's transforms wrap the tensors (subclass-like to ATen with or without a mode)."""
    return private_torch.compiled_autograd_enabled() or private_torch.functorch_transforms_active()


def in_place_twin(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """The in-place twin of `func` run on `args` and its `self` returned, where torch without a mode
    would have run it; else None (run `func` as it is)."""
    runs = _LOCAL.runs
    if not runs:
        return None
    run = runs[-1]
    if run.node is None:
        twin = _ADD_ if func is _ADD and _accumulating(run, args, kwargs) and _current_node() is run.producer else None
    else:
        twin = _TWINS.get(run.node, {}).get(func)
    if twin is None or torch.is_grad_enabled() or not _keeps_self(func, args, kwargs):
        return None
    if not _sole_holder(args, _PASSED_BY_VALUE.get(run.node, 0) if run.node else 0):
        return None
    twin(*args, **(kwargs or {}))
    return args[0]


def _accumulating(run: _Run, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether an `add` is the engine's `old + new` into a buffer, `new` the last node's output."""
    return (
        not kwargs
        and len(args) == 2
        and isinstance(args[1], torch.Tensor)
        and tensor_key(args[1]) in run.produced
        and _plain(args[1])
    )


def _keeps_self(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether the out-of-place op's result would have `self`'s shape and dtype (no broadcasting, no
    promotion), so that its twin's result is the same tensor."""
    target = args[0]
    if not isinstance(target, torch.Tensor):
        return False
    if func in _ELEMENTWISE:
        other = args[1]
        if isinstance(other, torch.Tensor) and not _plain(other):
            return False
        shape = other.shape if isinstance(other, torch.Tensor) else ()
        return torch.result_type(target, other) == target.dtype and _broadcasts_into(shape, target.shape)
    if func is _MASKED_SCATTER:
        return _broadcasts_into(args[1].shape, target.shape)
    return True


def _broadcasts_into(shape: Sequence[int], into: Sequence[int]) -> bool:
    """Whether broadcasting `shape` with `into` gives `into`."""
    if len(shape) > len(into):
        return False
    return all(size in (1, full) for size, full in zip(reversed(shape), reversed(into), strict=False))


_ELEMENTWISE = frozenset({_ADD, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor})
_MASKED_SCATTER = torch.ops.aten.masked_scatter.default


def _plain(tensor: torch.Tensor) -> bool:
    """Not subclass-like to ATen without a mode: a plain strided tensor (a meta one counts, as the GPU's
    would), not a zero tensor."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not private_torch.is_zero_tensor(tensor)
    )


def _sole_holder(args: tuple[Any, ...], passed_by_value: int) -> bool:
    """`can_accumulate_inplace` without the mode: `args[0]` a plain, dense tensor whose caller holds the
    only reference to it (and `passed_by_value` copies of it) and to its storage (the counts a probe read
    where torch adds in place). The tensor comes inside `args`, never as an argument: Dynamo's frame
    evaluator, once a `fullgraph=True` graph break left it installed, holds a reference to each argument of
    every Python call, which a count read against a probe of an earlier call would take for a holder."""
    tensor = args[0]
    if not _plain(tensor) or not _non_overlapping_and_dense(tensor):
        return False
    storage = tensor.untyped_storage()
    readings = (
        private_torch.tensor_use_count(tensor) - passed_by_value,
        sys.getrefcount(tensor),
        private_torch.storage_use_count(storage),
        sys.getrefcount(storage),
    )
    if _PROBE.reading is not None:
        _PROBE.reading.append(readings)
        return False
    return readings == _PROBE.calibrated


def _non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """`TensorImpl::compute_non_overlapping_and_dense` (no Python binding): its elements fill its
    storage's span exactly once, in some order of its dimensions."""
    sizes, strides = tensor.shape, tensor.stride()
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    order = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d]))
    expected = 1
    for d in order:
        if sizes[d] < 2:
            return True
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


class _Probe:
    """The reference counts of a tensor that only the engine's buffer holds, as `_sole_holder` reads
    them under the tracker's mode (None: not read, nothing is run in place)."""

    def __init__(self) -> None:
        self.calibrated: tuple[int, ...] | None = None
        self.reading: list[tuple[int, ...]] | None = None
        self.tries = 0


_PROBE = _Probe()
_PROBE_TRIES = 3  # a probe that read nothing (its mode replaced, say) is run again at the next start


def calibrate(make_mode: Callable[[], Any]) -> None:
    """Read, once, the counts of the one accumulation of `y * 2 + y * 3`'s backward on the CPU, which
    torch without a mode runs in place (`y`'s gradient, made by the first product's node, held only by
    the buffer), under a mode from `make_mode` (the tracker's, on a throwaway ledger)."""
    if _PROBE.calibrated is not None or _PROBE.tries >= _PROBE_TRIES:
        return
    _PROBE.tries += 1
    readings: list[tuple[int, ...]] = []
    with private_torch.no_dispatch_modes():
        x = torch.ones(2, requires_grad=True)
        y = x.exp()
        loss = (y * 2 + y * 3).sum()
        _PROBE.reading = readings
        try:
            with make_mode(), hooked([loss]):
                torch.autograd.backward(loss)
        finally:
            _PROBE.reading = None
    _PROBE.calibrated = readings[0] if len(readings) == 1 else None
