"""A snapshot's final state, where it holds no trace of requests (`_record_memory_history(True)`, or
`torch.cuda.memory._snapshot()` in an out-of-memory handler): what held the memory, and whether another
setting or card would have held the live blocks.

Per device and pool: reserved (the segments), allocated (the live blocks as the allocator counts them),
requested (as asked), and what is cached but free, split into whole free segments (what
`torch.cuda.empty_cache()` gives back) and free blocks beside live ones (fragmentation), with the largest
free block (the most one request gets without a new segment). The live blocks by the first user frame that
allocated them and by size. The what-ifs: the live blocks allocated again, in address order, on an empty
cache under each setting and capacity (`whatif.what_if` from a start state of the final segments).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuda_allocator_model.constants import DEFAULT_POOL
from cuda_allocator_model.sizes import format_size
from cuda_allocator_model.snapshots.records import Snapshot, SnapshotSegment
from cuda_allocator_model.snapshots.start import LiveBlock, StartSegment, StartState
from cuda_allocator_model.snapshots.whatif import frames_user_frame

__all__ = ["Holder", "PoolState", "final_devices", "held_by", "pools", "start_of", "untraced"]

_LIVE = ("active_allocated", "active_pending_free", "active_awaiting_free")
SIZE_CLASSES = ((1 << 20, "up to 1 MiB"), (10 << 20, "1-10 MiB"), (100 << 20, "10-100 MiB"), (1 << 30, "0.1-1 GiB"))


@dataclass(frozen=True)
class PoolState:
    """One pool's memory on one device at the snapshot's end (bytes)."""

    device: int
    pool: tuple[int, int]
    segments: int
    reserved: int
    allocated: int
    requested: int
    free_segments: int  # whole segments without a live block: empty_cache() gives them back
    free_between: int  # free blocks in segments that hold a live block: fragmentation
    largest_free: int
    live_blocks: int

    @property
    def private(self) -> bool:
        return self.pool != DEFAULT_POOL


@dataclass(frozen=True)
class Holder:
    """Live blocks grouped by what allocated them (a user frame) or by size class."""

    name: str
    blocks: int
    size: int


def untraced(snapshot: Snapshot) -> bool:
    """Whether the snapshot is a final state only: no device's trace holds a request."""
    return bool(snapshot.segments) and not any(e.action == "alloc" for trace in snapshot.traces for e in trace)


def final_devices(snapshot: Snapshot) -> list[int]:
    return sorted({s.device for s in snapshot.segments})


def _live(segment: SnapshotSegment) -> list[int]:
    return [i for i, b in enumerate(segment.blocks) if b.state in _LIVE]


def pools(snapshot: Snapshot, device: int) -> list[PoolState]:
    """Each pool of `device`, the default pool first."""
    grouped: dict[tuple[int, int], list[SnapshotSegment]] = defaultdict(list)
    for s in snapshot.segments:
        if s.device == device:
            grouped[s.pool].append(s)
    out = []
    for pool in sorted(grouped, key=lambda p: (p != DEFAULT_POOL, p)):
        segments = grouped[pool]
        live = [b for s in segments for b in s.blocks if b.state in _LIVE]
        empty = [s for s in segments if not _live(s)]
        free_between = [b.size for s in segments if _live(s) for b in s.blocks if b.state not in _LIVE]
        free_blocks = [b.size for s in segments for b in s.blocks if b.state not in _LIVE]
        reserved = sum(s.total_size for s in segments)
        allocated, requested = sum(b.size for b in live), sum(b.requested_size for b in live)
        whole_free = sum(s.total_size for s in empty)
        largest = max(free_blocks, default=0)
        figures = (reserved, allocated, requested, whole_free, sum(free_between), largest, len(live))
        out.append(PoolState(device, pool, len(segments), *figures))
    return out


