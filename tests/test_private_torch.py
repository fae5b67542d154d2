"""Every private torch name the package uses (`pytest_gpumem.private_torch`) exists on the installed torch and
behaves as the package assumes: after a torch upgrade, a failure here names the one function to fix."""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.two_tensor import TwoTensor

from pytest_gpumem import private_torch as pt
from pytest_gpumem.backends.tracker.graph import ACCUMULATE_GRAD_SEQUENCE


class _Mode(pt.TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _in_backward(read: Callable[[], object]) -> object:
    """What `read` returns while the engine runs the node of `x * 2`'s backward."""
    seen: list[object] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(read()))  # type: ignore[no-untyped-call]
    y.sum().backward()  # type: ignore[no-untyped-call]
    return seen[0]


def _storage_key() -> None:
    t = torch.ones(4)
    meta_a, meta_b = torch.ones(4, device="meta"), torch.ones(4, device="meta")
    assert pt.storage_key(t.untyped_storage()) == pt.storage_key(t[1:].untyped_storage())
    assert pt.storage_key(meta_a.untyped_storage()) != pt.storage_key(meta_b.untyped_storage())


def _tensor_key() -> None:
    a, b = torch.ones(2), torch.ones(2)
    assert pt.tensor_key(a) == pt.tensor_key(a) != pt.tensor_key(b)


def _sparse_coo_parts() -> None:
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False
    )
    assert [getattr(uncoalesced, part)().numel() for part in pt.SPARSE_COO_PARTS] == [2, 2]
    with pytest.raises(RuntimeError):
        uncoalesced.indices()  # why the private parts: the public one refuses


def _saved_variable_prefix() -> None:
    node = torch.ones(2, requires_grad=True).exp().grad_fn
    assert f"{pt.SAVED_VARIABLE_PREFIX}result" in dir(node)


def _storage_use_count() -> None:
    t = torch.ones(4)
    before = pt.storage_use_count(t.untyped_storage())
    view = t[1:]
    assert pt.storage_use_count(t.untyped_storage()) == before + 1
    del view


def _tensor_use_count() -> None:
    t = torch.ones(4)
    before = pt.tensor_use_count(t)
    view = t.view(4)  # holds its base
    assert pt.tensor_use_count(t) == before + 1
    del view


def _is_zero_tensor() -> None:
    assert pt.is_zero_tensor(torch._efficientzerotensor(2)) and not pt.is_zero_tensor(torch.zeros(2))


def _dispatch_mode_stack() -> None:
    with _Mode() as mode:
        assert pt.dispatch_mode_stack()[-1] is mode and pt.current_dispatch_mode() is mode
        with pt.dispatch_mode_stepped_aside():
            assert mode not in pt.dispatch_mode_stack()
        with pt.no_dispatch_modes():
            assert pt.current_dispatch_mode() is None
        assert pt.current_dispatch_mode() is mode
    assert pt.dispatch_mode_stack() == []


def _pop_dispatch_mode() -> None:
    outer, inner = _Mode(), _Mode()
    with outer:
        inner.__enter__()  # type: ignore[no-untyped-call]
        assert pt.pop_dispatch_mode() is inner
        assert pt.dispatch_mode_stack() == [outer]


def _next_sequence_nr() -> None:
    x = torch.ones(2, requires_grad=True)
    first = pt.next_sequence_nr()
    y = x * 2
    assert pt.node_sequence_nr(y.grad_fn) == first and pt.next_sequence_nr() == first + 1


def _node_sequence_nr() -> None:
    node = (torch.ones(2, requires_grad=True) * 2).grad_fn
    assert node is not None
    assert pt.node_sequence_nr(node.next_functions[0][0]) == ACCUMULATE_GRAD_SEQUENCE  # AccumulateGrad


