"""Our predictions as torch memory snapshots: what `torch.cuda.memory._snapshot()` would have returned on
the card, from the tracker under the allocator's model, so that memory_viz (pytorch.org/memory_viz,
`python -m torch.cuda._memory_viz`) opens a CPU prediction and `read_snapshot`/`replay` read it back.

`RecordedModel` is the allocator's model writing down each request (`alloc`, its address and requested
bytes), each free (`free_requested` then `free_completed`), each segment taken and given back
(`segment_alloc`/`segment_free`; `segment_map`/`segment_unmap` of expandable segments' pages) and each
request it refuses (`oom`, with the bytes the card had left), in order. An allocation's frames are two:
the op (filename `??`, as torch writes a C++ frame it cannot place) and the innermost line of the test's
own code. Frees carry no frames (torch's `context="alloc"`); what `empty_cache()` gives back carries
torch's `emptyCache` frame, as a card's trace does. `snapshot_of` adds the segments with their
blocks at the end and the allocator's settings; `snapshot_bytes` pickles the plain dicts and lists as
torch's `_dump_snapshot` does.
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Iterator
from typing import Any, Final

from cuda_allocator_model import (
    INTERVALS,
    UNLIMITED,
    AllocatorOutOfMemory,
    AllocatorSettings,
    CachingAllocatorModel,
    Segment,
)
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.recording import op_name, user_line

__all__ = ["RecordedModel", "record", "record_backend", "snapshot_bytes", "snapshot_of"]

Frame = dict[str, Any]
Run = tuple[int, int, bool, int]  # a mapped range: start, end, expandable, stream
_NO_FRAMES: Final[list[Frame]] = []
_EMPTY_CACHE: Final[list[Frame]] = [  # as a card's trace names it
    {
        "name": "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()",
        "filename": "??",
        "line": 0,
    }
]


class RecordedModel(CachingAllocatorModel):
    """The caching allocator's model that keeps torch's memory history of what it serves (`events`)."""

    __slots__ = ("_frames", "_frames_of", "_ledger", "_released_by", "_runs", "_seen", "events", "restarted")

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        capacity: int | None = None,
        ledger: StorageLedger | None = None,
    ) -> None:
        super().__init__(settings, capacity)
        self.events: list[dict[str, Any]] = []
        self.restarted = False  # a copy was taken to restart from (gpumem.fit): its history breaks there
        self._ledger = ledger  # the op being dispatched, for the frames
        self._frames: dict[tuple[str, str | None], list[Frame]] = {}  # shared: pickled once each
        self._frames_of: dict[int, list[Frame]] = {}  # the frames of each live request
        self._runs: list[Run] = []
        self._seen = self._fingerprint()
        self._released_by = _NO_FRAMES  # the frames of the segments given back next

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordedModel:
        """A copy with its own history, serving the same ledger (which holds the test's storages and is never
        copied): what a fit keeps and restores between its runs. The original is marked `restarted`: its
        history breaks there, and no torch snapshot is written from it."""
        memo[id(self._ledger)] = self._ledger
        self.restarted = True
        made = type(self).__new__(type(self))
        memo[id(self)] = made
        for name in _slots(type(self)):
            if hasattr(self, name):
                setattr(made, name, copy.deepcopy(getattr(self, name), memo))
        return made

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> int:
        try:
            counted = super().malloc(key, nbytes, stream)
        except AllocatorOutOfMemory:
            self._segments_changed()  # what the retries gave back before torch gave up
            free = 0 if self.capacity is None else max(self.capacity - self.reserved, 0)
            self.events.append(
                {
                    "action": "oom",
                    "addr": 0,
                    "size": nbytes,
                    "stream": stream,
                    "device_free": free,
                    "frames": self._here(),
                }
            )
            raise
        self._segments_changed()
        if counted:  # a request of 0 bytes never reaches torch's allocator
            frames = self._frames_of[key] = self._here()
            self.events.append(_event("alloc", self._live[key].addr, nbytes, stream, frames))
        return counted

    def free(self, key: int) -> None:
        block = self._live.get(key)
        if block is None:
            return
        addr, size, stream = block.addr, block.requested, block.seg.stream
        self._frames_of.pop(key, None)  # a block restored as live was never requested here
        super().free(key)
        self.events += [
            _event(action, addr, size, stream, _NO_FRAMES) for action in ("free_requested", "free_completed")
        ]

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: the segments and pages it gives back carry torch's frame for it, so
        that a replay knows them from the releases a card makes when it runs short."""
        super().empty_cache()
        self._released_by = _EMPTY_CACHE
        try:
            self._segments_changed()
        finally:
            self._released_by = _NO_FRAMES

    def frames_of(self, key: int) -> list[Frame]:
        """The frames of live request `key`."""
        return self._frames_of.get(key, _NO_FRAMES)

    def _fingerprint(self) -> tuple[int, int, int, int]:
        """What changes whenever a segment or a page is taken or given back (a retry may do both)."""
        return self.reserved, self._next_address, len(self._segments), self.num_alloc_retries

    def _segments_changed(self) -> None:
        seen = self._fingerprint()
        if seen == self._seen:
            return
        self._seen = seen
        runs = _mapped_runs(self._segments)
        for start, end, expandable, stream in _without(self._runs, runs):
            action = "segment_unmap" if expandable else "segment_free"
            self.events.append(_event(action, start, end - start, stream, self._released_by))
        for start, end, expandable, stream in _without(runs, self._runs):
            action = "segment_map" if expandable else "segment_alloc"
            self.events.append(_event(action, start, end - start, stream, _NO_FRAMES))
        self._runs = runs

    def _here(self) -> list[Frame]:
        """The op being dispatched and the innermost line of the test's code, innermost first."""
        op = "unknown op" if self._ledger is None else op_name(self._ledger.op)
        where = user_line()
        frames = self._frames.get((op, where))
        if frames is None:
            frames = self._frames[op, where] = [{"name": op, "filename": "??", "line": 0}, *_user_frame(where)]
        return frames


