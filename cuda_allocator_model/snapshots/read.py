"""A reader of the CUDA caching allocator's memory snapshots (`torch.cuda.memory._dump_snapshot()` pickles)
into typed, frozen records, without running any code a file names.

The unpickler refuses every global (no class, no function, no reducer: a snapshot is plain dicts, lists,
tuples, strings, numbers and booleans), so a file can only describe memory, never act. Every format since
torch 2.0 reads: the keys a version added (`time_us`, `allocator_settings`, `external_annotations`,
`compile_context`, `user_metadata`, `device_free`, `segment_pool_id`, `pool_id`) are optional. Anything
else (not a pickle, a cut file, a Git LFS pointer, a pickle with a global, a dict without a snapshot's
shape) raises `ModelError` with one line naming the file and what was found.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from cuda_allocator_model.constants import DEFAULT_POOL, INTERVALS
from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.snapshots.events import Frames, read_pool, read_trace
from cuda_allocator_model.snapshots.fields import (
    Budget,
    Refuse,
    article,
    bounded,
    field,
    kind_of,
    printable,
    record_list,
    text,
)
from cuda_allocator_model.snapshots.records import (
    ACTIONS,
    MAX_ADDRESS,
    MAX_DEVICES,
    MAX_SIZE,
    Annotation,
    Event,
    Frame,
    Snapshot,
    SnapshotBlock,
    SnapshotSegment,
)
from cuda_allocator_model.snapshots.unpickle import Loaded, collector_paused, opened, unpickle

__all__ = [
    "ACTIONS",
    "DEFAULT_POOL",
    "MAX_SIZE",
    "Annotation",
    "Event",
    "Frame",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
    "collector_paused",
    "format_tier",
    "read_snapshot",
    "snapshot_from_bytes",
]


def read_snapshot(path: str | Path) -> Snapshot:
    """The snapshot in the file at `path`; ModelError (one line, naming the file) for anything else. Only a
    regular file is read (never a FIFO or a device, which could block or never end), and of it only the
    pickle, up to its STOP."""
    try:
        with collector_paused():
            with opened(Path(path)) as data:
                raw = unpickle(data)
            return _snapshot(raw, str(path))
    except Refuse as exc:
        raise ModelError(f"{printable(str(path))}: {exc}") from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ModelError(f"{printable(str(path))}: cannot read the snapshot ({why})") from None


def snapshot_from_bytes(data: bytes, name: str = "<bytes>") -> Snapshot:
    """The snapshot pickled in `data`; `name` is what error messages call it."""
    try:
        with collector_paused():
            raw = unpickle(data)
            return _snapshot(raw, name)
    except Refuse as exc:
        raise ModelError(f"{printable(name)}: {exc}") from None


def _snapshot(loaded: Loaded, name: str) -> Snapshot:
    raw = loaded.value
    if not isinstance(raw, dict):
        raise Refuse(f"not a memory snapshot: the pickle holds {article(kind_of(raw))}, not a dict")
    if "segments" not in raw or "device_traces" not in raw:
        keys = printable(", ".join(sorted(k for k in raw if type(k) is str))[:80]) or "none"
        raise Refuse(f"not a memory snapshot: a dict without 'segments' and 'device_traces' (keys: {keys})")
    budget = Budget(loaded.extent)
    frames = Frames(budget)
    raw_segments = record_list(raw["segments"], "segments", budget)
    segments = tuple(_segment(s, f"segments[{i}]", frames, budget) for i, s in enumerate(raw_segments))
    traces_raw = raw["device_traces"]
    if not isinstance(traces_raw, list):
        raise Refuse(f"'device_traces' is {article(kind_of(traces_raw))}, not a list")
    budget.spend(len(traces_raw), "'device_traces'")
    _not_shared(traces_raw, "device_traces")
    traces = tuple(read_trace(t, f"device_traces[{d}]", frames, budget) for d, t in enumerate(traces_raw))
    inferred = any(s.pool != DEFAULT_POOL for s in segments) and not any("pool_id" in e for t in traces_raw for e in t)
    if inferred:
        traces = tuple(_with_pools(trace, segments, d) for d, trace in enumerate(traces))
    settings, conf = _settings(raw.get("allocator_settings"))
    marks = record_list(raw.get("external_annotations", []), "'external_annotations'", budget)
    annotations = tuple(_annotation(a, i) for i, a in enumerate(marks))
    tier = format_tier(raw, traces)
    overflowed = field(raw, "trace_alloc_overflowed", bool, "the snapshot", None)
    max_entries = field(raw, "trace_alloc_max_entries", int, "the snapshot", None)
    return Snapshot(
        printable(name), segments, traces, settings, conf, annotations, tier, overflowed, max_entries, inferred
    )


def _with_pools(trace: tuple[Event, ...], segments: tuple[SnapshotSegment, ...], device: int) -> tuple[Event, ...]:
    """The trace of a torch that wrote no `pool_id`, each entry in the pool of the final segment holding its
    address, from the segment's last `segment_alloc` on (before it, that memory was another segment's,
    given back, whose pool the trace does not say: the default pool's). An expandable segment's address
    space is its pool's throughout; its pages unmapped by the end are read as the default pool's."""
    private = sorted((s.address, s.address + s.total_size, s.pool, s.is_expandable) for s in segments
                     if s.device == device and s.pool != DEFAULT_POOL)  # fmt: skip
    starts = [p[0] for p in private]
    born = {start: 0 for start, _, _, expandable in private if not expandable}
    for i, e in enumerate(trace):
        if e.action == "segment_alloc" and e.addr in born:
            born[e.addr] = i
    out = list(trace)
    for i, e in enumerate(trace):
        j = bisect_right(starts, e.addr) - 1
        if j < 0:
            continue
        start, end, pool, expandable = private[j]
        if e.addr < end and (expandable or i >= born[start]):
            out[i] = e._replace(pool=pool)
    return tuple(out)


def _not_shared(lists: list[Any], where: str) -> None:
    """Each device's trace is its own list: one list under many devices is damage, or a file's trick."""
    seen: dict[int, int] = {}
    for i, item in enumerate(lists):
        if isinstance(item, list) and item and seen.setdefault(id(item), i) != i:
            raise Refuse(f"{where}[{i}] is the very list of {where}[{seen[id(item)]}]: no snapshot's shape")


def _segment(raw: Mapping[Any, Any], where: str, frames: Frames, budget: Budget) -> SnapshotSegment:
    address = bounded(raw, "address", where, MAX_ADDRESS)
    total = bounded(raw, "total_size", where, MAX_SIZE)
    blocks = []
    at = address  # torch 2.0's blocks carry no address: they lie in order from the segment's start
    for j, b in enumerate(record_list(raw.get("blocks", []), f"{where}.blocks", budget)):
        block = _block(b, f"{where}.blocks[{j}]", at, frames)
        if not address <= block.address <= block.address + block.size <= address + total:
            raise Refuse(f"{where}.blocks[{j}] lies outside its segment ({block.size:,} bytes at {block.address:#x})")
        blocks.append(block)
        at = block.address + block.size
    return SnapshotSegment(
        bounded(raw, "device", where, MAX_DEVICES, 0),
        address,
        total,
        bounded(raw, "stream", where, MAX_ADDRESS, 0),
        text(raw, "segment_type", where, "large"),
        field(raw, "is_expandable", bool, where, False),
        tuple(blocks),
        read_pool(raw, where),
    )


def _block(raw: Mapping[Any, Any], where: str, at: int, frames: Frames) -> SnapshotBlock:
    history = raw.get("history")
    last = history[-1] if isinstance(history, list) and history and isinstance(history[-1], dict) else {}
    requested = bounded(raw, "requested_size", where, MAX_SIZE, None)
    if requested is None:
        requested = bounded(last, "real_size", f"{where}.history", MAX_SIZE, 0)
    stack = raw["frames"] if "frames" in raw else last.get("frames", [])
    return SnapshotBlock(
        bounded(raw, "address", where, MAX_ADDRESS, at),
        bounded(raw, "size", where, MAX_SIZE),
        requested,
        text(raw, "state", where),
        frames.of(stack, where),
    )


def _annotation(raw: Mapping[Any, Any], index: int) -> Annotation:
    where = f"external_annotations[{index}]"
    return Annotation(
        text(raw, "stage", where),
        text(raw, "name", where),
        bounded(raw, "device", where, MAX_DEVICES, 0),
        field(raw, "time_us", int, where, 0),
    )


def _settings(raw: object) -> tuple[AllocatorSettings | None, str | None]:
    """The allocator settings a snapshot records (torch >= 2.3), from its parsed keys."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise Refuse(f"'allocator_settings' is {article(kind_of(raw))}, not a dict")
    where = "allocator_settings"
    conf = text(raw, "PYTORCH_CUDA_ALLOC_CONF", where, None)
    max_split = field(raw, "max_split_size", int, where, -1)
    divisions_raw = field(raw, "roundup_power2_divisions", dict, where, {})
    divisions = tuple(_divisions(divisions_raw))
    try:
        settings = AllocatorSettings(
            max_split_size=None if max_split < 0 or max_split >= (1 << 63) else max_split,
            roundup_power2_divisions=divisions,
            expandable_segments=field(raw, "expandable_segments", bool, where, False),
        )
    except ModelError as exc:
        raise Refuse(f"allocator_settings: {exc}") from None
    return settings, conf


