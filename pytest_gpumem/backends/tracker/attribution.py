"""What each tracked storage is for: its category (how the test used it) and the nn.Module that made it.

Categories come from use, never from size:
- parameters (and buffers): storages of a module's parameters or of what an optimizer updates;
- gradients: what autograd accumulated into a tensor's `.grad` (post-accumulate-grad hooks on the
  leaves a backward pass reaches, the gradients an optimizer reads);
- optimizer state: the tensors in `optimizer.state` after a step;
- saved for backward: tensors held by the autograd graph (its saved variables, read without unpacking
  them, so that no saved-tensor hook runs and no checkpoint recomputes: when a module's forward returns,
  and when a backward pass reaches a node), until every node known to save one released it (a backward
  without retain_graph): from then on a storage still alive (an output the test keeps, such as a KV
  cache) is a temporary again (`Allocation.unsaved_at`);
- inputs and other: made by a factory op (no tensor arguments, or a `*_like`) in the test's own code,
  outside any module, backward pass or optimizer step (an input the graph saves stays an input); DDP's
  gradient buckets, made so when it is wrapped, are gradients;
- temporaries: everything else (intermediate results, outputs, workspaces).

Modules: forward pre/post hooks (global, for the measured call only) keep a stack of qualified names;
when a module's forward returns, the autograd nodes it made are recorded by sequence number, so that in
backward the node being run names the module whose forward created it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
import warnings
import weakref
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from cuda_allocator_model import AllocatorTrace, ServedByModel
from pytest_gpumem.backends.tracker.allocation import NO_MODULE, Allocation, RegionSpan
from pytest_gpumem.backends.tracker.graph import (
    ACCUMULATE_GRAD_SEQUENCE,
    autograd_nodes,
    node_key,
    saved_tensors,
    storage_keys,
    tensors_in,
)
from pytest_gpumem.backends.tracker.recording import Followed, Origin, Recorder, op_name, user_line
from pytest_gpumem.errors import one_line
from pytest_gpumem.private_torch import (
    current_autograd_node,
    graph_task_reader,
    in_backward,
    next_sequence_nr,
    node_sequence_nr,
    op_schema,
)

if TYPE_CHECKING:
    import torch

_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
_STEP_MODULE = "(optimizer step)"
MAX_EVENTS = 4_000_000
"""The most allocations, resizes and frees an explanation follows (16 B each, 24 B with the allocator's
model, and 8 B per allocation); a call that makes more is measured but not explained."""
_PLUGIN = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep  # pytest_gpumem's own frames
_MAX_SHARED = 65_536  # freed allocations alike in every field share one record, of this many kinds at most


_Hook = TypeVar("_Hook", bound=Callable[..., None])


def _contained(hook: _Hook) -> _Hook:
    """A hook of ours runs inside the test's code: an error in it is kept as a note, never raised there."""

    @functools.wraps(hook)
    def contained(self: Attributor, *args: Any) -> None:
        if self.compiling():  # traced by torch.compile (a module's hooks): not a call, nothing to record
            return
        try:
            hook(self, *args)
        except Exception as exc:
            if not self.problems:
                self.problems.append(f"{hook.__name__.strip('_')}: {one_line(exc)}")

    return cast(_Hook, contained)


