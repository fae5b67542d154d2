"""A card's figures replayed from a snapshot's trace: peak requested, allocated and reserved bytes, and the
sequence of requests, to hold a prediction against.

* requested: the running sum of `alloc` sizes less `free_completed` sizes (the card's `requested_bytes`;
  trace sizes are the requested bytes).
* reserved: the running sum of `segment_alloc`/`segment_map` less `segment_free`/`segment_unmap` sizes,
  on top of what the segments held when recording began (walked back from the final segments).
* allocated: the allocator's blocks, which a trace does not give: the requests are fed, with their
  streams, to the caching allocator's model (`CachingAllocatorModel`, with the snapshot's allocator
  settings), each in the pool its entry names, whose `allocated` counts blocks as the allocator rounds
  them. The model's own reserved
  bytes come with it: how close the model gets to the card from the card's own requests.

A trace that starts warm (blocks live before recording: a wrapped ring buffer, a recording started after
warmup) has its starting live bytes walked back from the final segments' blocks; bytes freed in the trace
whose block the trace never showed count by their requested size rounded to 512 B.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from cuda_allocator_model.model import AllocatorSettings, CachingAllocatorModel
from cuda_allocator_model.snapshots.records import Event, Snapshot
from cuda_allocator_model.snapshots.start import Pools

__all__ = ["CardFigures", "replay", "starts_empty"]

_GROW = frozenset({"segment_alloc", "segment_map"})
_SHRINK = frozenset({"segment_free", "segment_unmap"})


@dataclass(frozen=True)
class CardFigures:
    """What a card's trace says about one device: peaks (bytes) and the requests in order."""

    from_empty: bool
    peak_requested: int
    peak_allocated: int
    peak_reserved: int
    start_requested: int  # live when recording began (0 from empty)
    start_allocated: int
    start_reserved: int
    model_peak_reserved: int  # the allocator's model fed the card's requests (from empty: comparable)
    requests: tuple[Event, ...]  # the `alloc` events, in order


def starts_empty(trace: tuple[Event, ...]) -> bool:
    """Whether recording began before any segment existed: every request falls in a segment the trace
    made, every free and segment_free names something the trace allocated."""
    segments: list[tuple[int, int]] = []  # (address, end), sorted
    live: set[int] = set()
    for event in trace:
        action = event.action
        if action in _GROW:
            segments.insert(bisect_right(segments, (event.addr, 0)), (event.addr, event.addr + event.size))
        elif action == "alloc":
            i = bisect_right(segments, (event.addr, 1 << 80)) - 1
            if i < 0 or not segments[i][0] <= event.addr < segments[i][1]:
                return False
            live.add(event.addr)
        elif action == "free_completed":
            if event.addr not in live:
                return False
            live.discard(event.addr)
        elif action in _SHRINK:
            i = bisect_right(segments, (event.addr, 1 << 80)) - 1
            if i < 0 or segments[i][0] != event.addr:
                return False
            if action == "segment_free" or segments[i][1] - segments[i][0] == event.size:
                del segments[i]
    return True


def _start_state(snapshot: Snapshot, trace: tuple[Event, ...], device: int) -> tuple[int, int, int]:
    """Requested, allocated and reserved bytes when recording began (walked back from the final state)."""
    segments = [s for s in snapshot.segments if s.device == device]
    reserved = sum(s.total_size for s in segments)
    live_end = {b.address: b for s in segments for b in s.blocks if b.state.startswith("active")}
    made: set[int] = set()
    requested = sum(b.requested_size for b in live_end.values())
    allocated = sum(b.size for b in live_end.values())
    for event in trace:
        if event.action in _GROW:
            reserved -= event.size
        elif event.action in _SHRINK:
            reserved += event.size
        elif event.action == "alloc":
            made.add(event.addr)
        elif event.action == "free_completed":
            made.discard(event.addr)
    # Blocks live at the end that the trace made were not there at the start; frees of blocks the trace
    # never made were.
    for addr in made:
        block = live_end.get(addr)
        if block is not None:
            requested -= block.requested_size
            allocated -= block.size
    for size in _freed_before(trace):
        requested += size
        allocated += _rounded(size)
    return max(requested, 0), max(allocated, 0), max(reserved, 0)


def _freed_before(trace: tuple[Event, ...]) -> list[int]:
    """Requested sizes of the blocks freed in the trace that it did not allocate (live at its start)."""
    seen: set[int] = set()
    out: list[int] = []
    for event in trace:
        if event.action == "alloc":
            seen.add(event.addr)
        elif event.action == "free_completed":
            if event.addr in seen:
                seen.discard(event.addr)
            else:
                out.append(event.size)
    return out


def _rounded(size: int) -> int:
    return 512 if size <= 512 else (size + 511) & ~511


def replay(snapshot: Snapshot, device: int = 0) -> CardFigures:
    """The card's figures for `device` of `snapshot` (peaks include what was live at the start)."""
    trace = snapshot.trace(device)
    empty = starts_empty(trace)
    start = (0, 0, 0) if empty else _start_state(snapshot, trace, device)
    model = CachingAllocatorModel(snapshot.allocator_settings or AllocatorSettings())
    pools = Pools(model)
    requested = peak_requested = start[0]
    outside = start[1]  # allocated bytes of blocks the model never served (live at the start)
    peak_allocated = outside
    reserved = peak_reserved = start[2]
    served: set[int] = set()
    requests: list[Event] = []
    for event in trace:
        action = event.action
        if action == "alloc":
            requests.append(event)
            requested += event.size
            if requested > peak_requested:
                peak_requested = requested
            if event.pool is not pools.current:
                pools.to(event.pool)
            model.malloc(event.addr, event.size, event.stream)
            served.add(event.addr)
            if outside + model.allocated > peak_allocated:
                peak_allocated = outside + model.allocated
        elif action == "free_completed":
            requested -= event.size
            if event.addr in served:
                served.discard(event.addr)
                model.free(event.addr)
            else:
                outside -= _rounded(event.size)
        elif action in _GROW:
            reserved += event.size
            peak_reserved = max(peak_reserved, reserved)
        elif action in _SHRINK:
            reserved -= event.size
    return CardFigures(
        empty, peak_requested, peak_allocated, peak_reserved, *start, model.peak_reserved, tuple(requests)
    )