def _event(action: str, addr: int, size: int, stream: int, frames: list[Frame]) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames}


def _user_frame(where: str | None) -> list[Frame]:
    """The test's frame at `where` ("path:line"), named after its function when it is on the stack."""
    if where is None:
        return []
    path, _, line_text = where.rpartition(":")
    line = int(line_text)
    name = "<test code>"
    frame = sys._getframe(2)
    tail = path.rpartition("/")[2]
    while frame is not None:
        if frame.f_lineno == line and frame.f_code.co_filename.endswith(tail):
            name = frame.f_code.co_name
            break
        frame = frame.f_back  # type: ignore[assignment]
    return [{"name": name, "filename": path, "line": line}]


def _mapped_runs(segments: dict[int, Segment]) -> list[Run]:
    """Each segment's mapped ranges (a whole segment unless it is expandable), by address."""
    runs: list[Run] = []
    for base in sorted(segments):
        seg = segments[base]
        if not seg.expandable:
            runs.append((base, base + seg.vsize, False, seg.stream))
            continue
        start = None
        block = seg.head
        while block is not None:
            if block.mapped and start is None:
                start = block.addr
            elif not block.mapped and start is not None:
                runs.append((start, block.addr, True, seg.stream))
                start = None
            block = block.next
        if start is not None:
            runs.append((start, base + seg.vsize, True, seg.stream))
    return runs


def _without(runs: list[Run], other: list[Run]) -> Iterator[Run]:
    """The parts of `runs` that no range of `other` covers (both sorted and disjoint)."""
    j = 0
    for start, end, expandable, stream in runs:
        while j < len(other) and other[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(other) and other[k][0] < end:
            if other[k][0] > at:
                yield at, other[k][0], expandable, stream
            at = max(at, other[k][1])
            k += 1
        if at < end:
            yield at, end, expandable, stream


def record(ledger: StorageLedger) -> RecordedModel | None:
    """Put a `RecordedModel` in place of the ledger's model, fresh as a measurement's start leaves it;
    None when the ledger has no allocator's model (no CUDA rounding: nothing a snapshot could show)."""
    model = ledger.model
    if model is None:
        return None
    recorded = RecordedModel(model.settings, model.capacity, ledger)
    recorded.fraction_limit = model.fraction_limit
    ledger.model = recorded
    return recorded


def record_backend(backend: object) -> RecordedModel | None:
    """`record` on the backend's ledger; None for a backend without one (not the tracker) or without a model."""
    ledger = getattr(backend, "ledger", None)
    return record(ledger) if isinstance(ledger, StorageLedger) else None


def snapshot_of(model: RecordedModel, alloc_conf: str = "") -> dict[str, Any]:
    """The snapshot torch would return (`torch.cuda.memory._snapshot()`) for one device, 0: its segments and
    blocks now, its trace, its allocator's settings (`alloc_conf`: `PYTORCH_CUDA_ALLOC_CONF` as given)."""
    live = {block.addr: key for key, block in model._live.items()}
    return {
        "segments": [_segment(model, seg, run, live) for seg, run in _segment_runs(model)],
        "device_traces": [list(model.events)],
        "allocator_settings": _settings_of(model.settings, alloc_conf),
    }


def _segment_runs(model: RecordedModel) -> Iterator[tuple[Segment, Run]]:
    segments = model._segments
    for run in _mapped_runs(segments):
        base = max(b for b in segments if b <= run[0])
        yield segments[base], run


def _segment(model: RecordedModel, seg: Segment, run: Run, live: dict[int, int]) -> dict[str, Any]:
    start, end = run[0], run[1]
    blocks: list[dict[str, Any]] = []
    block = seg.head
    while block is not None:
        if block.mapped and start <= block.addr < end:
            frames = model.frames_of(live[block.addr]) if block.allocated else _NO_FRAMES
            state = "active_allocated" if block.allocated else "inactive"
            blocks.append(
                {
                    "address": block.addr,
                    "size": block.size,
                    "requested_size": block.requested,
                    "state": state,
                    "frames": frames,
                }
            )
        block = block.next
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": 0,
        "address": start,
        "total_size": end - start,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b["requested_size"] for b in blocks),
        "stream": seg.stream,
        "segment_type": "small" if seg.small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": seg.expandable,
        "frames": _NO_FRAMES,
        "blocks": blocks,
    }


def _settings_of(settings: AllocatorSettings, alloc_conf: str = "") -> dict[str, Any]:
    """`allocator_settings` as torch writes it: the keys that change what a replay serves."""
    divisions = settings.roundup_power2_divisions
    every = list(divisions) * INTERVALS if len(divisions) == 1 else list(divisions) or [0] * INTERVALS
    return {
        "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
        "max_split_size": UNLIMITED if settings.max_split_size is None else settings.max_split_size,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": settings.expandable_segments,
        "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(every[:INTERVALS])},
    }


def snapshot_bytes(snapshot: dict[str, Any]) -> bytes:
    """The snapshot pickled as torch's `_dump_snapshot` pickles it, in protocol 4 (memory_viz's reader
    knows no later one; Python 3.14's default is 5)."""
    return pickle.dumps(snapshot, protocol=4)


def _slots(kind: type) -> list[str]:
    """Every slot of `kind` and of the classes it derives from."""
    return [name for klass in kind.__mro__ for name in getattr(klass, "__slots__", ()) if name != "__weakref__"]