class Attributor(Recorder):
    """A recorder that also records, for each allocation, its category and module, and each change of a
    storage's counted bytes in order (`ids`, `sizes`), so that any moment of the call can be replayed."""

    def __init__(self, live: dict[int, Any], events: bool, allocator: ServedByModel | None = None) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        super().__init__(events)
        self.live = live  # the ledger's storages by key: how a tensor seen in a hook finds its allocation
        self.allocations: list[Allocation] = []
        self.kinds: dict[str, str] = {}  # module name -> its class name (repeated blocks are folded by it)
        self.problems: list[str] = []  # errors in our hooks: the explanation may be incomplete
        self.compiling: Callable[[], bool] = _never
        self._filter: Any = None
        self.limit = MAX_EVENTS
        self.overflowed = False  # more than `limit` events: the call cannot be explained
        self._shared: dict[tuple[Any, ...], Allocation] = {}
        self.ids = array("q")  # per event: the allocation, and its counted bytes after the event (0: freed)
        self.sizes = array("q")
        # with the allocator's model (`allocator`: the ledger), its reserved and inactive-split bytes per event
        self.allocator_trace = None if allocator is None or allocator.model is None else AllocatorTrace(allocator)
        self.regions: list[RegionSpan] = []
        self.paused: list[tuple[int, int]] = []  # event spans the meter does not measure
        self.paused_by: list[str] = []  # what ran in each paused span (gpumem.advise, ...)
        self._open: list[tuple[str, int]] = []
        self._pause_start: int | None = None
        self._paused_by = ""
        self._stack: list[str] = []
        self._open_calls: list[tuple[int, str]] = []  # (sequence number at entry, module) per open call
        # objects die during a call and their ids are reused: everything known of one is held weakly
        self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # module -> name
        self._owners: Any = WeakIdKeyDictionary()  # parameter -> the module that holds it
        self._hooked: Any = WeakIdKeyDictionary()  # leaves whose gradient is watched
        self._by_sequence: dict[int, str] = {}  # autograd node -> the module whose forward made it
        self._task = -1
        self._walked: set[tuple[int, Any]] = set()  # nodes of the running backward already read
        self._handles: list[Any] = []
        self._in_step = 0
        self._factory: dict[object, bool] = {}
        # the saving nodes of each saved allocation (by id), and what each node saves (storage key, allocation)
        self._savers: dict[int, set[tuple[int, Any]]] = {}
        self._saved_by: dict[tuple[int, Any], dict[int, tuple[int, Allocation]]] = {}
        self.unsaved: list[tuple[int, int]] = []  # (event, allocation id): no graph saves it after the event
        self._thread = threading.get_ident()  # the test's: module and optimizer hooks fire in every thread

    # --- regions, from the meter

    def open_region(self, name: str) -> None:
        self._open.append((name, len(self.ids)))

    def close_region(self) -> None:
        name, start = self._open.pop()
        self.regions.append(RegionSpan(name, start, len(self.ids)))

    def pause(self, by: str = "") -> None:
        self._pause_start, self._paused_by = len(self.ids), by

    def resume(self) -> None:
        if self._pause_start is not None:
            self.paused.append((self._pause_start, len(self.ids)))
            self.paused_by.append(self._paused_by)
            self._pause_start = None

    # --- the ledger's calls

    @_contained
    def entered(self) -> None:
        task = graph_task_reader()()
        if task == -1:
            return
        if task != self._task:
            self._task, self._walked = task, set()
        node = current_autograd_node()
        if node is not None and node_key(node) not in self._walked:
            self._backward_reaches(node)

    def allocated(self, op: object, out: object, ref: Followed, total: int) -> Origin:
        if len(self.ids) >= self.limit:
            self.overflowed = True
            return super().allocated(op, out, ref, total)
        allocation = Allocation(op_name(op), user_line(), len(self.allocations))
        try:
            allocation.module, allocation.category = self._context(op)
            allocation.shape, allocation.dtype = _described(out, ref.key)
        except Exception as exc:
            if not self.problems:
                self.problems.append(f"allocation: {one_line(exc)}")
        self.allocations.append(allocation)
        ref.origin = allocation
        self.ids.append(allocation.id)
        self.sizes.append(ref.counted)
        if self.allocator_trace is not None:
            self.allocator_trace.record()
        super().event("alloc", ref, total)
        return allocation

    def event(self, action: str, ref: Followed, total: int) -> None:
        origin = ref.origin
        if isinstance(origin, Allocation):
            if len(self.ids) >= self.limit:
                self.overflowed = True
            else:
                self.ids.append(origin.id)
                self.sizes.append(0 if action == "free" else ref.counted)
                if self.allocator_trace is not None:
                    self.allocator_trace.record()
                if action == "free":  # settled: what it was for cannot change any more
                    self.allocations[origin.id] = self._shared_record(origin)
        super().event(action, ref, total)

    def _shared_record(self, allocation: Allocation) -> Allocation:
        """One record for freed allocations alike in every field (a loop's temporaries): millions of them
        cost a list entry each."""
        key = (allocation.op, allocation.where, allocation.module, allocation.category, allocation.shape,
               allocation.dtype, allocation.unsaved_at)  # fmt: skip
        found = self._shared.get(key)
        if found is None and len(self._shared) < _MAX_SHARED:
            found = self._shared[key] = allocation
        return found or allocation

    # --- hooks, installed for the measured call only

    def install(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module

        self.compiling = torch.compiler.is_compiling
        self._thread = threading.get_ident()
        # torch.compile(module) warns when global module hooks exist, and ours exist only while measuring
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]
        from torch.optim import optimizer

        self._handles += [
            nn_module.register_module_forward_pre_hook(self._module_entered),
            nn_module.register_module_forward_hook(self._module_left, always_call=True),
            optimizer.register_optimizer_step_pre_hook(self._step_begins),
            optimizer.register_optimizer_step_post_hook(self._step_ends),
        ]

    def remove(self) -> None:
        """Undo every hook (the global ones and those on leaves)."""
        while self._handles:
            self._handles.pop().remove()
        with contextlib.suppress(ValueError):  # the test reset the filters itself
            cast(list[Any], warnings.filters).remove(self._filter)
        warnings._filters_mutated()  # type: ignore[attr-defined]
        self._stack.clear()

    @_contained
    def _module_entered(self, module: torch.nn.Module, args: object) -> None:

        if threading.get_ident() != self._thread:  # another thread's: its tensors are not followed
            return

        name = self._names.get(module)
        if name is None:
            name = self._name_tree(module)
        self._stack.append(name)
        self._open_calls.append((next_sequence_nr(), name))

    @_contained
    def _module_left(self, module: torch.nn.Module, args: object, output: object) -> None:
        if threading.get_ident() != self._thread:  # another thread's: its tensors are not followed
            return
        if not self._open_calls:
            return
        start, name = self._open_calls.pop()
        if self._stack:
            self._stack.pop()
        roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        for node in autograd_nodes(roots, lambda n: not start <= node_sequence_nr(n) < ACCUMULATE_GRAD_SEQUENCE):
            if self._by_sequence.setdefault(node_sequence_nr(node), name) == name:
                self._saves(node)  # held for backward from now on

    def _name_tree(self, module: torch.nn.Module) -> str:
        """Name `module` and everything below it (a root: its children by their qualified names), and
        mark their parameters and buffers."""
        base = f"({type(module).__name__})" if not self._stack else f"{self._stack[-1]}.{type(module).__name__}"
        for path, sub in module.named_modules():
            prefix = "" if not self._stack else f"{base}."
            self._names.setdefault(sub, f"{prefix}{path}" if path else base)
            owner = self._names[sub]
            self.kinds.setdefault(owner, type(sub).__name__)
            for tensor in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
                self._owners.setdefault(tensor, owner)
                self._mark(tensor, "parameters", owner)
        return self._names[module]

    @_contained
    def _step_begins(self, opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if threading.get_ident() != self._thread:  # another thread's: its tensors are not followed
            return
        self._in_step += 1
        for group in opt.param_groups:
            for param in group["params"]:
                self._mark(param, "parameters")
                if param.grad is not None:
                    self._mark(param.grad, "gradients")

    @_contained
    def _step_ends(self, opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        import torch

        if threading.get_ident() != self._thread:  # another thread's: its tensors are not followed
            return

        self._in_step = max(self._in_step - 1, 0)
        for param, state in opt.state.items():
            owner = self._owners.get(param, _STEP_MODULE)
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    self._mark(value, "optimizer_state", owner)

    def _backward_reaches(self, node: Any) -> None:
        """Read the graph a backward pass runs, from the node it runs now (once per node: a backward of
        several roots reaches each in turn): its saved tensors, and the leaves it accumulates gradients
        into (hooked, to see each gradient's storage when it lands)."""
        import torch

        for found in autograd_nodes([node], lambda n: node_key(n) in self._walked):
            self._walked.add(node_key(found))
            self._saves(found)
            variable = getattr(found, "variable", None)
            if isinstance(variable, torch.Tensor) and variable not in self._hooked:
                self._hooked[variable] = True
                with contextlib.suppress(RuntimeError):
                    hook = variable.register_post_accumulate_grad_hook(self._grad_landed)  # type: ignore[no-untyped-call]
                    self._handles.append(hook)

    def _saves(self, node: Any) -> None:
        """`node` holds its saved tensors for backward: each is saved, by it among others."""
        key = node_key(node)
        for storage, allocation in self._saved_allocations(node):
            allocation.mark("saved")
            allocation.unsaved_at = -1  # saved (again): its whole life reads as saved, as before any release
            self._savers.setdefault(allocation.id, set()).add(key)
            self._saved_by.setdefault(key, {})[allocation.id] = (storage, allocation)

    def _saved_allocations(self, node: Any) -> list[tuple[int, Allocation]]:
        found = []
        for tensor in saved_tensors(node):
            for key in storage_keys(tensor):
                ref = self.live.get(key)
                if ref is not None and isinstance(ref.origin, Allocation):
                    found.append((key, ref.origin))
        return found

    @_contained
    def backward_ran(self, roots: Sequence[Any]) -> None:
        """A run of the autograd engine from `roots` (tensors or gradient edges) returned: what the nodes it
        reaches saved and released (no retain_graph) is no longer saved by them; a storage still alive that
        no node known to us saves any more is not saved for backward from now on."""
        if not self._saved_by or threading.get_ident() != self._thread:
            return
        import torch

        starts = [r.grad_fn if isinstance(r, torch.Tensor) else getattr(r, "node", None) for r in roots]
        for node in autograd_nodes(starts, lambda n: False):
            key = node_key(node)
            held = self._saved_by.get(key)
            if held:
                still = {allocation.id for _, allocation in self._saved_allocations(node)}
                for allocation_id in [i for i in held if i not in still]:
                    self._released(key, *held.pop(allocation_id))

    def _released(self, node: tuple[int, Any], storage: int, allocation: Allocation) -> None:
        savers = self._savers.get(allocation.id, set())
        savers.discard(node)
        ref = self.live.get(storage)
        if not savers and ref is not None and ref.origin is allocation and allocation.category == "saved":
            allocation.unsaved_at = len(self.ids)
            self.unsaved.append((allocation.unsaved_at, allocation.id))

    @_contained
    def _grad_landed(self, tensor: torch.Tensor) -> None:
        if tensor.grad is not None:
            self._mark(tensor.grad, "gradients", self._owners.get(tensor))

    # --- where an allocation belongs

    def _context(self, op: object) -> tuple[str, str]:

        if self._stack:
            return self._stack[-1], "temporaries"
        if in_backward():
            return self._backward_module(), "temporaries"
        if self._in_step:
            return _STEP_MODULE, "temporaries"
        if not self._is_factory(op):
            return NO_MODULE, "temporaries"
        return NO_MODULE, "gradients" if _making_gradient_buckets() else "inputs"

    def _backward_module(self) -> str:

        node = current_autograd_node()
        if node is None:
            return NO_MODULE
        sequence = node_sequence_nr(node)
        if sequence == ACCUMULATE_GRAD_SEQUENCE:
            variable = getattr(node, "variable", None)
            return str(self._owners.get(variable, NO_MODULE)) if variable is not None else NO_MODULE
        return self._by_sequence.get(sequence, NO_MODULE)

    def _is_factory(self, op: object) -> bool:
        found = self._factory.get(op)
        if found is None:
            schema = op_schema(op)
            name = getattr(schema, "name", "")
            takes_tensors = schema is not None and any("Tensor" in str(arg.type) for arg in schema.arguments)
            found = self._factory[op] = (
                schema is not None and (not takes_tensors or name.endswith("_like") or name == "aten::lift_fresh")
            ) or op == "UntypedStorage.resize_"
        return found

    def _mark(self, tensor: object, category: str, module: str | None = None) -> None:
        for key in storage_keys(tensor):
            ref = self.live.get(key)
            allocation = None if ref is None else ref.origin
            if isinstance(allocation, Allocation):
                allocation.mark(category)
                if module is not None and allocation.category == category:
                    allocation.module = module


def _never() -> bool:
    return False


def _making_gradient_buckets() -> bool:
    """Whether DDP's constructor is making its `Reducer` (`at::empty` in C++, called from
    `DistributedDataParallel._ddp_init_helper`): its flat buckets, the parameters' size in all, are where
    backward copies and all-reduces the gradients, kept for the model's life (with
    `gradient_as_bucket_view=True` they are the `.grad` tensors), so they are gradients, not an input."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PLUGIN):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_ddp_init_helper"


def _described(out: object, key: int) -> tuple[tuple[int, ...] | None, str | None]:
    """Shape and dtype of the output whose storage is `key`."""
    for tensor in tensors_in(out):
        if key in storage_keys(tensor):
            return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
    return None, None
