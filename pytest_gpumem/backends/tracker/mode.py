"""The tracker's dispatch mode: every ATen op's fresh output storages, told to a ledger.

A `TorchDispatchMode` sees every op below autograd, those run by backward, checkpoint recomputation and
autocast casts included. Each output whose schema says it is fresh (not an alias of an input) brings a
new storage, which the ledger follows until a weak reference to it dies. An op that runs on cuBLAS on a
GPU (`_BLAS_OPS`) also tells the ledger which cuBLAS handle it used, for its workspace: the test's thread
has one, and backward, which CUDA runs on the autograd engine's device thread, another. The tracker
backend and the shadow both count through `mode_class()`, and take the mode off with `leave`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pytest_gpumem import private_torch
from pytest_gpumem.backends.tracker.graph import tensors_in
from pytest_gpumem.backends.tracker.kernel_temporaries import may_take, modelled
from pytest_gpumem.backends.tracker.kernel_temporaries import record as record_temporaries
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.patches import count_compiled_allocations
from pytest_gpumem.backends.tracker.recording import op_name
from pytest_gpumem.backends.tracker.unmoded import CANDIDATES, in_place_twin
from pytest_gpumem.private_torch import DynamoWrapperOff, TorchDispatchMode, op_schema, storage_key


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
        return None


# What an op's schema says about its outputs, decided once per op (`_op_plan`):
_PASS = 0  # every return aliases an input (views, in-place ops) or there is none: nothing new
_SINGLE = 1  # one fresh Tensor: count its storage without walking the result
_MANY = 2  # fresh tensors among several returns or in lists: count those positions
_RESIZE = 3  # out= overloads and resize_/set_: storages that existed may grow
_LIFT = 4  # lift_fresh: a constant made outside any mode (torch.tensor), or memory torch does not own
_CHECKED = 5  # fresh by its schema, but may return its inputs' storages: count only the others
_BLAS = 6  # runs on cuBLAS on a GPU (its handle's workspace); the plan of its outputs follows it
_TWIN = 7  # in backward, may run in place as without a mode (`unmoded`); the plan of its outputs follows it
_TEMPS = 8  # its CUDA kernel takes temporaries inside the op (`kernel_temporaries`); its outputs' plan follows
_NOT_DENSE = object()  # marks the parts of a sparse tensor in a walk over storages
_FAKE = object()  # marks a fake tensor (FakeTensorMode): shapes without memory, never counted

_RESIZING_OPS = frozenset(("aten::resize_", "aten::resize_as_", "aten::set_"))
_LIFTING_OPS = frozenset(("aten::lift_fresh",))  # returns its input, a constant made outside any mode
# views (or sparse tensors built on their inputs) whose schemas carry no alias annotation
_UNANNOTATED_ALIASES = frozenset(
    (
        "aten::_unsafe_view",
        "aten::unsafe_split",
        "aten::unsafe_split_with_sizes",
        "aten::unsafe_chunk",
        "aten::sparse_coo_tensor",
        "aten::_sparse_coo_tensor_unsafe",
        "aten::_sparse_coo_tensor_with_dims_and_tensors",
        "aten::sparse_compressed_tensor",
        "aten::_sparse_compressed_tensor_unsafe",
        "aten::sparse_csr_tensor",
        "aten::_sparse_csr_tensor_unsafe",
    )
)


_BLAS_OPS = frozenset(
    (
        "aten::mm",
        "aten::addmm",
        "aten::_addmm_activation",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::mv",
        "aten::addmv",
        "aten::dot",
        "aten::vdot",
        "aten::_int_mm",
        "aten::_scaled_mm",
        "aten::triangular_solve",
        "aten::linalg_solve_triangular",
    )
)
"""Ops (every overload: in place, out=) that CUDA runs through a cuBLAS or cuBLASLt handle
(`at::cuda::blas` in `aten/src/ATen/native/cuda/Blas.cpp`, the triangular solves in
`BatchLinearAlgebraLib.cpp`): `matmul`, `linear`, `einsum` and eager attention reach them. Not here: the
fused attention kernels, convolutions (cuDNN), cuSOLVER's factorizations (their own handles)."""

_AUTOGRAD_HANDLE = "autograd"
"""The cuBLAS handle of backward: CUDA runs backward on the autograd engine's device thread, which reserves
a handle of its own (every other thread's is its thread's)."""