def held_by(snapshot: Snapshot, device: int, top: int = 10) -> tuple[list[Holder], list[Holder]]:
    """The live blocks of `device` by first user frame (the `top` largest) and by size class."""
    frames: dict[str, list[int]] = defaultdict(list)
    sizes: dict[str, list[int]] = defaultdict(list)
    for s in snapshot.segments:
        if s.device != device:
            continue
        for b in s.blocks:
            if b.state in _LIVE:
                frames[frames_user_frame(b.frames)].append(b.size)
                sizes[_size_class(b.size)].append(b.size)
    by_frame = sorted((Holder(n, len(v), sum(v)) for n, v in frames.items()), key=lambda h: (-h.size, h.name))
    order = [name for _, name in SIZE_CLASSES] + ["over 1 GiB"]
    by_size = [Holder(n, len(sizes[n]), sum(sizes[n])) for n in order if n in sizes]
    return by_frame[:top], by_size


def _size_class(size: int) -> str:
    return next((name for bound, name in SIZE_CLASSES if size <= bound), "over 1 GiB")


def start_of(snapshot: Snapshot, device: int) -> StartState:
    """The final state as a start state: its segments, and its live blocks to be allocated again."""
    segments, live = [], []
    for s in snapshot.segments:
        if s.device != device:
            continue
        small = s.segment_type == "small"
        segments.append(StartSegment(s.address, s.total_size, small, s.stream, s.is_expandable, s.pool))
        held = [b for b in s.blocks if b.state in _LIVE]
        live += [LiveBlock(b.address, b.requested_size or b.size, s.stream, s.pool) for b in held]
    segments.sort(key=lambda s: s.address)
    live.sort(key=lambda b: b.address)
    return StartState(tuple(segments), tuple(live))


def without_trace(snapshot: Snapshot) -> Snapshot:
    """The snapshot with no trace: a what-if then serves the live blocks only."""
    return dataclasses.replace(snapshot, traces=())


def pool_name(pool: tuple[int, int]) -> str:
    return "default pool" if pool == DEFAULT_POOL else f"private pool {pool}"


def totals(states: Sequence[PoolState]) -> PoolState:
    """All pools of a device as one."""
    first = states[0]
    return PoolState(
        first.device, DEFAULT_POOL, sum(p.segments for p in states), sum(p.reserved for p in states),
        sum(p.allocated for p in states), sum(p.requested for p in states), sum(p.free_segments for p in states),
        sum(p.free_between for p in states), max(p.largest_free for p in states), sum(p.live_blocks for p in states),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ rendering


def _mib(n: int) -> str:
    return format_size(n)


def state_lines(state: PoolState, name: str) -> list[str]:
    cached = state.reserved - state.allocated
    return [
        f"  {name}: reserved {_mib(state.reserved)} in {state.segments} segments; allocated {_mib(state.allocated)} "
        f"in {state.live_blocks} live blocks (requested {_mib(state.requested)})",
        f"    free in the cache {_mib(cached)}: {_mib(state.free_segments)} whole segments (empty_cache frees them), "
        f"{_mib(state.free_between)} beside live blocks (fragmentation), largest {_mib(state.largest_free)}",
    ]


def holder_lines(title: str, holders: Sequence[Holder]) -> list[str]:
    lines = [f"  {title}:", f"  {'bytes':>12} {'blocks':>7}  what"]
    lines += [f"  {_mib(h.size):>12} {h.blocks:>7}  {h.name}" for h in holders]
    return lines


def state_json(state: PoolState) -> dict[str, Any]:
    return {
        "pool": list(state.pool), "segments": state.segments, "reserved": state.reserved,
        "allocated": state.allocated, "requested": state.requested, "free_segments": state.free_segments,
        "free_between_live_blocks": state.free_between, "largest_free_block": state.largest_free,
        "live_blocks": state.live_blocks,
    }  # fmt: skip


def holders_json(holders: Sequence[Holder]) -> list[dict[str, Any]]:
    return [{"what": h.name, "blocks": h.blocks, "bytes": h.size} for h in holders]
