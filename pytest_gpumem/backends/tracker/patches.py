"""What the tracker's dispatch mode does not see by itself, and how it is told.

- Compiled programs (TorchInductor) allocate their buffers through functions that bypass the dispatcher
  (`empty_strided_cpu` and its siblings, bound when a generated module loads): wrapped once per process.
- `UntypedStorage.resize_` is a storage method, not an ATen op (FSDP2 frees and regrows parameters so).
- `torch.jit.trace` cannot trace under any dispatch mode: the tracker steps aside and says so.
- A GPU's code paths (`gpu_paths`): foreach optimizers, and on meta the fused attention kernels.
- `torch.cuda.empty_cache()` gives back the model's free segments, where the ledger models the CUDA
  allocator (on a machine without CUDA it does nothing by itself).
- Threads started inside the call run without the mode: they are noticed and reported (but for the
  compiler's own worker threads).
- Where a card is predicted, compiled functions are split as Inductor splits them and run unfused
  (`unfused_compiled`): an upper bound of a card's plan, which the CPU's Inductor is not, and which runs
  on meta (Inductor there counted 4 MiB of a forward where a card holds 20, or failed inside torch).

Everything but the compiled-program allocators is patched only while a measurement runs, and undone
unconditionally by `Patches.undo`.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pytest_gpumem import private_torch
from pytest_gpumem.backends.tracker.allocator_state import COPY_THREAD
from pytest_gpumem.backends.tracker.ledger import StorageLedger

if TYPE_CHECKING:
    import torch

_INDUCTOR_ALLOCATORS = ("empty_strided_cpu", "empty_strided_cpu_pinned", "empty_strided_cuda", "empty_strided_xpu")
_JIT_TRACERS = ("trace", "trace_module")
_FOREACH_DEVICES_ADDED = ["cpu", "meta"]


def _active_ledger(mode_class: type[Any]) -> StorageLedger | None:
    """The ledger of the tracker's mode if it is on this thread's dispatch mode stack."""
    for mode in private_torch.dispatch_mode_stack():
        if isinstance(mode, mode_class):
            ledger: StorageLedger = mode.ledger
            return ledger
    return None


def count_compiled_allocations(mode_class: type[Any]) -> None:
    """Wrap Inductor's direct allocators so that buffers of compiled programs are counted (once per
    process; generated modules loaded earlier are rebound)."""
    guards, prefix = private_torch.inductor_allocator_owner()
    wrapped: dict[Any, Any] = {}
    for name in _INDUCTOR_ALLOCATORS:
        original = getattr(guards, prefix + name, None)
        if original is None or hasattr(original, "__wrapped__"):
            continue
        counting = _counting_allocator(original, mode_class)
        setattr(guards, prefix + name, counting)
        wrapped[original] = counting
    if not wrapped:
        return
    for module in private_torch.loaded_inductor_modules():
        for name in _INDUCTOR_ALLOCATORS:
            current = getattr(module, name, None)
            if current in wrapped:
                setattr(module, name, wrapped[current])


def _counting_allocator(original: Callable[..., torch.Tensor], mode_class: type[Any]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def allocate(*args: Any) -> torch.Tensor:
        out = original(*args)
        ledger = _active_ledger(mode_class)
        if ledger is not None:
            ledger.op, ledger.out = "a compiled program's buffer", out
            ledger.compiled_buffers += 1
            try:
                ledger.add(out.untyped_storage())
            finally:
                ledger.out = None
        return out

    return allocate


_COMPILER_PATHS = (f"torch{os.sep}_inductor{os.sep}", f"torch{os.sep}_dynamo{os.sep}")


def _compiling(thread_id: int) -> bool:
    """Whether the thread is inside torch.compile's compiler (whose worker threads make no tensors)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COMPILER_PATHS):
            return True
        frame = frame.f_back
    return False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module `name` as the path finder does, and calls `then` once it has run."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module as the path finder loads it
        self.loader.exec_module(module)
        self.then()


