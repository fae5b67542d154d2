"""A card's requests under other allocator settings or another capacity: peak reserved, what is reserved but
unallocated at that peak, and whether and where the job runs out of memory.

Each what-if runs the model free (its own addresses, its own retries and releases), so that its rows
compare with each other: the requests live when recording began are served first, in address order, on
an empty cache; then the trace's requests and frees in order. `torch.cuda.empty_cache()` calls the trace
shows (`segment_free` events with an `emptyCache` frame) are made again; releases the card made because
its driver ran short are the model's own business under a capacity. An `oom` event of the card is
asked again and given back when it is served; refused, it is where the what-if runs out, and the replay
goes on as the program did (a fit's search, an out-of-memory handler). A request the card served that
the what-if refuses ends it. Each request is served in its own pool (`pool_id`), a private pool let go
where the card's `empty_cache` released it (as `agreement` does).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from cuda_allocator_model.model import AllocatorOutOfMemory, CachingAllocatorModel
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.snapshots.agreement import Agreement, emptied_by
from cuda_allocator_model.snapshots.records import Event, Frame, Snapshot
from cuda_allocator_model.snapshots.start import Pools, StartState, start_state

__all__ = ["DeviceReplay", "OutOfMemoryAt", "WhatIf", "frames_user_frame", "user_frame", "what_if"]

_NOT_USER = ("/torch/", "\\torch\\", "site-packages", "dist-packages", "/lib/python", "<frozen")


@dataclass(frozen=True)
class OutOfMemoryAt:
    """Where a what-if runs out: the request's index in the trace (-1: a request live at the start), its
    requested bytes, and its first user frame."""

    request: int
    size: int
    frame: str


@dataclass(frozen=True)
class WhatIf:
    """One what-if on one device."""

    setting: str  # the allocator configuration, as given
    capacity: str  # as given; "unlimited" for none
    peak_reserved: int
    unallocated_at_peak: int  # reserved but unallocated when reserved peaked
    peak_allocated: int
    out_of_memory: OutOfMemoryAt | None
    ignored: tuple[str, ...]  # keys the model does not act on (garbage_collection_threshold)
    reserved: array[int]  # after each request served
    allocated: array[int]
    limit: int | None = None  # the capacity's bytes; None: unlimited


@dataclass(frozen=True)
class DeviceReplay:
    """One device's agreement with the card and its what-ifs."""

    device: int
    agreement: Agreement
    outcomes: tuple[WhatIf, ...]


def user_frame(event: Event) -> str:
    """The first Python frame of the user's code (not torch's, not a library's): 'train.py:12 step'."""
    return frames_user_frame(event.frames)


def frames_user_frame(frames: tuple[Frame, ...]) -> str:
    """`user_frame` of a stack (a live block's, in a snapshot's final state)."""
    for frame in frames:
        path = frame.filename
        if path.endswith(".py") and not any(part in path for part in _NOT_USER):
            return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{frame.line} {frame.name}"
    op = next((f.name for f in reversed(frames) if f.name.startswith("at::_ops::")), None)
    if op is not None:  # autograd's thread: no Python frame, the op it ran
        return f"autograd {op.removeprefix('at::_ops::').split('::')[0]}"
    return "(no Python frame)" if frames else "(no frames recorded)"


def what_if(
    snapshot: Snapshot,
    settings: AllocatorSettings,
    capacity: int | None,
    setting: str,
    capacity_text: str,
    device: int = 0,
    start: StartState | None = None,
) -> WhatIf:
    """Replay `device`'s requests under `settings` and `capacity` (bytes; None: unlimited)."""
    model = CachingAllocatorModel(settings, capacity)
    run = _Run(model)
    start = start if start is not None else start_state(snapshot, device)
    oom = run.prelude(start)
    if oom is None:
        oom = run.trace(snapshot.trace(device))
    return WhatIf(
        setting, capacity_text, run.peak, run.unallocated, model.peak_allocated, oom, settings.ignored,
        run.reserved, run.allocated, capacity,
    )  # fmt: skip


class _Run:
    def __init__(self, model: CachingAllocatorModel) -> None:
        self.model = model
        self.pools = Pools(model)
        self.peak = self.unallocated = 0
        self.reserved: array[int] = array("q")
        self.allocated: array[int] = array("q")

    def note(self) -> None:
        model = self.model
        self.reserved.append(model.reserved)
        self.allocated.append(model.allocated)
        if model.reserved > self.peak:
            self.peak = model.reserved
            self.unallocated = model.reserved - model.allocated

    def prelude(self, start: StartState) -> OutOfMemoryAt | None:
        for block in start.live:
            self.pools.to(block.pool)
            try:
                self.model.malloc(block.address, block.requested, block.stream)
            except AllocatorOutOfMemory:
                self.note()
                return OutOfMemoryAt(-1, block.requested, "(live at the start)")
        self.note()
        return None

    def trace(self, trace: tuple[Event, ...]) -> OutOfMemoryAt | None:
        """The first request refused: one the card served ends the replay (what follows depended on it);
        one the card refused too (its `oom`) does not, as the program went on (a fit's search, a handler)."""
        model, pools = self.model, self.pools
        first: OutOfMemoryAt | None = None
        index = 0
        emptied = False  # within a run of segment_free events that an empty_cache() made
        for e in trace:
            action = e.action
            if action == "alloc":
                if e.pool is not pools.current:
                    pools.to(e.pool)
                try:
                    model.malloc(e.addr, e.size, e.stream)
                except AllocatorOutOfMemory:
                    self.note()
                    return first or OutOfMemoryAt(index, e.size, user_frame(e))
                index += 1
                self.note()
            elif action == "free_completed":
                model.free(e.addr)
            elif action == "segment_free" or action == "segment_unmap":
                if emptied_by(e):
                    pools.emptied(e, emptied)
                    emptied = True
                continue
            elif action == "oom":
                pools.to(e.pool)
                try:
                    model.malloc(-1, e.size, e.stream)
                except AllocatorOutOfMemory:
                    first = first or OutOfMemoryAt(index, e.size, user_frame(e))
                    continue
                model.free(-1)
            emptied = False
        return first
