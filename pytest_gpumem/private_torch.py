"""Every private PyTorch name the package touches, each behind one small function with the reason public
torch does not serve; `tests/test_private_torch.py` checks them all on the installed torch, so a torch
upgrade is checked, and fixed, here. No other module of the package names a private torch attribute.

Importing this module loads no torch: each function imports it when called. Where a caller needs a name
on every op (the tracker's dispatch mode), the function returns the bound callable or a C-level getter, to
be kept in a module constant, so the hot path pays no extra Python call. A torch class used as a base or
in `isinstance` (`TorchDispatchMode`, `FakeTensor`) is reached through a function returning it;
`TorchDispatchMode` is also this module's attribute, imported on first use, for a class statement.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TensorWithFlatten
    from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
    from typing_extensions import TypeIs


def __getattr__(name: str) -> Any:
    """`TorchDispatchMode`, imported when first asked for (a base class must be a name for type checkers)."""
    if name == "TorchDispatchMode":
        return dispatch_mode_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- storages and tensors ---------------------------------------------------------------------------

storage_key: Callable[[Any], int] = operator.attrgetter("_cdata")
"""A live storage's identity, the address of its StorageImpl (`UntypedStorage._cdata`): shared by every view,
distinct on the meta device too, where `data_ptr()` is 0 for all; a C-level getter, cheap on each op."""

tensor_key: Callable[[Any], int] = operator.attrgetter("_cdata")
"""A live tensor's identity, the address of its TensorImpl (`Tensor._cdata`): what the autograd engine
passes between nodes, whichever Python object stands for it."""

SPARSE_COO_PARTS = ("_indices", "_values")
"""The methods returning a COO tensor's index and value tensors as stored: `indices()` refuses an
uncoalesced tensor."""

SAVED_VARIABLE_PREFIX = "_raw_saved_"
"""The prefix of an autograd node's raw saved variables: `saved_*` would unpack a hook-packed one."""


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """References to a StorageImpl (`can_accumulate_inplace` wants one); no public API reads it."""
    import torch

    return int(torch._C._storage_Use_Count(storage_key(storage)))


def tensor_use_count(tensor: torch.Tensor) -> int:
    """C++ references to a TensorImpl (torch's own `is_tensor_stealable` reads it); no public API."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


def is_view(tensor: torch.Tensor) -> bool:
    """`Tensor::is_view()` of C++, which autocast's `cached_cast` checks; Python has `_base`, not this."""
    return bool(tensor._is_view())


def is_zero_tensor(tensor: torch.Tensor) -> bool:
    """Whether a tensor is an efficient zero (no memory of its own); public API cannot tell."""
    return bool(tensor._is_zerotensor())


# --- the autograd engine ----------------------------------------------------------------------------


@functools.cache
def graph_task_reader() -> Callable[[], int]:
    """The engine's reader of this thread's graph task id (-1 outside backward), bound for per-op use: no
    public API says whether an op runs inside backward."""
    import torch

    reader: Callable[[], int] = torch._C._current_graph_task_id
    return reader


def in_backward() -> bool:
    """Whether the autograd engine is running a node on this thread (see `graph_task_reader`)."""
    return graph_task_reader()() != -1


def current_autograd_node() -> Any:
    """The autograd node the engine runs on this thread, or None: no public API names it."""
    import torch

    return torch._C._current_autograd_node()


