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

The allocator's model is served late where nothing needs its answer at the op: while no capacity or memory
fraction can refuse a request, no recorder or timeline reads the counters after each event and the model
writes no history, the ledger holds each allocation and free back (`_held`, in order) and replays them in
one tight loop when anyone reads the model's state (allocated, reserved, a peak, the live storages' counted
bytes, the model itself), when the measurement's terms change, before any event served at once, and every
`REPLAY_AT` events. The model sees the same calls in the same order as if each were made at its op, so every
figure is the same; its code stays warm in the interpreter's caches instead of being evicted by the op's
work in between (a Linear(64) step: about 5 µs per malloc and free inside the step, 0.65 µs in a loop).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from cuda_allocator_model import (
    CUBLAS_WORKSPACE_DEFAULT,
    AllocatorOutOfMemory,
    AllocatorSettings,
    CachingAllocatorModel,
    Card,
    format_size,
)
from pytest_gpumem.backends.timeline import FREED, RESIZED
from pytest_gpumem.backends.tracker.recording import Recorder
from pytest_gpumem.backends.tracker.storages import ROUNDERS, HoldingWithoutTensors, Storage, Workspace
from pytest_gpumem.private_torch import storage_key

if TYPE_CHECKING:
    from pytest_gpumem.backends.timeline import TimelineRecorder
    from pytest_gpumem.backends.tracker.recording import Origin

_ONE_EXABYTE = 1 << 60  # the allocator refuses a request this large at once: served at its op