def _op_schema() -> None:
    add, add_, add_out = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor, torch.ops.aten.add.out
    assert pt.op_schema(add).name == "aten::add" and pt.op_schema(add).returns[0].alias_info is None
    assert pt.op_schema(add_).returns[0].alias_info is not None
    assert any(arg.is_out for arg in pt.op_schema(add_out).arguments)
    assert [str(arg.type) for arg in pt.op_schema(add).arguments][:2] == ["Tensor", "Tensor"]
    assert pt.op_schema("UntypedStorage.resize_") is None


def _op_kernel() -> None:
    kernel = pt.op_kernel(torch.ops.aten.add.Tensor)
    assert kernel is not torch.ops.aten.add.Tensor
    assert kernel(torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]


def _dynamo_wrapper_off() -> None:
    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))

    plain = type("Plain", (pt.TorchDispatchMode,), {"__torch_dispatch__": dispatch})
    ours = type("Ours", (pt.DynamoWrapperOff, pt.TorchDispatchMode), {"__torch_dispatch__": dispatch})
    assert plain.__dict__["__torch_dispatch__"] is not dispatch  # torch wraps it unless told not to
    assert ours.__dict__["__torch_dispatch__"] is dispatch


def _dynamo() -> None:
    added = torch.optim.Optimizer.add_param_group  # what an optimizer's constructor calls
    assert added.__code__.co_filename.endswith("_compile.py")  # torch._disable_dynamo's wrapper
    assert importlib.import_module(pt.DYNAMO).__name__ == pt.DYNAMO


def _hide_from_dynamo() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def backend(graph: Any, inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    graphs: list[Any] = []
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))  # what the backend sees of a function
    pt.hide_from_dynamo(function)
    assert torch.compile(function, backend=backend)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert len(graphs) == 1  # the hidden function ran uncompiled
    assert function._torchdynamo_disable is True  # type: ignore[attr-defined]


def _compile_stance_owner() -> None:
    import torch._dynamo  # loaded by the first torch.compile

    found = pt.compile_stance_owner()
    assert found is not None
    owner, name = found
    pick = getattr(owner, name)
    assert pick("a callback") == "a callback" and pick(None) is None  # the default stance keeps the callback
    with torch.compiler.set_stance("force_eager"):
        assert pick("a callback") is None


def _inductor_partition_backend() -> None:
    # Inductor's min-cut saves, beside the input and the second weight, Linear's output for GELU's backward
    # and GELU's for the second weight's gradient (it recomputes neither): the forward graph's saved tensors
    shapes: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend=pt.inductor_partition_backend())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = compiled(x)
    assert torch.allclose(out, model(x), atol=1e-6)
    assert sorted(shapes) == [(4, 8), (4, 16), (4, 16), (8, 16)]


def _composite_ops_decomposed_on_meta() -> None:
    # nll_loss decomposes on every device, and torch gives it a Python meta kernel besides: aside in the block
    meta = torch._C.DispatchKey.Meta
    nll_loss = torch.ops.aten.nll_loss.default
    assert meta in nll_loss.py_kernels
    with pt.composite_ops_decomposed_on_meta():
        assert meta not in nll_loss.py_kernels
    assert meta in nll_loss.py_kernels