def next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread gets: nodes made after a module's
    forward began are the ones numbered from it (no public API)."""
    import torch

    return int(torch._C._autograd._get_sequence_nr())


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (`Node._sequence_nr`, no public accessor)."""
    return int(node._sequence_nr())


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform (grad, vmap) wraps this thread's tensors; no public API says."""
    import torch

    return bool(torch._C._are_functorch_transforms_active())


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd traces backward (Dynamo's module flag; False where Dynamo is not loaded)."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled is not None and bool(getattr(compiled, "compiled_autograd_enabled", False))


def engine_entry() -> tuple[Any, str]:
    """Where every backward enters the engine (`torch.autograd.graph._engine_run_backward`, torch >= 2.4):
    the one place to wrap all of them (`backward`, `autograd.grad`, checkpoint's recompute)."""
    import torch.autograd.graph as graph

    return graph, "_engine_run_backward"


# --- ops and the dispatcher -------------------------------------------------------------------------


def op_schema(op: object) -> Any:
    """An OpOverload's FunctionSchema (name, arguments, returns with alias info), None for anything else:
    `torch.ops` has no public accessor."""
    return getattr(op, "_schema", None)


def op_kernel(op: Any) -> Callable[..., Any]:
    """The C++ callable behind an OpOverload (`_op`, which `OpOverload.__call__` calls): one Python frame
    less on each op; the overload itself where it has none."""
    kernel: Callable[..., Any] | None = getattr(op, "_op", None)
    return kernel if callable(kernel) else op


def sdpa_function() -> Callable[..., Any]:
    """The C binding `F.scaled_dot_product_attention` is, which a TorchFunctionMode receives as `func`."""
    import torch

    function: Callable[..., Any] = torch._C._nn.scaled_dot_product_attention
    return function


def dispatch_mode_class() -> type[TorchDispatchMode]:
    """`TorchDispatchMode`, the base of a Python dispatch mode; it lives in a private module."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def fake_tensor_class() -> type[FakeTensor]:
    """`FakeTensor` (shapes without memory), which public API has no `isinstance` test for."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def wrapper_subclass_test() -> Callable[[object], TypeIs[TensorWithFlatten]]:
    """`is_traceable_wrapper_subclass`: whether a tensor is a wrapper whose inner tensors hold its memory."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass


def dispatch_mode_stack() -> list[Any]:
    """This thread's Python dispatch modes, innermost last (a new list); no public API lists them."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def current_dispatch_mode() -> Any:
    """The innermost Python dispatch mode on this thread, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def pop_dispatch_mode() -> Any:
    """Take the innermost dispatch mode off this thread's stack without exiting it (a mode a test left on)."""
    from torch.utils._python_dispatch import _pop_mode

    return _pop_mode()


def dispatch_mode_stepped_aside() -> AbstractContextManager[Any]:
    """The innermost dispatch mode off the stack for a block, back after it (the JIT tracer refuses modes)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    return _pop_mode_temporarily()


def no_dispatch_modes() -> AbstractContextManager[Any]:
    """Every dispatch mode off for a block (a calibration run that no measuring mode may see)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def pytree_map(function: Callable[[Any], Any], tree: object) -> Any:
    """`tree` with `function` applied to each leaf torch's pytree sees (an optimizer's state, copied); the
    module is private."""
    from torch.utils._pytree import tree_map

    return tree_map(function, tree)


def pytree_leaves(tree: object) -> list[Any]:
    """The leaves torch's pytree sees in an op's output (tuples, lists, dicts, namedtuples, registered
    types); the module is private."""
    from torch.utils._pytree import tree_leaves

    return tree_leaves(tree)


def function_mode_stack() -> list[Any]:
    """This thread's torch-function modes, innermost last; no public API lists them."""
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())  # type: ignore[no-untyped-call]


def pop_function_mode() -> Any:
    """Take the innermost torch-function mode off this thread's stack without exiting it (one a test left on)."""
    from torch.overrides import _pop_mode

    return _pop_mode()  # type: ignore[no-untyped-call]


# --- Dynamo and Inductor ----------------------------------------------------------------------------


@functools.cache
def eval_frame_setter() -> Callable[[Any], Any] | None:
    """Dynamo's `set_eval_frame`, to keep Dynamo out of a dispatch mode's frames more cheaply than the
    wrapper `TorchDispatchMode` otherwise adds (two Python frames per op); None where torch lacks it or
    what `hide_from_dynamo` needs. Both are Dynamo's C parts: importing `torch._dynamo` costs a second."""
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except ImportError:
        return None
    if not callable(set_eval_frame) or _code_skipper() is None:
        return None
    setter: Callable[[Any], Any] = set_eval_frame
    return setter


@functools.cache
def _code_skipper() -> Callable[[Any], None] | None:
    """What `torch._dynamo.eval_frame.skip_code` does: Dynamo runs a code object's frames as they are."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return None

    def skip(code: Any) -> None:
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))

    return skip


def hide_from_dynamo(function: Any) -> None:
    """What `torch._disable_dynamo` gives a function, without its wrapper: Dynamo neither compiles its frame
    (the code's strategy) nor inlines it when tracing a compiled function (the flag)."""
    skip = _code_skipper()
    assert skip is not None, "hide_from_dynamo is called only where eval_frame_setter() is not None"
    skip(function.__code__)
    function._torchdynamo_disable = True


class DynamoWrapperOff:
    """A mixin for a `TorchDispatchMode` whose `__torch_dispatch__` goes through `hide_from_dynamo` and sets
    `eval_frame_setter()` itself: torch asks `_should_skip_dynamo` (a hook it calls temporary) whether to
    wrap the method in `torch._disable_dynamo`; only where the cheaper way is missing."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return eval_frame_setter() is None


DYNAMO = "torch._dynamo"
"""Dynamo's package: the first call of anything torch wraps in `torch._disable_dynamo` (an optimizer's
`add_param_group`, which its constructor calls) imports it, a second or more; a process that forks ranks
imports it once for them."""


DYNAMO_FRAMES = "torch._dynamo.eval_frame"
"""Dynamo's module that picks the callback each call of a compiled function runs its frames with."""