REPLAY_AT = 512
"""Events the ledger holds back for the allocator's model at most; the next one replays them all."""


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a live storage, carrying the bytes it was counted with."""

    __slots__ = ("base", "counted", "key", "origin", "requested")

    key: int
    requested: int
    counted: int
    base: int  # bytes the storage had before tracking began (made earlier, then grown by an op)
    origin: Origin | None


class StorageLedger(HoldingWithoutTensors):
    """Live storages with their requested and counted bytes, and the counters over them.

    Hot path (every op output): one dict lookup, one weak reference with a shared callback; with the
    allocator's model, the event held back for it while it may be served late. Past `capacity` counted bytes
    (with CUDA rounding: reserved bytes, as a card judges it), an allocation raises `out_of_memory` (the
    tracker's: torch's error, carrying the model's as `allocator_error`).
    """

    def __init__(
        self, rounding: str, out_of_memory: type[Exception] = MemoryError, settings: AllocatorSettings | None = None
    ) -> None:
        self.round = ROUNDERS[rounding]
        self.exact = rounding == "none"
        self.settings = settings or AllocatorSettings()
        self._model = CachingAllocatorModel(self.settings) if rounding == "cuda" else None
        self.out_of_memory = out_of_memory
        self._live: dict[int, _StorageRef] = {}
        self.requested = 0
        self._allocated = 0
        self.peak_requested = 0
        self._peak_allocated = 0
        self.fake_outputs = 0  # outputs of ops under FakeTensorMode, which hold no memory
        self.compiled_buffers = 0  # buffers of Inductor's compiled programs (its plan for the CPU)
        self._device_type: str | None = None
        self._counted_devices: dict[object, bool] = {}  # whether a storage on the device is counted, by device
        self._capacity: int | None = None
        self._recorder: Recorder | None = None
        self.recording = False  # whether a recorder is set: read on every op, where `recorder` would cost a call
        self._timeline: TimelineRecorder | None = None
        self.op: object = None  # the op being dispatched and its outputs, read only by the recorder
        self.out: object = None
        self._workspace_bytes = CUBLAS_WORKSPACE_DEFAULT
        self.workspaces: dict[object, Workspace] = {}  # by cuBLAS handle
        self.workspaces_ready: set[object] = set()
        self.card: Card | None = None  # the card predicted (its SMs size kernel temporaries); None: none named
        self.largest_temporaries = 0  # the most bytes one op's kernel temporaries held at once, since `forget`
        self.bounds: dict[tuple[str, str], int] = {}  # ops whose figure is not a card's (`cudnn.bound`): calls
        self._on_free = self._freed  # one bound method shared by every reference
        # events the model has not served yet, in order: a reference allocated, or the key of one freed. Only
        # while `_late`: whatever ends it replays them first, so an event served at once never passes one held
        self._held: list[_StorageRef | int] = []
        self._replaying = False
        self._late = self._may_serve_late()  # whether the next event may be held back
        self._plain = self._counts_only()  # whether an event changes nothing but the counters
        self._decide_wants()

    # --- readers: each sees the model with every held event served

    @property
    def model(self) -> CachingAllocatorModel | None:
        """The allocator's model (None without CUDA rounding), every event served. Whoever takes it may
        change it (its settings, a capacity): the next event is served at once, and decides anew."""
        self._replay()
        self._late = False
        return self._model

    @model.setter
    def model(self, model: CachingAllocatorModel | None) -> None:
        self._replay()
        self._model = model
        self._decide()

    @property
    def device_type(self) -> str | None:
        """Count only storages on it (meta: the GPU's memory, a CPU tensor its host's); None: every storage."""
        return self._device_type

    @device_type.setter
    def device_type(self, device_type: str | None) -> None:
        self._device_type = device_type
        self._counted_devices = {}
        self._decide_wants()

    @property
    def workspace_bytes(self) -> int:
        """Bytes of each cuBLAS workspace (with the allocator's model)."""
        return self._workspace_bytes

    @workspace_bytes.setter
    def workspace_bytes(self, size: int) -> None:
        self._workspace_bytes = size
        self.workspaces_ready = {handle for handle, held in self.workspaces.items() if held.size >= size}
        self._decide_wants()

    @property
    def live(self) -> dict[int, _StorageRef]:
        """The storages followed, by key, each with the bytes it is counted with."""
        self._replay()
        return self._live

    @property
    def allocated(self) -> int:
        """Counted bytes of the live storages (with the allocator's model: its blocks)."""
        self._replay()
        return self._allocated

    @allocated.setter
    def allocated(self, value: int) -> None:
        self._replay()
        self._allocated = value

    @property
    def peak_allocated(self) -> int:
        self._replay()
        return self._peak_allocated

    @property
    def recorder(self) -> Recorder | None:
        """Origins (and events) of the storages, when asked for: told of each event as it happens."""
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | None) -> None:
        self._replay()
        self._recorder = recorder
        self.recording = recorder is not None
        self._decide()

    @property
    def timeline(self) -> TimelineRecorder | None:
        """Bytes after each event, while a fit's run asks for them."""
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: TimelineRecorder | None) -> None:
        self._replay()
        self._timeline = timeline
        self._decide()

    @property
    def capacity(self) -> int | None:
        """Bytes past which an allocation raises out_of_memory: allocated bytes, or with the allocator's
        model reserved bytes; None: unlimited."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        self._replay()
        self._capacity = value
        if self._model is not None:
            self._model.capacity = value
        self._decide()

    @property
    def reserved(self) -> int | None:
        """Bytes the allocator's model holds in segments (None without the model)."""
        self._replay()
        return None if self._model is None else self._model.reserved

    @property
    def held(self) -> int:
        """What a capacity is judged on: reserved bytes with the allocator's model, else allocated bytes."""
        self._replay()
        return self._allocated if self._model is None else self._model.reserved

    @property
    def peak_reserved(self) -> int | None:
        self._replay()
        return None if self._model is None else self._model.peak_reserved

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: the model gives back every segment without a live block."""
        self._replay()
        if self._model is not None:
            self._model.empty_cache()

    def add(self, storage: Storage) -> None:
        """An op made `storage` (or resized one it made earlier)."""
        key = storage_key(storage)
        if key in self._live:
            self.resize(storage)
            return
        if self._device_type is not None and not self._counts_device(storage):
            return  # host memory beside the device the ledger stands for
        self._follow(storage, key, storage.nbytes())

    def _counts_device(self, storage: Storage) -> bool:
        """Whether `storage` is on the device counted, decided once per device (`device.type` builds a str)."""
        device = storage.device
        counted = self._counted_devices.get(device)
        if counted is None:
            counted = self._counted_devices[device] = device.type == self._device_type
        return counted

    def resized(self, storage: Storage, before: int) -> None:
        """`storage` was resized outside any op (`UntypedStorage.resize_`): follow it like an op's resize."""
        if storage_key(storage) in self._live:
            self.resize(storage)
        elif storage.nbytes() > before:
            self.grow_existing(storage, before)

    def grow_existing(self, storage: Storage, before: int) -> None:
        """A storage made before tracking was resized by an op: count the growth as an allocation."""
        key = storage_key(storage)
        if key in self._live:
            self.resize(storage)
            return
        requested = storage.nbytes() - before
        if requested > 0 and (self._device_type is None or self._counts_device(storage)):
            self._follow(storage, key, requested, base=before)

    def resize(self, storage: Storage) -> None:
        """A followed storage changed size: count its bytes anew."""
        ref = self._live[storage_key(storage)]
        requested = max(storage.nbytes() - ref.base, 0)
        if requested == ref.requested:
            return
        self._replay()
        if self._model is not None:
            counted = self._reallocate(ref, requested)
        else:
            counted = requested if self.exact else self.round(requested)
            self._check_capacity(counted - ref.counted)
        self.requested += requested - ref.requested
        self._allocated += counted - ref.counted
        ref.requested, ref.counted = requested, counted
        if self._recorder is not None:
            self._recorder.event("resize", ref, self._allocated)
        if self._timeline is not None:
            self._timeline.changed(RESIZED, self.held)
        self._update_peaks()
        self._late = self._may_serve_late()

    def forget(self) -> None:
        """Stop following every storage (their frees will no longer change the counters); the cuBLAS
        workspaces go with them: each measurement starts with none."""
        self._held.clear()  # the model they were for is replaced
        self._live.clear()
        self.workspaces.clear()
        self.workspaces_ready.clear()
        self.requested = self._allocated = self.peak_requested = self._peak_allocated = self.fake_outputs = 0
        self.compiled_buffers = 0
        self.largest_temporaries = 0
        self.bounds = {}
        if self._model is not None:  # each measurement starts with an empty cache
            self._model = CachingAllocatorModel(self.settings, self._capacity)
        self._late = self._may_serve_late()

    def reset_peak(self) -> None:
        """The peaks from now on start at the current counters."""
        self._replay()
        self._peak_allocated = self._allocated
        self.peak_requested = self.requested
        if self._model is not None:
            self._model.reset_peak()

    def _may_serve_late(self) -> bool:
        """Whether the model may serve the events to come late: nothing can refuse a request (no capacity, no
        memory fraction), nothing reads the counters after each event (a recorder of events, an attributor, a
        timeline; a recorder of origins alone reads none), and the model is the plain one (a `RecordedModel`
        writes the op and the test's line of each request as it is made)."""
        model = self._model
        recorder = self._recorder
        return (
            type(model) is CachingAllocatorModel
            and (recorder is None or (type(recorder) is Recorder and recorder.events is None))
            and self._timeline is None
            and model.capacity is None
            and model.fraction_limit is None
            and model.settings.fraction_limit is None
        )

    def _decide(self) -> None:
        """The terms changed (a model, recorder, timeline or capacity): the next event is served at once and
        decides anew whether events may be held; the short path and what the ops want are decided again."""
        self._late = False
        self._plain = self._counts_only()
        self._decide_wants()

    def _counts_only(self) -> bool:
        """Whether an event changes nothing but the counters: exact bytes, no allocator's model, nothing that
        can refuse a request (a capacity) or reads after each event (a recorder, a timeline)."""
        return (
            self.exact
            and self._model is None
            and self._capacity is None
            and self._recorder is None
            and self._timeline is None
        )

    def _follow(self, storage: object, key: int, requested: int, base: int = 0) -> None:
        if self._plain:  # what the general path below does in that case, and no more
            ref = _StorageRef(storage, self._on_free)
            ref.key, ref.requested, ref.counted, ref.base, ref.origin = key, requested, requested, base, None
            self._live[key] = ref
            self.requested += requested
            self._allocated += requested
            if self._allocated > self._peak_allocated:
                self._peak_allocated = self._allocated
            if self.requested > self.peak_requested:
                self.peak_requested = self.requested
            return
        if self._late and requested < _ONE_EXABYTE:  # the model's answer is not needed now: held back
            ref = _StorageRef(storage, self._on_free)
            ref.key, ref.requested, ref.counted, ref.base, ref.origin = key, requested, 0, base, None
            self._live[key] = ref
            self.requested += requested
            if self.requested > self.peak_requested:
                self.peak_requested = self.requested
            held = self._held
            held.append(ref)
            if self._recorder is not None:  # origins alone: no figure it keeps
                self._recorder.allocated(self.op, self.out, ref, self._allocated)
            if len(held) >= REPLAY_AT:
                self._replay()
            return
        if self._model is not None:
            counted = self._malloc(key, requested)
        else:
            counted = requested if self.exact else self.round(requested)
            if self._capacity is not None:
                self._check_capacity(counted)
        ref = _StorageRef(storage, self._on_free)
        ref.key, ref.requested, ref.counted, ref.base, ref.origin = key, requested, counted, base, None
        self._live[key] = ref
        self.requested += requested
        self._allocated += counted
        if self._recorder is not None:
            self._recorder.allocated(self.op, self.out, ref, self._allocated)
        if self._timeline is not None:
            self._timeline.allocated(self.op, self.held)
        if self._allocated > self._peak_allocated:  # _update_peaks, inline: the hot path
            self._peak_allocated = self._allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _update_peaks(self) -> None:
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _freed(self, ref: _StorageRef) -> None:
        # A storage key is reused once freed: only the reference that is still recorded counts.
        live, key = self._live, ref.key
        if live.get(key) is ref:
            del live[key]
            self.requested -= ref.requested
            if self._plain:
                self._allocated -= ref.counted
                return
            if self._late:  # held; a free that a collection makes inside a replay is served in that loop
                held = self._held
                held.append(key)
                if len(held) >= REPLAY_AT:
                    self._replay()
                return
            if self._model is not None:
                self._replay()
                self._model.free(key)
                self._late = self._may_serve_late()
            self._allocated -= ref.counted
            if self._recorder is not None:
                self._recorder.event("free", ref, self._allocated)
            if self._timeline is not None:
                self._timeline.changed(FREED, self.held)

    def _replay(self) -> None:
        """Serve the held events in order, in one tight loop: each allocation's counted bytes set on its
        reference, the counters moved by what the model's moved, the peak of allocated bytes taken over
        every event in between (the model's, kept apart and restored)."""
        held = self._held
        if not held or self._replaying:
            return
        model = self._model
        assert model is not None
        malloc, free = model.malloc, model.free
        start, peak = model.allocated, model.peak_allocated
        model.peak_allocated = start
        self._replaying = True
        served = 0
        try:
            for event in held:  # a free during the loop (a collection's) is appended and served in it
                served += 1
                if isinstance(event, int):
                    free(event)
                else:
                    event.counted = malloc(event.key, event.requested)
        finally:
            del held[:served]  # one another thread appended after the loop waits for the next replay
            self._replaying = False
            high = model.peak_allocated
            model.peak_allocated = max(peak, high)
            before = self._allocated
            self._allocated = before + model.allocated - start
            if before + high - start > self._peak_allocated:
                self._peak_allocated = before + high - start

    def _malloc(self, key: int, requested: int) -> int:
        model = self._model
        assert model is not None
        self._replay()
        try:
            counted = model.malloc(key, requested)
        except AllocatorOutOfMemory as exc:
            exc.__traceback__ = None  # its frames, and theirs up to the test's, hold what was allocated
            error = self.out_of_memory(f"tracker: {exc}")
            error.allocator_error = exc  # type: ignore[attr-defined]  # the figures, for the one-line failure
            raise error from None
        self._late = self._may_serve_late()
        return counted

    def _reallocate(self, ref: _StorageRef, requested: int) -> int:
        """A resized storage in the model: its old block freed, a new one taken (the old one back if it
        cannot be)."""
        model = self._model
        assert model is not None
        model.free(ref.key)
        try:
            return self._malloc(ref.key, requested)
        except BaseException:
            model.malloc(ref.key, ref.requested)
            raise

    def _check_capacity(self, growth: int) -> None:
        if self.capacity is not None and growth > 0 and self._allocated + growth > self.capacity:
            raise self.out_of_memory(
                f"tracker: out of memory: tried to allocate {format_size(growth)} with {format_size(self._allocated)} "
                f"of the capacity {format_size(self.capacity)} already allocated"
            )