class Patches:
    """The patches of one measurement, each undone by `undo` whatever happened in between."""

    def __init__(self, mode_class: type[Any], notes: list[str]) -> None:
        self.mode_class = mode_class
        self.notes = notes
        self._undo: list[Callable[[], None]] = []
        self.threads: list[str] = []
        self.compiled_unfused = False  # a compiled function ran as Inductor's partition, unfused
        self.compiled_eagerly = False  # ... or eagerly, where torch's partition on meta lost a gradient
        self.compiled_cuda_graphs = False  # ... where Inductor would have run it as CUDA graphs
        self.compiled_as_chosen: set[str] = set()  # the other compilers, which ran as chosen

    def install(
        self,
        foreach: bool = False,
        fused_attention: bool = False,
        allocator: bool = False,
        meta: bool = False,
        cuda_autocast: str | None = None,
        unfused_compiled: bool = False,
        after_backward: Callable[[Sequence[Any]], None] | None = None,
    ) -> None:
        """The patches every measurement needs, with the GPU's optimizer path (`foreach`) and attention
        kernels (`fused_attention`) where asked, `torch.cuda.empty_cache` where the ledger models the
        CUDA allocator (`allocator`), and compiled functions run as Inductor's partition, unfused
        (`unfused_compiled`), and `after_backward` called with the roots of each run of the autograd engine
        once it returned (an explanation reads what the graph released)."""
        try:
            if unfused_compiled:
                self._unfused_compiled()
            self._backward_as_without_a_mode()
            if after_backward is not None:
                self._after_backward(after_backward)
            self._resize()
            if allocator:
                self._empty_cache()
            self._jit_trace()
            self._threads()
            if foreach:
                self._foreach()
            if fused_attention:
                self._fused_attention()
            if meta:
                self._meta_counts()
            if cuda_autocast is not None:
                self._cuda_autocast(cuda_autocast)
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self.threads:
            names = ", ".join(sorted(set(self.threads)))
            self.notes.append(
                f"threads started inside the call ({names}) run without the tracker: tensors they made are not "
                "counted (the cuda backend sees every thread)"
            )
            self.threads = []

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        if isinstance(owner, type) and name not in owner.__dict__:  # inherited: undo by deleting
            setattr(owner, name, value)
            self._undo.append(lambda: delattr(owner, name))
            return
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def _resize(self) -> None:
        import torch

        original = torch.UntypedStorage.resize_
        mode_class = self.mode_class

        @functools.wraps(original)
        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            before = storage.nbytes()
            result: torch.UntypedStorage = original(storage, size)
            ledger = _active_ledger(mode_class)
            if ledger is not None:
                ledger.op, ledger.out = "UntypedStorage.resize_", None
                ledger.resized(storage, before)
            return result

        self._replace(torch.UntypedStorage, "resize_", resize_)

    def _empty_cache(self) -> None:
        """`torch.cuda.empty_cache` by both its names (also `torch.cuda.memory.empty_cache`): the model's
        free segments are given back, then CUDA's where there is CUDA."""
        import torch
        import torch.cuda.memory

        mode_class = self.mode_class

        def emptying(original: Callable[[], None]) -> Callable[[], None]:
            @functools.wraps(original)
            def empty_cache() -> None:
                ledger = _active_ledger(mode_class)
                if ledger is not None:
                    ledger.empty_cache()
                if torch.cuda.is_available():
                    original()

            return empty_cache

        for owner in (torch.cuda, torch.cuda.memory):
            self._replace(owner, "empty_cache", emptying(owner.empty_cache))

    def _jit_trace(self) -> None:
        import torch.jit

        owners = (private_torch.jit_trace_module(), torch.jit)  # each wrapped: one may be the other's copy
        for name in _JIT_TRACERS:
            for owner in owners:
                original = getattr(owner, name, None)
                if callable(original):
                    self._replace(owner, name, self._stepping_aside(original))

    def _stepping_aside(self, trace: Callable[..., Any]) -> Callable[..., Any]:
        mode_class, notes = self.mode_class, self.notes

        @functools.wraps(trace)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if not isinstance(private_torch.current_dispatch_mode(), mode_class):
                return trace(*args, **kwargs)
            note = f"torch.jit.{trace.__name__} ran unmeasured: the tracer cannot run under a dispatch mode"
            if note not in notes:
                notes.append(note)
            with private_torch.dispatch_mode_stepped_aside():
                return trace(*args, **kwargs)

        return traced

    def _foreach(self) -> None:
        optimizer, name = private_torch.foreach_devices()
        original = getattr(optimizer, name)

        def devices() -> list[str]:
            return [*original(), *_FOREACH_DEVICES_ADDED]

        self._replace(optimizer, name, devices)

    def _fused_attention(self) -> None:
        from pytest_gpumem.backends.tracker.gpu_paths import fused_attention_mode, leave_function_mode

        mode = fused_attention_mode()
        mode.__enter__()
        self._undo.append(lambda: leave_function_mode(mode))
        self._backward_under(mode)

    def _meta_counts(self) -> None:
        """What meta does not count by itself (`meta_counts`): tensors made from data, tied parameters."""

        from pytest_gpumem.backends.tracker.gpu_paths import leave_function_mode
        from pytest_gpumem.backends.tracker.meta_counts import factory_mode_class, keeping_ties

        module, apply = private_torch.module_apply()
        self._replace(module, apply, keeping_ties(getattr(module, apply)))
        mode_class = self.mode_class
        mode = factory_mode_class()(lambda: _active_ledger(mode_class))
        mode.__enter__()
        self._undo.append(lambda: leave_function_mode(mode))

    def _cuda_autocast(self, device_type: str) -> None:
        """CUDA's autocast and GradScaler on `device_type`'s tensors, which stand for the GPU's (`autocast`)."""
        from pytest_gpumem.backends.tracker.autocast import CudaAutocast

        emulation = CudaAutocast(device_type, self.notes)
        self._undo.append(emulation.undo)
        emulation.install(self._replace)

    def _backward_as_without_a_mode(self) -> None:
        """Each run of the autograd engine allocates what it allocates without a dispatch mode (`unmoded`)."""
        from pytest_gpumem.backends.tracker.unmoded import calibrate, hooked

        calibrate(lambda: self.mode_class(StorageLedger("none")))
        self._backward_under(hooked)

    def _after_backward(self, then: Callable[[Sequence[Any]], None]) -> None:
        """`then(roots)` after each run of the autograd engine from `roots` (tensors or gradient edges)."""
        import torch.autograd

        graph, entry = private_torch.engine_entry()
        original = getattr(graph, entry, None)
        if original is None:
            return

        @functools.wraps(original)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # a failing backward shows the test's frames and torch's, as unmeasured
            result = original(*args, **kwargs)
            then(args[0] if args else kwargs.get("t_outputs", ()))
            return result

        self._replace(graph, entry, run_backward)
        if getattr(torch.autograd, entry, None) is original:  # its own name for it, bound at import
            self._replace(torch.autograd, entry, run_backward)

    def _backward_under(self, mode: Any) -> None:
        """Each run of the autograd engine with `mode` on the torch-function stack (see `gpu_paths`), or,
        where `mode` is a function of the engine's roots (tensors or gradient edges), inside the context
        it returns (`unmoded.hooked`)."""
        import torch.autograd
        from torch.overrides import TorchFunctionMode

        from pytest_gpumem.backends.tracker.gpu_paths import on_stack

        graph, entry = private_torch.engine_entry()
        original = getattr(graph, entry, None)
        if original is None:  # torch before 2.4's engine entry: backward runs without the mode
            return
        context = (lambda roots: on_stack(mode)) if isinstance(mode, TorchFunctionMode) else mode

        @functools.wraps(original)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # a failing backward shows the test's frames and torch's, as unmeasured
            with context(args[0] if args else kwargs.get("t_outputs", ())):
                return original(*args, **kwargs)

        self._replace(graph, entry, run_backward)
        if getattr(torch.autograd, entry, None) is original:
            self._replace(torch.autograd, entry, run_backward)

    def _unfused_compiled(self) -> None:
        """Each call of a function compiled by Inductor that would compile or run its frames runs them as
        Inductor's partition, unfused (`compiled`), and is noticed; other compilers, and a stance that runs
        frames as they are, are kept. While Dynamo is not loaded nothing compiled can run: it is patched once
        its frame module loads (importing Dynamo here would cost every measurement a second)."""
        found = private_torch.compile_stance_owner()
        if found is None:
            self._unfused_once_compiled()
            return
        from pytest_gpumem.backends.tracker import compiled

        owner, name = found
        original = getattr(owner, name)

        def eagerly() -> None:
            self.compiled_eagerly = True

        compiled.BACKEND.ran_eagerly = eagerly
        self._undo.append(lambda: setattr(compiled.BACKEND, "ran_eagerly", None))

        def unfused(callback: Any) -> Any:
            chosen = original(callback)
            if chosen is None or chosen is False:
                return chosen
            compiler, inductor = private_torch.dynamo_compiler(chosen)
            if inductor is None:
                self.compiled_as_chosen.add(compiler)
                return chosen
            self.compiled_unfused = True
            self.compiled_cuda_graphs |= bool(inductor.get("triton.cudagraphs"))
            return compiled.callback(chosen)

        self._replace(owner, name, unfused)

    def _unfused_once_compiled(self) -> None:
        """Patched as soon as Dynamo's frame module loads, by whatever path (`from torch import compile`)."""
        finder = _AfterImport(private_torch.DYNAMO_FRAMES, self._unfused_compiled)
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder))

    def _threads(self) -> None:
        previous = threading.getprofile()
        started = self.threads
        measured_thread = threading.get_ident()

        def first_event(frame: Any, event: str, arg: Any) -> None:
            sys.setprofile(previous)
            name = threading.current_thread().name
            if not _compiling(measured_thread) and name != COPY_THREAD:
                started.append(name)

        threading.setprofile(first_event)
        self._undo.append(lambda: threading.setprofile(previous))
