"""A card's memory snapshot as typed, frozen records: its final segments and their blocks, one trace of
events per device, the profiler's annotations, and what newer torch adds (`read.py` makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NamedTuple

from cuda_allocator_model.constants import DEFAULT_POOL, PoolId
from cuda_allocator_model.settings import AllocatorSettings

__all__ = [
    "ACTIONS",
    "MAX_ADDRESS",
    "MAX_DEVICES",
    "MAX_SIZE",
    "Annotation",
    "Event",
    "Frame",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
]

ACTIONS: Final = frozenset(
    {
        "annotate",
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
    }
)
MAX_SIZE: Final = 1 << 60  # bytes: what the allocator refuses outright (torch: 1 EiB), a fit may ask near it
MAX_ADDRESS: Final = 1 << 64
MAX_DEVICES: Final = 1 << 12


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a recorded stack: a Python function or a C++ symbol (`filename` '??' or '' when unknown)."""

    name: str
    filename: str
    line: int


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """A block of a segment at the snapshot's end: `size` as the allocator counts it, `requested_size` as asked."""

    address: int
    size: int
    requested_size: int
    state: str  # active_allocated, active_pending_free, inactive
    frames: tuple[Frame, ...] = ()  # where a live block was allocated (torch 2.0: its history's last entry)


@dataclass(frozen=True, slots=True)
class SnapshotSegment:
    """A segment (one cudaMalloc, or the mapped part of an expandable segment) at the snapshot's end."""

    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str  # small or large
    is_expandable: bool
    blocks: tuple[SnapshotBlock, ...]
    pool: tuple[int, int] = (0, 0)  # segment_pool_id: (0, 0) the default pool, else a MemPool's or a graph's


class Event(NamedTuple):
    """One entry of a device's trace. `size` is the requested bytes for alloc/free, the segment's bytes for
    segment events; an `oom` has no address (0) and `device_free`, the driver's free bytes then. A named
    tuple: a trace has 100,000s of them, made six times faster than a frozen dataclass's."""

    action: str
    addr: int
    size: int
    stream: int
    frames: tuple[Frame, ...]
    time_us: int | None = None
    compile_context: str | None = None
    user_metadata: str | None = None
    device_free: int | None = None
    pool: PoolId = DEFAULT_POOL  # pool_id (torch 2.13 writes one on every entry): the pool it acted in


@dataclass(frozen=True, slots=True)
class Annotation:
    """A mark that torch's profiler hooks put in the snapshot (`Optimizer.step#AdamW.step`, START or END)."""

    stage: str
    name: str
    device: int
    time_us: int


@dataclass(frozen=True)
class Snapshot:
    """A whole snapshot: final segments, one trace per device, and what newer torch adds."""

    path: str
    segments: tuple[SnapshotSegment, ...]
    traces: tuple[tuple[Event, ...], ...]  # by device index
    allocator_settings: AllocatorSettings | None  # None: torch < 2.3 wrote none
    alloc_conf: str | None  # PYTORCH_CUDA_ALLOC_CONF as the process had it
    annotations: tuple[Annotation, ...]
    tier: str  # the format's generation, T0 (<= 2.1) to T6 (>= 2.10): see `format_tier`
    overflowed: bool | None = None  # trace_alloc_overflowed, where recorded: the ring buffer wrapped
    max_entries: int | None = None  # trace_alloc_max_entries, where recorded
    pools_inferred: bool = False  # the trace has no pool_id: its entries' pools are their segments' (`_with_pools`)

    def trace(self, device: int = 0) -> tuple[Event, ...]:
        """The events of `device` (empty when it recorded none)."""
        return self.traces[device] if device < len(self.traces) else ()