def _dynamo_callback() -> None:
    graphs: list[Any] = []

    def backend(graph: Any, inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    def breaks(x: torch.Tensor) -> torch.Tensor:
        return x * 3 if x.sum() > 0 else x  # a data-dependent branch: a graph break

    found = pt.compile_stance_owner()
    assert found is not None
    owner, name = found
    original = getattr(owner, name)
    setattr(owner, name, lambda chosen: chosen and pt.dynamo_callback(backend, chosen))
    try:
        assert torch.compile(lambda x: x * 3)(torch.ones(2)).tolist() == [3.0, 3.0]
        with pytest.raises(torch._dynamo.exc.Unsupported):  # made as fullgraph's callback: the break raises
            torch.compile(breaks, fullgraph=True)(torch.ones(2))
        assert torch.compile(breaks)(torch.ones(2)).tolist() == [3.0, 3.0]
    finally:
        setattr(owner, name, original)
    assert len(graphs) >= 2  # compiled by the callback's backend, not Inductor


def _dynamo_compiler() -> None:
    chosen: list[Any] = []
    found = pt.compile_stance_owner()
    assert found is not None
    owner, name = found
    original = getattr(owner, name)
    setattr(owner, name, lambda callback: chosen.append(pt.dynamo_compiler(callback)))  # None: nothing compiles

    def counted(graph: Any, inputs: Any) -> Any:
        return graph.forward

    try:
        for options in ({}, {"mode": "reduce-overhead"}, {"backend": "eager"}, {"backend": counted}):
            torch.compile(lambda x: x * 3, **options)(torch.ones(2))
    finally:
        setattr(owner, name, original)
    assert chosen == [("inductor", {}), ("inductor", {"triton.cudagraphs": True}), ("eager", None), ("counted", None)]


def _inductor_allocator_owner() -> None:
    owner, prefix = pt.inductor_allocator_owner()
    made = getattr(owner, prefix + "empty_strided_cpu")((2, 3), (3, 1), torch.float32)
    assert (made.shape, made.device.type) == ((2, 3), "cpu")


def _loaded_inductor_modules() -> None:
    from torch._inductor.codecache import PyCodeCache

    assert hasattr(PyCodeCache, "modules") and isinstance(list(pt.loaded_inductor_modules()), list)


def _cuda_autocast_key() -> None:
    before = pt.cuda_autocast_key_included()
    pt.include_cuda_autocast_key(True)
    try:
        assert pt.cuda_autocast_key_included()
        with pt.without_cuda_autocast():
            assert torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutocastCUDA)
    finally:
        pt.include_cuda_autocast_key(before)
    assert pt.cuda_autocast_key_included() is before


def _registered_at() -> None:
    assert "aten::mm" in pt.ops_with_cuda_autocast() and "aten::relu" not in pt.ops_with_cuda_autocast()
    assert str(pt.registered_at("aten::mm")).rpartition(":")[0].endswith("autocast_mode.cpp")
    assert pt.registered_at("aten::relu") is None


def _destroy_library() -> None:
    library = torch.library.Library("gpumem_private_torch_check", "FRAGMENT")  # type: ignore[no-untyped-call]
    library.define("f(Tensor x) -> Tensor")  # type: ignore[no-untyped-call]
    assert "gpumem_private_torch_check::f" in torch._C._dispatch_get_all_op_names()
    pt.destroy_library(library)
    assert "gpumem_private_torch_check::f" not in torch._C._dispatch_get_all_op_names()


def _checkpoint_autocast_state() -> None:
    owner, name = pt.checkpoint_autocast_state()
    device_state, cpu_state = getattr(owner, name)("cuda")
    assert {"enabled", "dtype", "cache_enabled"} <= device_state.keys() & cpu_state.keys()


def _checkpoint_device_type() -> None:
    owner, name = pt.checkpoint_device_type()
    assert getattr(owner, name)(torch.ones(1, device="meta")) == "meta"


def _scaler_step() -> None:
    owner, name = pt.scaler_step()
    assert list(inspect.signature(getattr(owner, name)).parameters)[:3] == ["self", "optimizer", "optimizer_state"]


def _amp_availability() -> None:
    owner, name = pt.amp_availability()
    assert getattr(owner, name)() is (not torch.cuda.is_available())


def _jit_trace_module() -> None:
    module = pt.jit_trace_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the installed torch deprecates the tracer
        traced = module.trace(lambda x: x * 2, torch.ones(1))
    assert traced(torch.ones(1)).tolist() == [2.0] and callable(module.trace_module)


def _module_apply() -> None:
    owner, name = pt.module_apply()
    seen: list[tuple[int, ...]] = []

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(tensor.shape))
        return tensor

    getattr(owner, name)(torch.nn.Linear(1, 1), convert)
    assert seen == [(1, 1), (1,)]  # the weight, then the bias


def _pytree_map() -> None:
    doubled = pt.pytree_map(lambda leaf: leaf * 2, {"step": torch.tensor(1.0), "buffers": [torch.ones(2)]})
    assert doubled["step"].item() == 2.0 and doubled["buffers"][0].tolist() == [2.0, 2.0]


