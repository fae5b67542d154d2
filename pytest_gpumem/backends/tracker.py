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

if TYPE_CHECKING:
    import torch

ROUNDINGS = ("none", "cuda")

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


class StorageLedger:
    """Live storages with their requested and counted bytes, and the counters over them."""

    def __init__(self, rounding: str) -> None:
        self.round = _ROUNDERS[rounding]
        self.live: dict[int, tuple[weakref.ref[Any], int, int]] = {}
        self.requested = 0
        self.allocated = 0
        self.peak_requested = 0
        self.peak_allocated = 0

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.live:
            self.resize(storage)
            return
        requested = storage.nbytes()
        counted = self.round(requested)
        self.live[key] = (weakref.ref(storage, self._freed_callback(key)), requested, counted)
        self._grow(requested, counted)

    def grow_existing(self, storage: torch.UntypedStorage, before: int) -> None:
        """A storage made before tracking was resized by an op: count the growth as an allocation."""
        key = storage._cdata
        if key in self.live:
            self.resize(storage)
            return
        requested = storage.nbytes() - before
        if requested <= 0:
            return
        counted = self.round(requested)
        self.live[key] = (weakref.ref(storage, self._freed_callback(key)), requested, counted)
        self._grow(requested, counted)

    def resize(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        ref, old_requested, old_counted = self.live[key]
        requested = storage.nbytes()
        if requested == old_requested:
            return
        counted = self.round(requested)
        self.live[key] = (ref, requested, counted)
        self.requested += requested - old_requested
        self.allocated += counted - old_counted
        self._update_peaks()

    def forget(self) -> None:
        """Stop following every storage (their frees will no longer change the counters)."""
        self.live.clear()
        self.requested = self.allocated = self.peak_requested = self.peak_allocated = 0

    def _grow(self, requested: int, counted: int) -> None:
        self.requested += requested
        self.allocated += counted
        self._update_peaks()

    def _update_peaks(self) -> None:
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _freed_callback(self, key: int) -> Callable[[weakref.ref[Any]], None]:
        def freed(ref: weakref.ref[Any]) -> None:
            entry = self.live.get(key)
            if entry is None or entry[0] is not ref:
                return
            del self.live[key]
            self.requested -= entry[1]
            self.allocated -= entry[2]

        return freed


def _tensors(out: object) -> Iterator[torch.Tensor]:
    import torch

    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
        return None


class _OpKind:
    """What an op's schema says about its outputs, computed once per op."""

    __slots__ = ("fresh", "lifts", "may_resize")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.fresh = all(ret.alias_info is None for ret in schema.returns)
        self.lifts = schema.name in ("aten::lift_fresh",)
        self.may_resize = func._overloadname.startswith("out") or schema.name in (
            "aten::resize_",
            "aten::resize_as_",
            "aten::set_",
        )


@functools.cache
def _make_mode_class() -> type[Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class StorageTrackingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self, ledger: StorageLedger) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.ledger = ledger
            self.kinds: dict[Any, _OpKind] = {}

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kind = self.kinds.get(func)
            if kind is None:
                kind = self.kinds[func] = _OpKind(func)
            if kind.may_resize:
                return self._dispatch_resizing(func, args, kwargs or {})
            out = func(*args, **(kwargs or {}))
            if kind.fresh or kind.lifts:
                for tensor in _tensors(out):
                    storage = _storage(tensor)
                    if storage is not None:
                        self.ledger.add(storage)
            return out

        def _dispatch_resizing(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            before: dict[int, int] = {}
            for tensor in _tensors([*args, *kwargs.values()]):
                storage = _storage(tensor)
                if storage is not None:
                    before[storage._cdata] = storage.nbytes()
            out = func(*args, **kwargs)
            for tensor in _tensors(out):
                storage = _storage(tensor)
                if storage is None:
                    continue
                previous = before.get(storage._cdata)
                if previous is None:
                    self.ledger.add(storage)
                else:
                    self.ledger.grow_existing(storage, previous)
            return out

    return StorageTrackingMode


class TrackerBackend:
    """Counts tensor storages on any device; `rounding="cuda"` predicts the CUDA allocator's counts."""

    name = "tracker"

    def __init__(self, rounding: str = "none") -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.rounding = rounding
        self.ledger = StorageLedger(rounding)
        self._mode: Any = None

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def describe(self) -> str:
        return f"tracker (storages created by ATen ops, rounding {self.rounding}), device cpu"

    def start(self) -> None:
        self.ledger.forget()
        self._mode = _make_mode_class()(self.ledger)
        self._mode.__enter__()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        self.ledger.forget()

    def settle(self) -> None:
        return None

    def current(self) -> Counters:
        return Counters(self.ledger.allocated, self.ledger.requested)

    def peak(self) -> Counters:
        return Counters(self.ledger.peak_allocated, self.ledger.peak_requested)

    def reset_peak(self) -> None:
        self.ledger.peak_allocated = self.ledger.allocated
        self.ledger.peak_requested = self.ledger.requested