def compile_stance_owner() -> tuple[Any, str] | None:
    """(Dynamo's frame module, the name of the function through which each call of a compiled function
    picks the callback its frames run with, under the compiler's stance: None or False runs them as they
    are, as `torch.compiler.set_stance("force_eager")` does); None while Dynamo is not loaded."""
    eval_frame = sys.modules.get(DYNAMO_FRAMES)
    if eval_frame is None or not callable(getattr(eval_frame, "_callback_from_stance", None)):
        return None
    return eval_frame, "_callback_from_stance"


def inductor_partition_backend() -> Callable[..., Any]:
    """Dynamo's `aot_eager_decomp_partition` backend: Inductor's decompositions and min-cut partitioner (what
    is saved for backward, what is recomputed), then the forward and backward graphs run op by op, each
    value freed after its last use."""
    from torch._dynamo.backends.registry import lookup_backend

    backend: Callable[..., Any] = lookup_backend("aot_eager_decomp_partition")
    return backend


@functools.cache
def _composite_meta_kernels() -> tuple[Any, ...]:
    """The ops that decompose on every device (CompositeImplicitAutograd) to which torch also gives a Python
    meta kernel (from the decompositions' table, `torch._meta_registrations.activate_meta`)."""
    import torch
    from torch._decomp import global_decomposition_table

    meta = torch._C.DispatchKey.Meta
    found = {
        op
        for table in global_decomposition_table.values()
        for op in table
        if isinstance(op, torch._ops.OpOverload)
        and meta in op.py_kernels
        and torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(),  # type: ignore[no-untyped-call]
            "CompositeImplicitAutograd",
        )
    }
    return tuple(found)


@contextlib.contextmanager
def composite_ops_decomposed_on_meta() -> Iterator[None]:
    """Within the block, ops that decompose on every device (CompositeImplicitAutograd) decompose on meta
    tensors too while torch traces (the Python dispatcher): their Python meta kernels stand aside. Kept, a
    kernel hides the decomposition's autograd (nll_loss, so cross_entropy, lost its gradient)."""
    import torch

    meta = torch._C.DispatchKey.Meta
    taken = [(op, op.py_kernels.pop(meta)) for op in _composite_meta_kernels() if meta in op.py_kernels]
    for op, _ in taken:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in taken:
            op.py_kernels[meta] = kernel
            op._dispatch_cache.clear()


def dynamo_callback(backend: Callable[..., Any], like: Any) -> Any:
    """The callback with which Dynamo compiles a frame's code with `backend`, made as `like` (the callback
    `torch.compile` chose for the frame) was made: with `fullgraph=True` a graph break still raises. Dynamo
    clones a callback with another backend so for DDP; a callback that cannot be cloned is made plainly."""
    from torch._dynamo.convert_frame import catch_errors_wrapper
    from torch._dynamo.eval_frame import _create_wrapped_callback

    clone = getattr(getattr(like, "_torchdynamo_orig_backend", None), "_clone_with_backend", None)
    if clone is None or not hasattr(like, "hooks"):
        return _create_wrapped_callback(backend)
    return catch_errors_wrapper(clone(backend), like.hooks)


def dynamo_compiler(callback: Any) -> tuple[str, dict[str, Any] | None]:
    """(the name of the compiler a callback of Dynamo's compiles with, Inductor's options where that compiler
    is Inductor, else None): `torch.compile`'s backend, found under the wrappers Dynamo puts around it."""
    backend = callback
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    name = str(getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__))
    if name != "inductor":
        return name, None
    options = getattr(backend, "config", None)
    return name, dict(options) if isinstance(options, dict) else {}


def inductor_allocator_owner() -> tuple[Any, str]:
    """(the module holding Inductor's direct allocators, their name prefix): compiled programs allocate
    through `_empty_strided_cpu` and its kin, below any dispatch mode."""
    import torch

    return torch._C._dynamo.guards, "_"