def _function_mode_stack() -> None:
    class Mode(torch.overrides.TorchFunctionMode):
        pass

    mode = Mode()
    mode.__enter__()  # type: ignore[no-untyped-call]
    try:
        assert pt.function_mode_stack()[-1] is mode
        assert pt.pop_function_mode() is mode and mode not in pt.function_mode_stack()
    finally:
        torch._C._push_on_torch_function_stack(mode)  # back, so that its own exit pops it
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    assert mode not in pt.function_mode_stack()


def _dropout_base() -> None:
    modules = (torch.nn.Dropout(), torch.nn.Dropout2d(), torch.nn.AlphaDropout(), torch.nn.FeatureAlphaDropout())
    assert all(isinstance(module, pt.dropout_base()) for module in modules)
    assert not isinstance(torch.nn.Linear(1, 1), pt.dropout_base())


def _takes_foreach() -> None:
    assert pt.takes_foreach([torch.ones(1, device="meta")]) is False  # neither has foreach kernels listed
    assert pt.takes_foreach([torch.ones(1)]) is False
    owner, name = pt.foreach_devices()
    listed = getattr(owner, name)
    setattr(owner, name, lambda: ["cpu"])
    try:
        assert pt.takes_foreach([torch.ones(1)]) is True  # the default follows the devices' list
    finally:
        setattr(owner, name, listed)


def _fake_store() -> None:
    import torch.distributed as dist

    assert isinstance(pt.fake_store(), dist.Store)  # type: ignore[attr-defined]


def _foreach_devices() -> None:
    owner, name = pt.foreach_devices()
    assert "cuda" in getattr(owner, name)()


def _engine_entry() -> None:
    owner, name = pt.engine_entry()
    original, calls = getattr(owner, name), []
    assert getattr(torch.autograd, name) is original  # the copy `backward` and `grad` call, patched too

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(torch.autograd, name, counted)
    try:
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()  # type: ignore[no-untyped-call]
        torch.autograd.grad((x * 2).sum(), x)
    finally:
        setattr(torch.autograd, name, original)
    assert calls == [1, 1]


def _functorch_transforms_active() -> None:
    seen: list[bool] = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        seen.append(pt.functorch_transforms_active())
        return x.sum()

    torch.func.grad(loss)(torch.ones(2))
    assert seen == [True] and not pt.functorch_transforms_active()


def _compiled_autograd_enabled() -> None:
    import torch._dynamo.compiled_autograd as compiled

    assert compiled.compiled_autograd_enabled is False and pt.compiled_autograd_enabled() is False


def _clear_cublas_workspaces() -> None:
    built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]
    assert hasattr(torch._C, "_cuda_clearCublasWorkspaces") is built
    pt.clear_cublas_workspaces()


def _record_memory_history() -> None:
    from torch.cuda.memory import _record_memory_history

    assert {"max_entries", "stacks", "context"} <= inspect.signature(_record_memory_history).parameters.keys()


def _memory_snapshot() -> None:
    from torch.cuda.memory import _snapshot

    assert callable(_snapshot)