def _divisions(raw: Mapping[Any, Any]) -> Sequence[int]:
    """Divisions per power-of-two interval, in torch's order ('1' MiB, '2', ... '32768'); () for none."""
    where = "allocator_settings: 'roundup_power2_divisions'"
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 6):
            shown = printable(key[:20]) if isinstance(key, str) else kind_of(key)
            raise Refuse(f"{where} has the key {shown!r}, not a power of two in MiB")
        if type(value) is not int or not 0 <= value <= 1 << 16:
            raise Refuse(f"{where}[{key!r}] is not a whole number of divisions in [0, 65536]")
    values = [raw[key] for key in sorted(raw, key=int)]
    return values[:INTERVALS] if any(values) else ()


_TIER_KEYS: Final[tuple[tuple[str, Callable[[Mapping[Any, Any], tuple[tuple[Event, ...], ...]], bool]], ...]] = (
    ("T6", lambda raw, traces: any(e.user_metadata is not None for t in traces for e in t)),
    ("T5", lambda raw, traces: "graph_capture_record_stream_reuse" in (raw.get("allocator_settings") or {})),
    ("T4", lambda raw, traces: any(e.compile_context is not None for t in traces for e in t)),
    ("T3", lambda raw, traces: "external_annotations" in raw),
    ("T2", lambda raw, traces: "allocator_settings" in raw),
    ("T1", lambda raw, traces: any(e.time_us is not None for t in traces for e in t)),
)


def format_tier(raw: Mapping[Any, Any], traces: tuple[tuple[Event, ...], ...]) -> str:
    """The snapshot format's generation from the keys it has: T6 `user_metadata` (torch >= 2.10), T5
    `graph_capture_record_stream_reuse` (~2.9), T4 `compile_context` (~2.7-2.8), T3 `external_annotations`
    (~2.6), T2 `allocator_settings` (~2.3-2.5), T1 `time_us` (~2.1-2.2), else T0 (2.0-2.1)."""
    return next((tier for tier, has in _TIER_KEYS if has(raw, traces)), "T0")
