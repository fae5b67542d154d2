"""The tracker's ledger: the live storages with their requested and counted bytes, the counters and peaks
over them, and, with CUDA rounding, the model of the CUDA caching allocator that serves them
(`allocator`): counted bytes are then its blocks, and reserved memory its segments.

A storage's bytes are added when an op makes it and subtracted when a weak reference to it dies. The
ledger knows storages only as objects with a key and a size: it imports no torch, so that the
arithmetic can be used (and tested) without it. With the allocator's model it also holds the cuBLAS
workspaces (`Workspace`): one per handle, allocated at the handle's first matmul and kept until
`clear_workspaces()` (`private_torch.clear_cublas_workspaces()`) or the measurement's end; and, when it
predicts a GPU, the temporaries a kernel allocates and frees inside one op (`transient`, sized by
`kernel_temporaries` for the predicted `card`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from cuda_allocator_model import (
    CUBLAS_WORKSPACE_DEFAULT,
    AllocatorOutOfMemory,
    AllocatorSettings,
    CachingAllocatorModel,
    Card,
    format_size,
)
from pytest_gpumem.backends.timeline import FREED, RESIZED
from pytest_gpumem.private_torch import storage_key

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.timeline import TimelineRecorder
    from pytest_gpumem.backends.tracker.recording import Origin, Recorder

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
"""Counted bytes for requested bytes, by the name of the rounding (`--gpumem-round`)."""


class Storage(Protocol):
    """What the ledger reads of a storage (`torch.UntypedStorage`): its identity (`storage_key`), size and
    device."""

    def nbytes(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


_WORKSPACE_KEYS = itertools.count(-1, -1)  # below every storage's key (an address), never reused


class Workspace:
    """Memory the allocator hands out that no tensor holds, a storage of `size` bytes: a cuBLAS workspace,
    or a kernel's temporary."""

    __slots__ = ("__weakref__", "key", "size")

    def __init__(self, size: int) -> None:
        self.key = next(_WORKSPACE_KEYS)
        self.size = size

    def nbytes(self) -> int:
        return self.size


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

    Hot path (every op output): one dict lookup, one weak reference with a shared callback. Past
    `capacity` counted bytes (with CUDA rounding: reserved bytes, as a card judges it), an allocation
    raises `out_of_memory` (the tracker's: torch's error, carrying the model's as `allocator_error`).
    """

    def __init__(
        self, rounding: str, out_of_memory: type[Exception] = MemoryError, settings: AllocatorSettings | None = None
    ) -> None:
        self.round = _ROUNDERS[rounding]
        self.exact = rounding == "none"
        self.settings = settings or AllocatorSettings()
        self.model = CachingAllocatorModel(self.settings) if rounding == "cuda" else None
        self.out_of_memory = out_of_memory
        self.live: dict[int, _StorageRef] = {}
        self.requested = 0
        self.allocated = 0
        self.peak_requested = 0
        self.peak_allocated = 0
        self.fake_outputs = 0  # outputs of ops under FakeTensorMode, which hold no memory
        self.compiled_buffers = 0  # buffers of Inductor's compiled programs (its plan for the CPU)
        self.device_type: str | None = None  # count only storages on it (meta: the GPU); None: every storage
        self._capacity: int | None = None
        self.recorder: Recorder | None = None  # origins (and events) of the storages, when asked for
        self.timeline: TimelineRecorder | None = None  # bytes after each event, while a fit's run asks for them
        self.op: object = None  # the op being dispatched and its outputs, read only by the recorder
        self.out: object = None
        self.workspace_bytes = CUBLAS_WORKSPACE_DEFAULT  # of each cuBLAS workspace (with the allocator's model)
        self.workspaces: dict[object, Workspace] = {}  # by cuBLAS handle
        self.card: Card | None = None  # the card predicted (its SMs size kernel temporaries); None: none named
        self.largest_temporaries = 0  # the most bytes one op's kernel temporaries held at once, since `forget`
        self.bounds: dict[tuple[str, str], int] = {}  # ops whose figure is not a card's (`cudnn.bound`): calls
        self._on_free = self._freed  # one bound method shared by every reference

    @property
    def capacity(self) -> int | None:
        """Bytes past which an allocation raises out_of_memory: allocated bytes, or with the allocator's
        model reserved bytes; None: unlimited."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        self._capacity = value
        if self.model is not None:
            self.model.capacity = value

    @property
    def reserved(self) -> int | None:
        """Bytes the allocator's model holds in segments (None without the model)."""
        return None if self.model is None else self.model.reserved

    @property
    def held(self) -> int:
        """What a capacity is judged on: reserved bytes with the allocator's model, else allocated bytes."""
        return self.allocated if self.model is None else self.model.reserved

    @property
    def peak_reserved(self) -> int | None:
        return None if self.model is None else self.model.peak_reserved

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: the model gives back every segment without a live block."""
        if self.model is not None:
            self.model.empty_cache()

    @property
    def wants_workspaces(self) -> bool:
        """Whether a matmul's first use of a cuBLAS handle allocates a workspace (the allocator's model)."""
        return self.model is not None and self.workspace_bytes > 0

    def workspace(self, handle: object) -> None:
        """A matmul ran on cuBLAS `handle`: on its first use (or when the workspace size grew since, as
        `torch.backends.cuda.cublas_workspace_size(n)` makes it) allocate it a workspace, kept from then on;
        a smaller one it had is freed after the new one is made, as torch replaces it."""
        held = self.workspaces.get(handle)
        if held is not None and held.size >= self.workspace_bytes:
            return
        made = Workspace(self.workspace_bytes)
        self._follow(made, made.key, made.size)  # the device's own memory, wherever the ledger counts
        self.workspaces[handle] = made
        del held  # the smaller one, if any: freed now

    @property
    def wants_temporaries(self) -> bool:
        """Whether ops' kernel temporaries are counted: only where the ledger predicts a GPU (the allocator's
        model, or the meta device)."""
        return self.model is not None or self.device_type == "meta"

    def transient(self, sizes: Sequence[int], during: Callable[[], None] | None = None) -> None:
        """An op's kernel allocated blocks of `sizes` bytes in this order and freed them, in reverse order,
        before returning; `during` (if given) runs while they are all held. Each goes through the allocator's
        model, attributed to the ledger's `op`. A size of 0 takes nothing (torch hands out a null pointer)."""
        held: list[Workspace] = []
        self.largest_temporaries = max(self.largest_temporaries, sum(sizes))
        try:
            for size in sizes:
                if size > 0:
                    held.append(self._hold(size))
            if during is not None:
                during()
        finally:
            while held:
                held.pop()  # its last reference: freed now

    def note_bound(self, reason: tuple[str, str] | None) -> None:
        """An op ran whose figure is not a card's to the byte, for `reason` (`cudnn.bound`); None: it is."""
        if reason is not None:
            self.bounds[reason] = self.bounds.get(reason, 0) + 1

    def _hold(self, size: int) -> Workspace:
        made = Workspace(size)
        self._follow(made, made.key, size)
        return made

    def clear_workspaces(self) -> None:
        """`private_torch.clear_cublas_workspaces()`: every workspace is freed (its blocks cached)."""
        self.workspaces.clear()

    def add(self, storage: Storage) -> None:
        """An op made `storage` (or resized one it made earlier)."""
        key = storage_key(storage)
        if key in self.live:
            self.resize(storage)
            return
        if self.device_type is not None and storage.device.type != self.device_type:
            return  # host memory beside the device the ledger stands for
        self._follow(storage, key, storage.nbytes())

    def resized(self, storage: Storage, before: int) -> None:
        """`storage` was resized outside any op (`UntypedStorage.resize_`): follow it like an op's resize."""
        if storage_key(storage) in self.live:
            self.resize(storage)
        elif storage.nbytes() > before:
            self.grow_existing(storage, before)

    def grow_existing(self, storage: Storage, before: int) -> None:
        """A storage made before tracking was resized by an op: count the growth as an allocation."""
        key = storage_key(storage)
        if key in self.live:
            self.resize(storage)
            return
        requested = storage.nbytes() - before
        if requested > 0 and (self.device_type is None or storage.device.type == self.device_type):
            self._follow(storage, key, requested, base=before)

    def resize(self, storage: Storage) -> None:
        """A followed storage changed size: count its bytes anew."""
        ref = self.live[storage_key(storage)]
        requested = max(storage.nbytes() - ref.base, 0)
        if requested == ref.requested:
            return
        if self.model is not None:
            counted = self._reallocate(ref, requested)
        else:
            counted = requested if self.exact else self.round(requested)
            self._check_capacity(counted - ref.counted)
        self.requested += requested - ref.requested
        self.allocated += counted - ref.counted
        ref.requested, ref.counted = requested, counted
        if self.recorder is not None:
            self.recorder.event("resize", ref, self.allocated)
        if self.timeline is not None:
            self.timeline.changed(RESIZED, self.held)
        self._update_peaks()

    def forget(self) -> None:
        """Stop following every storage (their frees will no longer change the counters); the cuBLAS
        workspaces go with them: each measurement starts with none."""
        self.live.clear()
        self.workspaces.clear()
        self.requested = self.allocated = self.peak_requested = self.peak_allocated = self.fake_outputs = 0
        self.compiled_buffers = 0
        self.largest_temporaries = 0
        self.bounds = {}
        if self.model is not None:  # each measurement starts with an empty cache
            self.model = CachingAllocatorModel(self.settings, self._capacity)

    def reset_peak(self) -> None:
        """The peaks from now on start at the current counters."""
        self.peak_allocated = self.allocated
        self.peak_requested = self.requested
        if self.model is not None:
            self.model.reset_peak()

    def _follow(self, storage: object, key: int, requested: int, base: int = 0) -> None:
        if self.model is not None:
            counted = self._malloc(key, requested)
        else:
            counted = requested if self.exact else self.round(requested)
            if self._capacity is not None:
                self._check_capacity(counted)
        ref = _StorageRef(storage, self._on_free)
        ref.key, ref.requested, ref.counted, ref.base, ref.origin = key, requested, counted, base, None
        self.live[key] = ref
        self.requested += requested
        self.allocated += counted
        if self.recorder is not None:
            self.recorder.allocated(self.op, self.out, ref, self.allocated)
        if self.timeline is not None:
            self.timeline.allocated(self.op, self.held)
        if self.allocated > self.peak_allocated:  # _update_peaks, inline: the hot path
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _update_peaks(self) -> None:
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _freed(self, ref: _StorageRef) -> None:
        # A storage key is reused once freed: only the reference that is still recorded counts.
        if self.live.get(ref.key) is ref:
            del self.live[ref.key]
            if self.model is not None:
                self.model.free(ref.key)
            self.requested -= ref.requested
            self.allocated -= ref.counted
            if self.recorder is not None:
                self.recorder.event("free", ref, self.allocated)
            if self.timeline is not None:
                self.timeline.changed(FREED, self.held)

    def _malloc(self, key: int, requested: int) -> int:
        assert self.model is not None
        try:
            return self.model.malloc(key, requested)
        except AllocatorOutOfMemory as exc:
            exc.__traceback__ = None  # its frames, and theirs up to the test's, hold what was allocated
            error = self.out_of_memory(f"tracker: {exc}")
            error.allocator_error = exc  # type: ignore[attr-defined]  # the figures, for the one-line failure
            raise error from None

    def _reallocate(self, ref: _StorageRef, requested: int) -> int:
        """A resized storage in the model: its old block freed, a new one taken (the old one back if it
        cannot be)."""
        assert self.model is not None
        self.model.free(ref.key)
        try:
            return self._malloc(ref.key, requested)
        except BaseException:
            self.model.malloc(ref.key, ref.requested)
            raise

    def _check_capacity(self, growth: int) -> None:
        if self.capacity is not None and growth > 0 and self.allocated + growth > self.capacity:
            raise self.out_of_memory(
                f"tracker: out of memory: tried to allocate {format_size(growth)} with {format_size(self.allocated)} "
                f"of the capacity {format_size(self.capacity)} already allocated"
            )
