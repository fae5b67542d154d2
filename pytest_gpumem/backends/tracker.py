"""The tracker: exact bytes of the tensor storages that ATen ops create, for machines without a GPU.

A `TorchDispatchMode` sees every op below autograd, those run by backward, checkpoint recomputation and
autocast casts included. Each output whose schema says it is fresh (not an alias of an input) brings a
new storage: its bytes are added, and subtracted when a weak reference to the storage dies.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.base import Counters
from pytest_gpumem.constants import ROUNDINGS
from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.attribution import Attributor
    from pytest_gpumem.backends.recording import Origin, Recorder, Survivor
    from pytest_gpumem.backends.tracker_hooks import Patches


_KIB = 1024
_MIB = 1024 * 1024
_SMALL_REQUEST = _MIB  # the CUDA allocator's small-pool limit (kSmallSize)
_LARGE_SEGMENT_LIMIT = 10 * _MIB  # below this, large requests come from 20 MiB segments
_SEGMENT_ROUND = 2 * _MIB


def cuda_block_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request served by a fresh segment.

    Requests round up to 512 bytes. Small ones (<= 1 MiB) and those under 10 MiB are split off larger
    segments, so they count as rounded. From 10 MiB a segment of the request rounded up to 2 MiB is
    made, and it is split only if more than 1 MiB would remain; otherwise the whole segment counts.
    """
    if nbytes == 0:
        return 0
    rounded = -(-nbytes // 512) * 512
    if rounded <= _SMALL_REQUEST or rounded < _LARGE_SEGMENT_LIMIT:
        return rounded
    segment = -(-rounded // _SEGMENT_ROUND) * _SEGMENT_ROUND
    return rounded if segment - rounded > _SMALL_REQUEST else segment


def _exact(nbytes: int) -> int:
    return nbytes


_ROUNDERS: dict[str, Callable[[int], int]] = {"none": _exact, "cuda": cuda_block_size}


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a live storage, carrying the bytes it was counted with."""

    __slots__ = ("base", "counted", "key", "origin", "requested")

    key: int
    requested: int
    counted: int
    base: int  # bytes the storage had before tracking began (made earlier, then grown by an op)
    origin: Origin | None


class StorageLedger:
    """Live storages with their requested and counted bytes, and the counters over them.

    Hot path (every op output): one dict lookup, one weak reference with a shared callback.
    """

    def __init__(self, rounding: str) -> None:
        self.round = _ROUNDERS[rounding]
        self.exact = rounding == "none"
        self.live: dict[int, _StorageRef] = {}
        self.requested = 0
        self.allocated = 0
        self.peak_requested = 0
        self.peak_allocated = 0
        self.fake_outputs = 0  # outputs of ops under FakeTensorMode, which hold no memory
        self.capacity: int | None = None  # allocated bytes past which an allocation raises OutOfMemoryError
        self.recorder: Recorder | None = None  # origins (and events) of the storages, when asked for
        self.op: object = None  # the op being dispatched and its outputs, read only by the recorder
        self.out: object = None
        self._on_free = self._freed  # one bound method shared by every reference

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.live:
            self.resize(storage)
            return
        requested = storage.nbytes()
        self._follow(storage, key, requested)

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """`storage` was resized outside any op (`UntypedStorage.resize_`): follow it like an op's resize."""
        if storage._cdata in self.live:
            self.resize(storage)
        elif storage.nbytes() > before:
            self.grow_existing(storage, before)

    def grow_existing(self, storage: torch.UntypedStorage, before: int) -> None:
        """A storage made before tracking was resized by an op: count the growth as an allocation."""
        key = storage._cdata
        if key in self.live:
            self.resize(storage)
            return
        requested = storage.nbytes() - before
        if requested > 0:
            self._follow(storage, key, requested, base=before)

    def resize(self, storage: torch.UntypedStorage) -> None:
        ref = self.live[storage._cdata]
        requested = max(storage.nbytes() - ref.base, 0)
        if requested == ref.requested:
            return
        counted = requested if self.exact else self.round(requested)
        self._check_capacity(counted - ref.counted)
        self.requested += requested - ref.requested
        self.allocated += counted - ref.counted
        ref.requested, ref.counted = requested, counted
        if self.recorder is not None:
            self.recorder.event("resize", ref, self.allocated)
        self._update_peaks()

    def forget(self) -> None:
        """Stop following every storage (their frees will no longer change the counters)."""
        self.live.clear()
        self.requested = self.allocated = self.peak_requested = self.peak_allocated = self.fake_outputs = 0

    def _follow(self, storage: torch.UntypedStorage, key: int, requested: int, base: int = 0) -> None:
        counted = requested if self.exact else self.round(requested)
        self._check_capacity(counted)
        ref = _StorageRef(storage, self._on_free)
        ref.key, ref.requested, ref.counted, ref.base, ref.origin = key, requested, counted, base, None
        self.live[key] = ref
        self.requested += requested
        self.allocated += counted
        if self.recorder is not None:
            self.recorder.allocated(self.op, self.out, ref, self.allocated)
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _update_peaks(self) -> None:
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _freed(self, ref: weakref.ref[Any]) -> None:
        assert isinstance(ref, _StorageRef)
        # A storage key is reused once freed: only the reference that is still recorded counts.
        if self.live.get(ref.key) is ref:
            del self.live[ref.key]
            self.requested -= ref.requested
            self.allocated -= ref.counted
            if self.recorder is not None:
                self.recorder.event("free", ref, self.allocated)

    def _check_capacity(self, growth: int) -> None:
        if self.capacity is not None and growth > 0 and self.allocated + growth > self.capacity:
            import torch

            raise torch.OutOfMemoryError(
                f"tracker: out of memory: tried to allocate {format_size(growth)} with {format_size(self.allocated)} "
                f"of the capacity {format_size(self.capacity)} already allocated"
            )


def _tensors(out: object, tensor_type: type[torch.Tensor]) -> Iterator[torch.Tensor]:
    if isinstance(out, tensor_type):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item, tensor_type)


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


def _op_plan(func: Any) -> tuple[int, tuple[int, ...] | None]:
    """(kind, positions of the fresh returns) for an op overload; for _MANY, None means the one return
    (a list, an optional tensor) is walked whole."""
    schema = func._schema
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
    import torch

    numbers = [
        i
        for i, (arg, value) in enumerate(zip(func._schema.arguments, args, strict=False))
        if isinstance(value, (bool, int, float, complex)) and str(arg.type) == "Tensor"
    ]
    if not numbers:
        return None
    return tuple(torch.tensor(value) if i in numbers else value for i, value in enumerate(args))


def _sparse_parts() -> dict[Any, tuple[str, ...]]:
    """The component tensors that hold a sparse tensor's memory, by layout."""
    import torch

    compressed_rows = ("crow_indices", "col_indices", "values")
    compressed_cols = ("ccol_indices", "row_indices", "values")
    return {
        torch.sparse_coo: ("_indices", "_values"),
        torch.sparse_csr: compressed_rows,
        torch.sparse_bsr: compressed_rows,
        torch.sparse_csc: compressed_cols,
        torch.sparse_bsc: compressed_cols,
    }


def _dynamo_guard() -> Callable[[Any], Any] | None:
    """`set_eval_frame`, to keep TorchDynamo out of the mode's frames more cheaply than the wrapper that
    `TorchDispatchMode` otherwise adds (two extra Python frames per op); None where torch lacks it."""
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    if not callable(set_eval_frame) or not callable(skip_code):
        return None
    return set_eval_frame


def _hide_from_dynamo(dispatch: Any) -> None:
    """What `torch._disable_dynamo` gives a function, without its wrapper: Dynamo neither compiles the
    frame (`skip_code`) nor inlines it when tracing a compiled function under the mode (the flag)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(dispatch.__code__)
    dispatch._torchdynamo_disable = True


@functools.cache
def _make_mode_class() -> type[Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensor as fake_type
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

    tensor_type = torch.Tensor
    sparse_parts = _sparse_parts()
    set_eval_frame = _dynamo_guard()
    plans: dict[Any, tuple[int, tuple[int, ...] | None]] = {}

    def storages(out: object) -> Iterator[Any]:
        """The storages holding the memory of the tensors in `out`; before the parts of a sparse
        tensor, `_NOT_DENSE`; for a fake tensor, `_FAKE`."""
        for tensor in _tensors(out, tensor_type):
            parts = sparse_parts.get(tensor.layout)
            if isinstance(tensor, fake_type):
                yield _FAKE
            elif parts is not None:
                yield _NOT_DENSE
                yield from storages([getattr(tensor, part)() for part in parts])
            elif type(tensor) is not tensor_type and is_traceable_wrapper_subclass(tensor):
                # a wrapper's own storage is nominal; its inner tensors hold the memory
                attrs, _ = tensor.__tensor_flatten__()
                yield from storages([getattr(tensor, attr) for attr in attrs])
            else:
                storage = _storage(tensor)
                if storage is not None:
                    yield storage

    def input_keys(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> set[int]:
        found = storages([*args, *(kwargs or {}).values()])
        return {s._cdata for s in found if s is not _NOT_DENSE and s is not _FAKE}

    class StorageTrackingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self, ledger: StorageLedger) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.ledger = ledger

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # Dynamo compiles under the mode (instead of falling back to eager), with the mode off
            # while compiling and on while the compiled program runs (its allocators are wrapped).
            return True

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # True makes TorchDispatchMode wrap __torch_dispatch__ in torch._disable_dynamo; the
            # guard below does the same (no eval-frame callback inside the mode) for less.
            return set_eval_frame is None

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            __tracebackhide__ = True  # a user's error in an op shows the user's frames, not ours
            prior = None if set_eval_frame is None else set_eval_frame(None)
            try:
                return self._dispatch(func, args, kwargs)
            except RuntimeError:
                numbers = _rewrapped_numbers(func, args)
                if numbers is None:
                    raise
                return self._dispatch(func, numbers, kwargs)
            finally:
                self.ledger.out = None  # the recorder's view of the outputs must not keep them alive
                if set_eval_frame is not None:
                    set_eval_frame(prior)

        def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
            __tracebackhide__ = True
            recorder = self.ledger.recorder
            if recorder is not None:
                self.ledger.op = func
                recorder.entered()
            plan = plans.get(func)
            if plan is None:
                plan = plans[func] = _op_plan(func)
            kind = plan[0]
            if kind == _PASS:
                return func(*args, **kwargs) if kwargs else func(*args)
            if kind == _RESIZE:
                return self._dispatch_resizing(func, args, kwargs or {})
            if kind == _LIFT:
                return self._dispatch_lifting(func, args, kwargs or {})
            out = func(*args, **kwargs) if kwargs else func(*args)
            if recorder is not None:
                self.ledger.out = out
            if kind == _SINGLE and type(out) is tensor_type:
                try:
                    storage = out.untyped_storage()
                except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
                    self._count(out, args, kwargs)
                    return out
                self.ledger.add(storage)
                return out
            positions = plan[1]
            fresh = out if positions is None or kind == _SINGLE else [out[i] for i in positions]
            self._count(fresh, args, kwargs, checked=kind == _CHECKED)
            return out

        def _count(
            self, out: object, args: tuple[Any, ...], kwargs: dict[str, Any] | None, checked: bool = False
        ) -> None:
            """Count the storages of `out`; `checked` (or a sparse output) leaves out the inputs' own."""
            inputs = input_keys(args, kwargs) if checked else None
            for storage in storages(out):
                if storage is _NOT_DENSE:  # a sparse tensor's parts may be tensors it was given
                    if inputs is None:
                        inputs = input_keys(args, kwargs)
                elif storage is _FAKE:
                    self.ledger.fake_outputs += 1
                elif inputs is None or storage._cdata not in inputs:
                    self.ledger.add(storage)

        def _dispatch_lifting(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            __tracebackhide__ = True
            out = self.ledger.out = func(*args, **kwargs)
            storage = _storage(out) if isinstance(out, tensor_type) else None
            # torch.tensor(data) fills a new, resizable storage; torch.as_tensor/from_numpy share
            # memory torch did not allocate (not resizable)
            if storage is not None and storage.resizable():
                self.ledger.add(storage)
            return out

        def _dispatch_resizing(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            __tracebackhide__ = True
            before: dict[int, int] = {}
            for tensor in _tensors([*args, *kwargs.values()], tensor_type):
                storage = _storage(tensor)
                if storage is not None:
                    before[storage._cdata] = storage.nbytes()
            out = self.ledger.out = func(*args, **kwargs)
            for tensor in _tensors(out, tensor_type):
                storage = _storage(tensor)
                if storage is None:
                    continue
                previous = before.get(storage._cdata)
                if previous is None:
                    self.ledger.add(storage)
                else:
                    self.ledger.grow_existing(storage, previous)
            return out

    if set_eval_frame is not None:
        _hide_from_dynamo(StorageTrackingMode.__torch_dispatch__)
    from pytest_gpumem.backends.tracker_hooks import count_compiled_allocations

    count_compiled_allocations(StorageTrackingMode)
    return StorageTrackingMode


class TrackerBackend:
    """Counts tensor storages on any device; `rounding="cuda"` predicts the CUDA allocator's counts."""

    name = "tracker"
    sees_earlier_allocations = False

    def __init__(self, rounding: str = "none", device: str = "cpu") -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if device not in ("cpu", "meta"):
            raise ValueError(f"device must be cpu or meta, got {device!r}")
        self.rounding = rounding
        self._device_type = device
        _make_mode_class()  # its imports (torch._dynamo) happen now, not inside the first test's call
        self.ledger = StorageLedger(rounding)
        self._mode: Any = None
        self._patches: Patches | None = None
        self._notes: list[str] = []

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self._device_type)

    def identity(self) -> dict[str, Any]:
        """What baselines are keyed by: rounding changes every figure, so it is part of the backend, and
        a meta run is a prediction that never mixes with measured figures."""
        settings = [s for s in ("meta" if self._device_type == "meta" else "", self._rounding_text()) if s]
        backend = "tracker" if not settings else f"tracker ({', '.join(settings)})"
        return {"backend": backend, "device": self._device_type}

    def _rounding_text(self) -> str:
        return "" if self.rounding == "none" else f"round {self.rounding}"

    def describe(self) -> str:
        device = "meta (a prediction: sizes without data, nothing computed)" if self._device_type == "meta" else "cpu"
        line = f"tracker (storages created by ATen ops, rounding {self.rounding}), device {device}"
        if self.rounding == "cuda":
            line += "; optimizers take foreach by default, as on CUDA"
        return line

    def start(self) -> None:
        from pytest_gpumem.backends.tracker_hooks import Patches

        mode_class = _make_mode_class()
        self.ledger.forget()
        self._notes = []
        self._patches = Patches(mode_class, self._notes)
        self._patches.install(predict_cuda=self.rounding == "cuda")
        self._mode = mode_class(self.ledger)
        attribution = self.attribution()
        try:
            if attribution is not None:
                attribution.install()
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            if attribution is not None:
                attribution.remove()
            self._patches.undo()
            raise

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                _leave(mode)
        finally:
            attribution = self.attribution()
            if attribution is not None:
                attribution.remove()
            if self._patches is not None:
                self._patches.undo()
            if self.ledger.fake_outputs:
                self._notes.append(
                    f"{self.ledger.fake_outputs} op outputs were fake tensors (FakeTensorMode): they hold no memory "
                    "and were not counted; the figures are what the test's real tensors used"
                )
            self.ledger.forget()
            self.ledger.recorder = None  # its events were read before the stop

    def notes(self) -> list[str]:
        """What the last measurement could not see, one sentence each."""
        return list(self._notes)

    def configure(self, capacity: int | None, origins: bool, events: bool, explain: bool = False) -> None:
        """For the next measurement: a device of `capacity` bytes (None: unlimited); record where each
        storage came from (`origins`), the sequence of allocations and frees (`events`), and what each
        storage is for and which module made it (`explain`)."""
        from pytest_gpumem.backends.attribution import Attributor
        from pytest_gpumem.backends.recording import Recorder

        self.ledger.capacity = capacity
        if explain:
            self.ledger.recorder = Attributor(self.ledger.live, events)
        else:
            self.ledger.recorder = Recorder(events) if origins or events else None

    def attribution(self) -> Attributor | None:
        """The attributor of the measurement under way, when it explains its peaks."""
        from pytest_gpumem.backends.attribution import Attributor

        recorder = self.ledger.recorder
        return recorder if isinstance(recorder, Attributor) else None

    def survivors(self, count: int) -> list[Survivor]:
        """The largest storages the call made that are still allocated, with what they hold."""
        from pytest_gpumem.backends.recording import Survivor, tensors_by_storage

        refs = sorted(self.ledger.live.values(), key=lambda ref: ref.counted, reverse=True)[:count]
        tensors = tensors_by_storage({ref.key for ref in refs})
        found = []
        for ref in refs:
            tensor = tensors.get(ref.key)
            shape = None if tensor is None else tuple(tensor.shape)
            dtype = None if tensor is None else str(tensor.dtype).removeprefix("torch.")
            device = None if tensor is None else str(tensor.device)
            found.append(Survivor(ref.counted, shape, dtype, device, ref.origin))
        return found

    def trace(self) -> dict[str, Any] | None:
        """The allocations and frees of the measurement, when events were recorded."""
        recorder = self.ledger.recorder
        return None if recorder is None or recorder.events is None else recorder.trace()

    def settle(self) -> None:
        return None

    def current(self) -> Counters:
        return Counters(self.ledger.allocated, self.ledger.requested)

    def peak(self) -> Counters:
        return Counters(self.ledger.peak_allocated, self.ledger.peak_requested)

    def reset_peak(self) -> None:
        self.ledger.peak_allocated = self.ledger.allocated
        self.ledger.peak_requested = self.ledger.requested


def _leave(mode: Any) -> None:
    """Take the tracker's mode off this thread's dispatch stack, also when the test left modes of its
    own above it (they are taken off too: they were entered inside the measured call)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    stack = _get_current_dispatch_mode_stack()
    if mode not in stack:
        return
    while _get_current_dispatch_mode_stack()[-1] is not mode:
        _pop_mode()
    mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