def _op_plan(func: Any) -> tuple[int, Any]:
    """(kind, positions of the fresh returns) for an op overload; for _MANY, None means the one return
    (a list, an optional tensor) is walked whole; for _BLAS and _TWIN, the plan of its outputs."""
    plan = _output_plan(func)
    if func in CANDIDATES:
        return _TWIN, plan
    if op_schema(func).name.removesuffix("_") in _BLAS_OPS:  # in place: addmm_
        return _BLAS, plan
    return (_TEMPS, plan) if modelled(func) else plan


def _output_plan(func: Any) -> tuple[int, tuple[int, ...] | None]:
    schema = op_schema(func)
    returns = schema.returns
    if schema.name in _RESIZING_OPS or any(arg.is_out for arg in schema.arguments):
        return _RESIZE, ()
    if schema.name in _LIFTING_OPS:
        return _LIFT, (0,)
    fresh = tuple(i for i, ret in enumerate(returns) if ret.alias_info is None)
    if not fresh:
        return _PASS, ()
    if schema.name in _UNANNOTATED_ALIASES:
        return _CHECKED, None
    if len(returns) == 1:
        return (_SINGLE, fresh) if str(returns[0].type) == "Tensor" else (_MANY, None)
    return _MANY, fresh


def _rewrapped_numbers(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """`args` with 0-dim tensors again where a Tensor argument arrived as a Python number, or None.

    TorchScript passes numbers as "wrapped number" tensors (`prim::NumToTensor`); on the way into a
    Python dispatch mode they become Python numbers, which the op then refuses.
    """
    numbers = [
        i
        for i, (arg, value) in enumerate(zip(op_schema(func).arguments, args, strict=False))
        if isinstance(value, (bool, int, float, complex)) and str(arg.type) == "Tensor"
    ]
    if not numbers:
        return None
    return tuple(torch.tensor(value) if i in numbers else value for i, value in enumerate(args))


def _sparse_parts() -> dict[Any, tuple[str, ...]]:
    """The component tensors that hold a sparse tensor's memory, by layout."""
    compressed_rows = ("crow_indices", "col_indices", "values")
    compressed_cols = ("ccol_indices", "row_indices", "values")
    return {
        torch.sparse_coo: private_torch.SPARSE_COO_PARTS,
        torch.sparse_csr: compressed_rows,
        torch.sparse_bsr: compressed_rows,
        torch.sparse_csc: compressed_cols,
        torch.sparse_bsc: compressed_cols,
    }


_TENSOR = torch.Tensor
_SPARSE_PARTS = _sparse_parts()
_SET_EVAL_FRAME = private_torch.eval_frame_setter()
_FAKE_TENSOR = private_torch.fake_tensor_class()
_is_wrapper_subclass = private_torch.wrapper_subclass_test()
_PLANS: dict[Any, tuple[int, Any]] = {}  # each op overload's plan, decided on its first call
# ops whose outputs are nothing (_PASS) or one fresh tensor (_SINGLE), by the overload's name (a str hashes in
# C, an overload in Python): (counts its output, the op's kernel, when the fast path may not take it:
# _ON_GPU, _IN_BACKWARD, _WORKSPACE or a union, 0 for never; the overload, which two namespaces may share a
# name with: another one of the name takes the slow path)
_FAST: dict[str, tuple[bool, Callable[..., Any], int, Any]] = {}
_ON_GPU = 1  # an op with kernel temporaries: slow only where the ledger predicts a GPU
_IN_BACKWARD = 2  # a candidate of `unmoded`: slow only while the autograd engine runs
_WORKSPACE = 4  # a cuBLAS op: slow only while its handle has no workspace of the ledger's size


_graph_task = private_torch.graph_task_reader()
_thread = threading.get_ident


def _storages(out: object) -> Iterator[Any]:
    """The storages holding the memory of the tensors in `out`; before the parts of a sparse tensor,
    `_NOT_DENSE`; for a fake tensor, `_FAKE`."""
    for tensor in tensors_in(out):
        parts = _SPARSE_PARTS.get(tensor.layout)
        if isinstance(tensor, _FAKE_TENSOR):
            yield _FAKE
        elif parts is not None:
            yield _NOT_DENSE
            yield from _storages([getattr(tensor, part)() for part in parts])
        elif type(tensor) is not _TENSOR and _is_wrapper_subclass(tensor):
            # a wrapper's own storage is nominal; its inner tensors hold the memory
            attrs, _ = tensor.__tensor_flatten__()
            yield from _storages([getattr(tensor, attr) for attr in attrs])
        else:
            storage = _storage(tensor)
            if storage is not None:
                yield storage


def _input_keys(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> set[int]:
    found = _storages([*args, *(kwargs or {}).values()])
    return {storage_key(s) for s in found if s is not _NOT_DENSE and s is not _FAKE}


def _make_fast(func: Any, plan: tuple[int, Any]) -> None:
    """Put `func` in `_FAST` where its outputs' plan is _PASS or _SINGLE, with the conditions under which
    its extra work (cuBLAS workspace, kernel temporaries, the in-place twin) still needs the slow path."""
    kind, outputs, when = plan[0], plan, 0
    if kind == _TWIN:
        outputs, when = plan[1], _IN_BACKWARD | (_ON_GPU if modelled(func) else 0)
    elif kind == _BLAS:
        outputs, when = plan[1], _WORKSPACE | (_ON_GPU if modelled(func) else 0)
    elif kind == _TEMPS:
        outputs, when = plan[1], _ON_GPU
    if outputs[0] in (_PASS, _SINGLE):
        _FAST[func.__name__] = (outputs[0] == _SINGLE, private_torch.op_kernel(func), when, func)


def _workspace_due(ledger: StorageLedger) -> object | None:
    """The cuBLAS handle a matmul on this thread runs on, if it has no workspace of the ledger's size yet."""
    handle = _AUTOGRAD_HANDLE if _graph_task() != -1 else _thread()
    return None if handle in ledger.workspaces_ready else handle


def _slow(when: int, ledger: StorageLedger, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether op `func` with these conditions (`_make_fast`) takes the slow path now, on these arguments."""
    return (
        bool(when & _ON_GPU and ledger.wants_temporaries and may_take(func, args, kwargs))
        or bool(when & _IN_BACKWARD and _graph_task() != -1)
        or bool(when & _WORKSPACE and ledger.wants_workspaces and _workspace_due(ledger) is not None)
    )


class _StorageTrackingMode(DynamoWrapperOff, TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, ledger: StorageLedger) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ledger = ledger

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo compiles under the mode (instead of falling back to eager), with the mode off
        # while compiling and on while the compiled program runs (its allocators are wrapped).
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        __tracebackhide__ = True  # a user's error in an op shows the user's frames, not ours
        set_eval_frame = _SET_EVAL_FRAME  # one global lookup per op
        prior = None if set_eval_frame is None else set_eval_frame(None)
        try:
            fast = _FAST.get(func.__name__)
            ledger = self.ledger
            if (
                fast is None
                or fast[3] is not func
                or ledger.recording
                or (fast[2] and _slow(fast[2], ledger, func, args, kwargs))
            ):
                return self._dispatch(func, args, kwargs)
            ledger.op = func
            out = fast[1](*args, **kwargs) if kwargs else fast[1](*args)
            if fast[0]:
                self._count_single(out, args, kwargs)
            return out
        except RuntimeError:
            numbers = _rewrapped_numbers(func, args)
            if numbers is None:
                raise
            return self._dispatch(func, numbers, kwargs)
        finally:
            self.ledger.out = None  # the recorder's view of the outputs must not keep them alive
            if prior is not None and set_eval_frame is not None:  # Dynamo's callback back (None: nothing to undo)
                set_eval_frame(prior)

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        __tracebackhide__ = True
        self.ledger.op = func  # what made the allocations to come, for a recorder or a timeline
        recorder = self.ledger.recorder
        if recorder is not None:
            recorder.entered()
        plan = _PLANS.get(func)
        if plan is None:
            plan = _PLANS[func] = _op_plan(func)
            _make_fast(func, plan)
        if plan[0] < _BLAS:
            return self._run(func, plan, args, kwargs)
        if plan[0] == _TWIN:
            out = in_place_twin(func, args, kwargs) if _graph_task() != -1 else None
            out = self._run(func, plan[1], args, kwargs) if out is None else out
        else:
            out = self._run(func, plan[1], args, kwargs)
        ledger = self.ledger
        workspace = None
        if plan[0] == _BLAS and ledger.wants_workspaces and _workspace_due(ledger) is not None:
            workspace = functools.partial(self._workspace, func, args, kwargs)
        if ledger.wants_temporaries and modelled(func):
            # held while the workspace is made
            record_temporaries(ledger, func, args, kwargs, during=workspace, out=out)
        elif workspace is not None:
            workspace()
        return out

    def _workspace(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        """`func` ran on cuBLAS: its handle's workspace, made on the handle's first use (an empty operand
        returns before cuBLAS is reached)."""
        ledger = self.ledger
        handle = _workspace_due(ledger)
        if handle is None:
            return
        if any(t.numel() == 0 for t in tensors_in([*args, *(kwargs or {}).values()])):
            return
        ledger.out, ledger.op = None, f"cuBLAS workspace ({op_name(func)})"
        ledger.workspace(handle)

    def _run(self, func: Any, plan: tuple[int, Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        __tracebackhide__ = True
        recorder = self.ledger.recorder
        kind = plan[0]
        fast = _FAST.get(func.__name__)
        kernel = func if fast is None or fast[3] is not func else fast[1]  # the C++ callable, one Python frame less
        if kind == _PASS:
            return kernel(*args, **kwargs) if kwargs else kernel(*args)
        if kind == _RESIZE:
            return self._dispatch_resizing(func, args, kwargs or {})
        if kind == _LIFT:
            return self._dispatch_lifting(func, args, kwargs or {})
        out = kernel(*args, **kwargs) if kwargs else kernel(*args)
        if recorder is not None:
            self.ledger.out = out
        if kind == _SINGLE:
            self._count_single(out, args, kwargs)
            return out
        positions = plan[1]
        fresh = out if positions is None else [out[i] for i in positions]
        self._count(fresh, args, kwargs, checked=kind == _CHECKED)
        return out

    def _count_single(self, out: object, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        """Count the storage of the one fresh tensor an op returned (`_SINGLE`)."""
        if type(out) is _TENSOR:
            try:
                storage = out.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
                self._count(out, args, kwargs)
                return
            self.ledger.add(storage)
            return
        self._count(out, args, kwargs)

    def _count(self, out: object, args: tuple[Any, ...], kwargs: dict[str, Any] | None, checked: bool = False) -> None:
        """Count the storages of `out`; `checked` (or a sparse output) leaves out the inputs' own."""
        inputs = _input_keys(args, kwargs) if checked else None
        for storage in _storages(out):
            if storage is _NOT_DENSE:  # a sparse tensor's parts may be tensors it was given
                if inputs is None:
                    inputs = _input_keys(args, kwargs)
            elif storage is _FAKE:
                self.ledger.fake_outputs += 1
            elif inputs is None or storage_key(storage) not in inputs:
                self.ledger.add(storage)

    def _dispatch_lifting(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        out = self.ledger.out = func(*args, **kwargs)
        storage = _storage(out) if isinstance(out, _TENSOR) else None
        # torch.tensor(data) fills a new, resizable storage; torch.as_tensor/from_numpy share
        # memory torch did not allocate (not resizable)
        if storage is not None and storage.resizable():
            self.ledger.add(storage)
        return out

    def _dispatch_resizing(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        before: dict[int, int] = {}
        for tensor in tensors_in([*args, *kwargs.values()]):
            storage = _storage(tensor)
            if storage is not None:
                before[storage_key(storage)] = storage.nbytes()
        out = self.ledger.out = func(*args, **kwargs)
        for tensor in tensors_in(out):
            storage = _storage(tensor)
            if storage is None:
                continue
            previous = before.get(storage_key(storage))
            if previous is None:
                self.ledger.add(storage)
            else:
                self.ledger.grow_existing(storage, previous)
        return out


@functools.cache
def mode_class() -> type[_StorageTrackingMode]:
    """The tracker's mode, made ready once: hidden from Dynamo, and told of compiled programs' allocations."""
    if _SET_EVAL_FRAME is not None:
        private_torch.hide_from_dynamo(_StorageTrackingMode.__torch_dispatch__)
    count_compiled_allocations(_StorageTrackingMode)
    return _StorageTrackingMode


def leave(mode: Any) -> None:
    """Take the tracker's mode off this thread's dispatch stack, also when the test left modes of its
    own above it (they are taken off too: they were entered inside the measured call)."""
    if mode not in private_torch.dispatch_mode_stack():
        return
    while private_torch.dispatch_mode_stack()[-1] is not mode:
        private_torch.pop_dispatch_mode()
    mode.__exit__(None, None, None)
