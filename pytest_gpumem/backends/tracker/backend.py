"""The tracker: exact bytes of the tensor storages that ATen ops create, for machines without a GPU.

The ledger here holds the storages and the counters; the dispatch mode that feeds it is in
`tracker_mode`, the patches for what the mode cannot see in `tracker_hooks`. A storage's bytes are added
when an op makes it and subtracted when a weak reference to it dies.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.base import Counters
from pytest_gpumem.backends.tracker.mode import leave, mode_class
from pytest_gpumem.backends.tracker.patches import Patches
from pytest_gpumem.constants import PATHS, ROUNDINGS
from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.backends.tracker.recording import Origin, Recorder, Survivor


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


def default_paths(rounding: str, device: str) -> str:
    """A GPU's code paths where the run predicts a GPU (the meta device, CUDA rounding), else the CPU's."""
    return "gpu" if device == "meta" or rounding == "cuda" else "cpu"


class TrackerBackend:
    """Counts tensor storages on any device; `rounding="cuda"` predicts the CUDA allocator's counts."""

    name = "tracker"
    sees_earlier_allocations = False

    def __init__(self, rounding: str = "none", device: str = "cpu", paths: str | None = None) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if device not in ("cpu", "meta"):
            raise ValueError(f"device must be cpu or meta, got {device!r}")
        if paths is not None and paths not in PATHS:
            raise ValueError(f"paths must be one of {PATHS}, got {paths!r}")
        self.rounding = rounding
        self._device_type = device
        self._default_paths = default_paths(rounding, device)
        self.paths = paths or self._default_paths
        mode_class()  # its imports (torch._dynamo) happen now, not inside the first test's call
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
        paths = "" if self.paths == self._default_paths else f"{self.paths} paths"
        settings = [s for s in ("meta" if self._device_type == "meta" else "", self._rounding_text(), paths) if s]
        backend = "tracker" if not settings else f"tracker ({', '.join(settings)})"
        return {"backend": backend, "device": self._device_type}

    def _rounding_text(self) -> str:
        return "" if self.rounding == "none" else f"round {self.rounding}"

    def describe(self) -> str:
        device = "meta (a prediction: sizes without data, nothing computed)" if self._device_type == "meta" else "cpu"
        line = f"tracker (storages created by ATen ops, rounding {self.rounding}), device {device}"
        predicting = self._device_type == "meta" or self.rounding == "cuda"
        return line + self._paths_text() if predicting or self.paths == "gpu" else line

    def _paths_text(self) -> str:
        meta = self._device_type == "meta"
        if self.paths == "cpu":
            attention = ", math attention (S x S weights)" if meta else ""
            return f"; the CPU's code paths: single-tensor optimizers{attention} (--gpumem-paths=gpu for a GPU's)"
        attention = ", fused attention (flash, efficient)" if meta else ""
        return f"; a GPU's code paths: foreach optimizers{attention} (--gpumem-paths=cpu for the CPU's)"

    def start(self) -> None:
        tracking_mode = mode_class()
        self.ledger.forget()
        self._notes = []
        self._patches = Patches(tracking_mode, self._notes)
        gpu = self.paths == "gpu"
        self._patches.install(foreach=gpu, fused_attention=gpu and self._device_type == "meta")
        self._mode = tracking_mode(self.ledger)
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
                leave(mode)
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
        from pytest_gpumem.backends.tracker.attribution import Attributor
        from pytest_gpumem.backends.tracker.recording import Recorder

        self.ledger.capacity = capacity
        if explain:
            self.ledger.recorder = Attributor(self.ledger.live, events)
        else:
            self.ledger.recorder = Recorder(events) if origins or events else None

    @contextlib.contextmanager
    def held_to(self, capacity: int) -> Iterator[None]:
        """Within the block, an allocation past `capacity` bytes (or the configured capacity, if lower)
        raises OutOfMemoryError (`gpumem.fit(confirm=True)` runs its answer so)."""
        before = self.ledger.capacity
        self.ledger.capacity = capacity if before is None else min(before, capacity)
        try:
            yield
        finally:
            self.ledger.capacity = before

    def attribution(self) -> Attributor | None:
        """The attributor of the measurement under way, when it explains its peaks."""
        from pytest_gpumem.backends.tracker.attribution import Attributor

        recorder = self.ledger.recorder
        return recorder if isinstance(recorder, Attributor) else None

    def survivors(self, count: int) -> list[Survivor]:
        """The largest storages the call made that are still allocated, with what they hold."""
        from pytest_gpumem.backends.tracker.recording import Survivor, tensors_by_storage

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

    def live_storages(self) -> dict[int, tuple[int, Origin | None]]:
        """Each storage the call made that is still allocated, by key: its counted bytes and its origin."""
        return {ref.key: (ref.counted, ref.origin) for ref in self.ledger.live.values()}

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