def loaded_inductor_modules() -> Iterator[Any]:
    """The generated modules of compiled programs loaded so far (each holds its own allocator names)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return iter(())
    cache = codecache.PyCodeCache
    return iter([*getattr(cache, "modules", []), *getattr(cache, "modules_no_attr", {}).values()])


# --- autocast and the dispatcher's keys -------------------------------------------------------------


def _autocast_cuda_key() -> Any:
    import torch

    return torch._C.DispatchKey.AutocastCUDA


def without_cuda_autocast() -> AbstractContextManager[Any]:
    """A guard excluding the AutocastCUDA dispatch key, as CUDA's kernels do before running the op; the key
    and its guards have no public name."""
    import torch

    guard: AbstractContextManager[Any] = torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(_autocast_cuda_key())
    )
    return guard


def cuda_autocast_key_included() -> bool:
    """Whether this thread's included key set holds AutocastCUDA (thread-local dispatcher state, no public API)."""
    import torch

    return bool(torch._C._dispatch_tls_is_dispatch_key_included(_autocast_cuda_key()))


def include_cuda_autocast_key(included: bool) -> None:
    """Put AutocastCUDA into (or out of) this thread's included key set: meta and CPU tensors lack the key."""
    import torch

    torch._C._dispatch_tls_set_dispatch_key_included(_autocast_cuda_key(), included)


@functools.cache
def ops_with_cuda_autocast() -> frozenset[str]:
    """The ops the installed torch registers a CUDA autocast kernel for (the dispatcher's debug API: no
    public one says)."""
    import torch

    names = torch._C._dispatch_get_all_op_names()
    return frozenset(name for name in names if torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA"))


def registered_at(name: str) -> str | None:
    """The file:line that registered the AutocastCUDA kernel of `name` (the dispatcher's debug dump)."""
    import torch

    for line in torch._C._dispatch_dump(name).splitlines():
        if line.startswith("AutocastCUDA: registered at "):
            return line.removeprefix("AutocastCUDA: registered at ").split(" ")[0]
    return None


def destroy_library(library: Any) -> None:
    """Remove a `torch.library.Library`'s kernels now (torch's own are active again); public only as `__del__`."""
    library._destroy()


def checkpoint_autocast_state() -> tuple[Any, str]:
    """torch.utils.checkpoint's reader of the autocast state it saves for a recompute (private)."""
    import torch.utils.checkpoint as checkpoint

    return checkpoint, "_get_autocast_kwargs"


def checkpoint_device_type() -> tuple[Any, str]:
    """torch.utils.checkpoint's choice of the device whose RNG and autocast state it saves (private)."""
    import torch.utils.checkpoint as checkpoint

    return checkpoint, "_infer_device_type"


def scaler_step() -> tuple[Any, str]:
    """GradScaler's method that reads each found_inf with `.item()` before stepping (private)."""
    import torch.amp.grad_scaler as grad_scaler

    return grad_scaler.GradScaler, "_maybe_opt_step"


def amp_availability() -> tuple[Any, str]:
    """The helper autocast and GradScaler ask whether CUDA amp is available (an internal module's)."""
    import torch.cuda.amp.common as common

    return common, "amp_definitely_not_available"


# --- other patched internals ------------------------------------------------------------------------


def jit_trace_module() -> Any:
    """The module defining `torch.jit.trace` and `trace_module`, which `torch.jit` re-exports as copies."""
    import torch.jit._trace as trace_module

    return trace_module


def module_apply() -> tuple[Any, str]:
    """`Module._apply`, through which `to`, `cuda`, `half` and `to_empty` convert every parameter and buffer."""
    import torch

    return torch.nn.Module, "_apply"


def dropout_base() -> type[Any]:
    """The base class of every dropout module (`Dropout`, `Dropout1d/2d/3d`, `AlphaDropout`, ...): no public
    class or flag says that a module draws random numbers."""
    import torch

    return torch.nn.modules.dropout._DropoutNd


def takes_foreach(params: list[Any]) -> bool:
    """Whether an optimizer given neither `foreach` nor `fused` takes the foreach (multi-tensor) kernels for
    `params`, as its own default decides (by their devices and types); no public API asks."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])


def fake_store() -> Any:
    """A store for the `fake` process group (a world of one process playing any rank): torch ships it only
    under `torch.testing._internal`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def foreach_devices() -> tuple[Any, str]:
    """The optimizers' list of devices with foreach kernels (meta and CPU are left out, though they run)."""
    import torch.optim.optimizer as optimizer

    return optimizer, "_get_foreach_kernels_supported_devices"


# --- the CUDA caching allocator ---------------------------------------------------------------------


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per handle and stream, where this torch can (no public API)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if callable(clear):
        clear()


def record_memory_history(max_entries: int) -> None:
    """Start the allocator's history with Python stacks at each allocation (documented, underscored)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", context="alloc")


def memory_snapshot() -> Any:
    """The allocator's segments and history as the memory visualizer reads them (documented, underscored)."""
    import torch

    return torch.cuda.memory._snapshot()