CHECKS: dict[str, Callable[[], bool | None]] = {
    "storage_key": _storage_key,
    "tensor_key": _tensor_key,
    "SPARSE_COO_PARTS": _sparse_coo_parts,
    "SAVED_VARIABLE_PREFIX": _saved_variable_prefix,
    "storage_use_count": _storage_use_count,
    "tensor_use_count": _tensor_use_count,
    "is_view": lambda: pt.is_view(torch.ones(2)[1:]) and not pt.is_view(torch.ones(2)),
    "is_zero_tensor": _is_zero_tensor,
    "graph_task_reader": lambda: pt.graph_task_reader()() == -1 != _in_backward(pt.graph_task_reader()),
    "in_backward": lambda: not pt.in_backward() and _in_backward(pt.in_backward) is True,
    "current_autograd_node": lambda: (
        pt.current_autograd_node() is None and _in_backward(lambda: pt.current_autograd_node() is not None) is True
    ),
    "next_sequence_nr": _next_sequence_nr,
    "node_sequence_nr": _node_sequence_nr,
    "functorch_transforms_active": _functorch_transforms_active,
    "compiled_autograd_enabled": _compiled_autograd_enabled,
    "engine_entry": _engine_entry,
    "op_schema": _op_schema,
    "op_kernel": _op_kernel,
    "sdpa_function": lambda: pt.sdpa_function() is F.scaled_dot_product_attention,
    "TorchDispatchMode": lambda: pt.TorchDispatchMode is pt.dispatch_mode_class(),
    "dispatch_mode_class": lambda: issubclass(_Mode, pt.dispatch_mode_class()),
    "fake_tensor_class": lambda: isinstance(FakeTensorMode().from_tensor(torch.ones(1)), pt.fake_tensor_class()),
    "wrapper_subclass_test": lambda: (
        pt.wrapper_subclass_test()(TwoTensor(torch.ones(1), torch.ones(1)))  # type: ignore[no-untyped-call]
        and not pt.wrapper_subclass_test()(torch.ones(1))
    ),
    "dispatch_mode_stack": _dispatch_mode_stack,
    "current_dispatch_mode": _dispatch_mode_stack,
    "dispatch_mode_stepped_aside": _dispatch_mode_stack,
    "no_dispatch_modes": _dispatch_mode_stack,
    "pop_dispatch_mode": _pop_dispatch_mode,
    "pytree_leaves": lambda: pt.pytree_leaves({"a": (1, [2])}) == [1, 2],
    "eval_frame_setter": lambda: callable(pt.eval_frame_setter()),
    "DYNAMO": _dynamo,
    "hide_from_dynamo": _hide_from_dynamo,
    "DynamoWrapperOff": _dynamo_wrapper_off,
    "compile_stance_owner": _compile_stance_owner,
    "inductor_partition_backend": _inductor_partition_backend,
    "dynamo_callback": _dynamo_callback,
    "dynamo_compiler": _dynamo_compiler,
    "DYNAMO_FRAMES": lambda: torch._dynamo.eval_frame.__name__ == pt.DYNAMO_FRAMES,
    "composite_ops_decomposed_on_meta": _composite_ops_decomposed_on_meta,
    "inductor_allocator_owner": _inductor_allocator_owner,
    "loaded_inductor_modules": _loaded_inductor_modules,
    "without_cuda_autocast": _cuda_autocast_key,
    "cuda_autocast_key_included": _cuda_autocast_key,
    "include_cuda_autocast_key": _cuda_autocast_key,
    "ops_with_cuda_autocast": _registered_at,
    "registered_at": _registered_at,
    "destroy_library": _destroy_library,
    "checkpoint_autocast_state": _checkpoint_autocast_state,
    "checkpoint_device_type": _checkpoint_device_type,
    "scaler_step": _scaler_step,
    "amp_availability": _amp_availability,
    "jit_trace_module": _jit_trace_module,
    "foreach_devices": _foreach_devices,
    "pytree_map": _pytree_map,
    "function_mode_stack": _function_mode_stack,
    "pop_function_mode": _function_mode_stack,
    "dropout_base": _dropout_base,
    "takes_foreach": _takes_foreach,
    "fake_store": _fake_store,
    "module_apply": _module_apply,
    "clear_cublas_workspaces": _clear_cublas_workspaces,
    "record_memory_history": _record_memory_history,
    "memory_snapshot": _memory_snapshot,
}
"""Each name the module offers, and a check of what the package assumes of the private torch behind it."""


def test_every_name_of_the_module_has_a_check() -> None:
    assert _offered() | {"TorchDispatchMode"} == set(CHECKS)  # the base class comes through `__getattr__`


def _offered() -> set[str]:
    """The public names the module defines at its top level."""
    tree = ast.parse(Path(pt.__file__).read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_private_name_behaves_as_assumed_on_the_installed_torch(name: str) -> None:
    assert CHECKS[name]() is not False
