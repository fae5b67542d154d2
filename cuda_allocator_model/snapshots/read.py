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

import contextlib
import gc
import io
import mmap
import os
import pickle
import stat
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeVar

from cuda_allocator_model.errors import ModelError, exception_text
from cuda_allocator_model.settings import DEFAULT_POOL, INTERVALS, AllocatorSettings, PoolId
from cuda_allocator_model.snapshots import pickled
from cuda_allocator_model.snapshots.pickled import Buffer

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
_LFS_POINTER: Final = b"version https://git-lfs.github.com/spec/"
_T = TypeVar("_T")


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


class _Refuse(Exception):
    """What was wrong, before the file's name is put in front."""


class _NoGlobals(pickle.Unpickler):
    """An unpickler that runs nothing: every global a pickle names is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refuse(f"a pickle that names the global {module}.{name}: refused (a snapshot holds plain data only)")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refuse("a pickle with a persistent id: refused (a snapshot holds plain data only)")


def read_snapshot(path: str | Path) -> Snapshot:
    """The snapshot in the file at `path`; ModelError (one line, naming the file) for anything else. Only a
    regular file is read (never a FIFO or a device, which could block or never end), and of it only the
    pickle, up to its STOP."""
    try:
        with collector_paused():
            with _opened(Path(path)) as data:
                raw = _unpickle(data)
            return _snapshot(raw, str(path))
    except _Refuse as exc:
        raise ModelError(f"{_printable(str(path))}: {exc}") from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ModelError(f"{_printable(str(path))}: cannot read the snapshot ({why})") from None


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Buffer]:
    """The file's bytes, mapped (pages are read only where the scan looks): a regular file only."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            kind = "a folder" if stat.S_ISDIR(mode.st_mode) else "not a regular file (a pipe, a device)"
            raise _Refuse(f"{kind}, not a snapshot")
        if mode.st_size == 0:
            raise _Refuse("an empty file, not a snapshot")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            yield mapped
    finally:
        os.close(fd)


def snapshot_from_bytes(data: bytes, name: str = "<bytes>") -> Snapshot:
    """The snapshot pickled in `data`; `name` is what error messages call it."""
    try:
        with collector_paused():
            raw = _unpickle(data)
            return _snapshot(raw, name)
    except _Refuse as exc:
        raise ModelError(f"{_printable(name)}: {exc}") from None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block: reading a trace makes a million containers
    that are not garbage, and each collection of them would walk them all again (it took 40% of
    `--against`'s time). A file's cycles, where one makes any, are collected once the block ends."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class _Loaded(NamedTuple):
    value: object
    extent: int  # the pickle's bytes: what bounds the work its lists may ask for


def _unpickle(data: Buffer) -> _Loaded:
    if data[: len(_LFS_POINTER)] == _LFS_POINTER:
        raise _Refuse("a Git LFS pointer, not the snapshot it stands for (fetch it with `git lfs pull`)")
    if not len(data):
        raise _Refuse("an empty file, not a snapshot")
    try:
        end = pickled.extent(data)
    except pickled.Refused as exc:
        raise _Refuse(str(exc)) from None
    try:
        return _Loaded(_NoGlobals(io.BytesIO(data[:end])).load(), end)
    except _Refuse:
        raise
    except EOFError:
        raise _Refuse(f"a pickle cut short after {end} bytes (truncated)") from None
    except RecursionError:
        raise _Refuse("a pickle nested too deeply to be a snapshot") from None
    except Exception as exc:  # the scan let it through; whatever the unpickler still finds wrong is damage
        if "truncated" in exception_text(exc):
            raise _Refuse(f"a pickle cut short after {end} bytes (truncated)") from None
        head = bytes(data[:16])
        raise _Refuse(f"not a pickle, or a damaged one ({type(exc).__name__}; starts with {head!r})") from None


# ------------------------------------------------------------------------------------------ checking


def _kind(value: object) -> str:
    return type(value).__name__


def _a(name: str) -> str:
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def _field(record: Mapping[Any, Any], key: str, kind: type[_T], where: str, default: Any = ...) -> _T:
    """`record[key]`, of type `kind` (bool is no int), or `default` when absent (no default: required)."""
    if key not in record:
        if default is ...:
            raise _Refuse(f"{where} has no {key!r}: not a snapshot's shape")
        return default  # type: ignore[no-any-return]
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        if default is not ... and value is None:
            return default  # type: ignore[no-any-return]
        raise _Refuse(f"{where}: {key!r} is {_a(_kind(value))}, not {_a(kind.__name__)}")
    return value


class _Budget:
    """The list items a file may make the reader visit: no more than the pickle has bytes (every item takes
    one at least), so that lists shared between devices or segments cannot multiply the work."""

    def __init__(self, extent: int) -> None:
        self.left = extent + 1024

    def spend(self, items: int, where: str) -> None:
        self.left -= items
        if self.left < 0:
            raise _Refuse(f"{where}: more items than the file's bytes can hold (lists shared between records)")


def _records(value: object, where: str, budget: _Budget) -> list[Mapping[Any, Any]]:
    if not isinstance(value, list):
        raise _Refuse(f"{where} is {_a(_kind(value))}, not a list")
    budget.spend(len(value), where)
    if any(type(item) is not dict for item in value):
        i, item = next((i, item) for i, item in enumerate(value) if not isinstance(item, dict))
        raise _Refuse(f"{where}[{i}] is {_a(_kind(item))}, not a dict")
    return value


def _printable(text: str) -> str:
    """`text` with nothing a terminal would act on: a control character becomes its picture (ESC is '␛'),
    anything else unprintable (a lone surrogate, a format character) U+FFFD."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _PICTURES.get(c, "\ufffd") for c in text)


_PICTURES: Final = {chr(i): chr(0x2400 + i) for i in range(32)} | {"\x7f": "\u2421"}


def _text(record: Mapping[Any, Any], key: str, where: str, default: Any = ...) -> str:
    value = _field(record, key, str, where, default)
    return value if value is None else _printable(value)


def _bounded(record: Mapping[Any, Any], key: str, where: str, top: int, default: Any = ...) -> int:
    """An int field within [0, top)."""
    value = _field(record, key, int, where, default)
    if value is not None and not 0 <= value < top:
        raise _Refuse(f"{where}: {key!r} is {_number(value)}, outside [0, {top:,})")
    return value


def _number(value: int) -> str:
    return f"{value:,}" if abs(value) < 1 << 128 else f"a {value.bit_length()}-bit number"


def _snapshot(loaded: _Loaded, name: str) -> Snapshot:
    raw = loaded.value
    if not isinstance(raw, dict):
        raise _Refuse(f"not a memory snapshot: the pickle holds {_a(_kind(raw))}, not a dict")
    if "segments" not in raw or "device_traces" not in raw:
        keys = _printable(", ".join(sorted(k for k in raw if type(k) is str))[:80]) or "none"
        raise _Refuse(f"not a memory snapshot: a dict without 'segments' and 'device_traces' (keys: {keys})")
    budget = _Budget(loaded.extent)
    frames = _Frames(budget)
    raw_segments = _records(raw["segments"], "segments", budget)
    segments = tuple(_segment(s, f"segments[{i}]", frames, budget) for i, s in enumerate(raw_segments))
    traces_raw = raw["device_traces"]
    if not isinstance(traces_raw, list):
        raise _Refuse(f"'device_traces' is {_a(_kind(traces_raw))}, not a list")
    budget.spend(len(traces_raw), "'device_traces'")
    _not_shared(traces_raw, "device_traces")
    traces = tuple(_trace(t, f"device_traces[{d}]", frames, budget) for d, t in enumerate(traces_raw))
    inferred = any(s.pool != DEFAULT_POOL for s in segments) and not any("pool_id" in e for t in traces_raw for e in t)
    if inferred:
        traces = tuple(_with_pools(trace, segments, d) for d, trace in enumerate(traces))
    settings, conf = _settings(raw.get("allocator_settings"))
    marks = _records(raw.get("external_annotations", []), "'external_annotations'", budget)
    annotations = tuple(_annotation(a, i) for i, a in enumerate(marks))
    tier = format_tier(raw, traces)
    overflowed = _field(raw, "trace_alloc_overflowed", bool, "the snapshot", None)
    max_entries = _field(raw, "trace_alloc_max_entries", int, "the snapshot", None)
    return Snapshot(
        _printable(name), segments, traces, settings, conf, annotations, tier, overflowed, max_entries, inferred
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
            raise _Refuse(f"{where}[{i}] is the very list of {where}[{seen[id(item)]}]: no snapshot's shape")


def _pool(raw: Mapping[Any, Any], where: str, key: str = "segment_pool_id") -> PoolId:
    pool = raw.get(key, DEFAULT_POOL)
    if pool is None:
        return DEFAULT_POOL
    if not (
        isinstance(pool, (tuple, list))
        and len(pool) == 2
        and all(type(p) is int and 0 <= p < MAX_ADDRESS for p in pool)
    ):
        raise _Refuse(f"{where}: {key!r} is not a pair of whole numbers in [0, 2**64)")
    return DEFAULT_POOL if pool[0] == pool[1] == 0 else (pool[0], pool[1])


def _segment(raw: Mapping[Any, Any], where: str, frames: _Frames, budget: _Budget) -> SnapshotSegment:
    address = _bounded(raw, "address", where, MAX_ADDRESS)
    total = _bounded(raw, "total_size", where, MAX_SIZE)
    blocks = []
    at = address  # torch 2.0's blocks carry no address: they lie in order from the segment's start
    for j, b in enumerate(_records(raw.get("blocks", []), f"{where}.blocks", budget)):
        block = _block(b, f"{where}.blocks[{j}]", at, frames)
        if not address <= block.address <= block.address + block.size <= address + total:
            raise _Refuse(f"{where}.blocks[{j}] lies outside its segment ({block.size:,} bytes at {block.address:#x})")
        blocks.append(block)
        at = block.address + block.size
    return SnapshotSegment(
        _bounded(raw, "device", where, MAX_DEVICES, 0),
        address,
        total,
        _bounded(raw, "stream", where, MAX_ADDRESS, 0),
        _text(raw, "segment_type", where, "large"),
        _field(raw, "is_expandable", bool, where, False),
        tuple(blocks),
        _pool(raw, where),
    )


def _block(raw: Mapping[Any, Any], where: str, at: int, frames: _Frames) -> SnapshotBlock:
    history = raw.get("history")
    last = history[-1] if isinstance(history, list) and history and isinstance(history[-1], dict) else {}
    requested = _bounded(raw, "requested_size", where, MAX_SIZE, None)
    if requested is None:
        requested = _bounded(last, "real_size", f"{where}.history", MAX_SIZE, 0)
    stack = raw["frames"] if "frames" in raw else last.get("frames", [])
    return SnapshotBlock(
        _bounded(raw, "address", where, MAX_ADDRESS, at),
        _bounded(raw, "size", where, MAX_SIZE),
        requested,
        _text(raw, "state", where),
        frames.of(stack, where),
    )


class _Frames:
    """One `Frame` per distinct frame dict and one tuple per distinct list of them: a trace shares them, so
    each is checked once."""

    def __init__(self, budget: _Budget) -> None:
        self.known: dict[int, Frame] = {}
        self.lists: dict[int, tuple[Frame, ...]] = {id(()): ()}  # () stands for 'frames' absent
        self.budget = budget

    def of(self, raw: object, where: str) -> tuple[Frame, ...]:
        done = self.lists.get(id(raw))
        if done is not None:
            return done
        if not isinstance(raw, list):
            raise _Refuse(f"{where}: 'frames' is {_a(_kind(raw))}, not a list")
        self.budget.spend(len(raw), f"{where}: 'frames'")
        known = self.known
        try:
            stack = tuple(map(known.__getitem__, map(id, raw)))
        except KeyError:  # frames not seen before: checked once each
            for frame in raw:
                if id(frame) not in known:
                    known[id(frame)] = self.frame(frame, where)
            stack = tuple(map(known.__getitem__, map(id, raw)))
        self.lists[id(raw)] = stack
        return stack

    @staticmethod
    def frame(raw: object, where: str) -> Frame:
        if not isinstance(raw, dict):
            raise _Refuse(f"{where}: a frame is {_a(_kind(raw))}, not a dict")
        here = f"{where} frame"
        return Frame(_text(raw, "name", here), _text(raw, "filename", here), _field(raw, "line", int, here))


def _trace(raw: object, where: str, frames: _Frames, budget: _Budget) -> tuple[Event, ...]:
    """The events of one device: a quick path, in one loop, where every field has its type and range (and
    the frames were seen), else the checks that say what is wrong (and make text printable)."""
    records = _records(raw, where, budget)
    known = frames.lists
    out: list[Event] = []
    append = out.append
    # the loop's names bound here: a global's lookup per event and field costs as much as its check
    make, event, actions, top_address, top_size = tuple.__new__, Event, ACTIONS, MAX_ADDRESS, MAX_SIZE
    default = DEFAULT_POOL
    for i, record in enumerate(records):
        get = record.get
        action, addr, size, stream = get("action"), get("addr", 0), get("size"), get("stream", 0)
        time_us, context, metadata = get("time_us"), get("compile_context"), get("user_metadata")
        free, stack_raw, pool = get("device_free"), get("frames", ()), get("pool_id", default)
        stack = known.get(id(stack_raw))
        if stack is None:  # a list of frames not seen before
            stack = frames.of(stack_raw, f"{where}[{i}]")
        if pool is not default:  # written by newer torch, or absent
            if pool is None or pool == default:
                pool = default
            elif not _a_pool(pool):
                pool = None  # the checks below say what is wrong
        if (
            type(action) is str
            and action in actions
            and type(addr) is int
            and type(size) is int
            and type(stream) is int
            and 0 <= addr < top_address
            and 0 <= size < top_size
            and 0 <= stream < top_address
            and (time_us is None or type(time_us) is int)
            and (context is None or (type(context) is str and context.isprintable()))
            and (metadata is None or (type(metadata) is str and metadata.isprintable()))
            and (free is None or (type(free) is int and 0 <= free < top_size))
            and pool is not None
        ):  # tuple.__new__: Event's own __new__ is a Python function, one call more per event
            append(make(event, (action, addr, size, stream, stack, time_us, context, metadata, free, pool)))
        else:
            append(_checked_event(record, f"{where}[{i}]", frames))
    return tuple(out)


def _checked_event(raw: Mapping[Any, Any], where: str, frames: _Frames) -> Event:
    action = _field(raw, "action", str, where)
    if action not in ACTIONS:
        raise _Refuse(f"{where}: unknown action {_printable(action[:40])!r}")
    return Event(
        action,
        _bounded(raw, "addr", where, MAX_ADDRESS, 0),
        _bounded(raw, "size", where, MAX_SIZE, 0 if action == "annotate" else ...),
        _bounded(raw, "stream", where, MAX_ADDRESS, 0),
        frames.of(raw.get("frames", ()), where),
        _field(raw, "time_us", int, where, None),
        _text(raw, "compile_context", where, None),
        _text(raw, "user_metadata", where, None),
        _bounded(raw, "device_free", where, MAX_SIZE, None),
        _pool(raw, where, "pool_id"),
    )


def _a_pool(value: object) -> bool:
    """Whether `value` is a private pool's id as torch pickles it: a tuple of two whole numbers."""
    return (
        type(value) is tuple
        and len(value) == 2
        and type(value[0]) is int
        and type(value[1]) is int
        and 0 <= value[0] < MAX_ADDRESS
        and 0 <= value[1] < MAX_ADDRESS
    )


def _annotation(raw: Mapping[Any, Any], index: int) -> Annotation:
    where = f"external_annotations[{index}]"
    return Annotation(
        _text(raw, "stage", where),
        _text(raw, "name", where),
        _bounded(raw, "device", where, MAX_DEVICES, 0),
        _field(raw, "time_us", int, where, 0),
    )


def _settings(raw: object) -> tuple[AllocatorSettings | None, str | None]:
    """The allocator settings a snapshot records (torch >= 2.3), from its parsed keys."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise _Refuse(f"'allocator_settings' is {_a(_kind(raw))}, not a dict")
    where = "allocator_settings"
    conf = _text(raw, "PYTORCH_CUDA_ALLOC_CONF", where, None)
    max_split = _field(raw, "max_split_size", int, where, -1)
    divisions_raw = _field(raw, "roundup_power2_divisions", dict, where, {})
    divisions = tuple(_divisions(divisions_raw))
    try:
        settings = AllocatorSettings(
            max_split_size=None if max_split < 0 or max_split >= (1 << 63) else max_split,
            roundup_power2_divisions=divisions,
            expandable_segments=_field(raw, "expandable_segments", bool, where, False),
        )
    except ModelError as exc:
        raise _Refuse(f"allocator_settings: {exc}") from None
    return settings, conf


def _divisions(raw: Mapping[Any, Any]) -> Sequence[int]:
    """Divisions per power-of-two interval, in torch's order ('1' MiB, '2', ... '32768'); () for none."""
    where = "allocator_settings: 'roundup_power2_divisions'"
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 6):
            shown = _printable(key[:20]) if isinstance(key, str) else _kind(key)
            raise _Refuse(f"{where} has the key {shown!r}, not a power of two in MiB")
        if type(value) is not int or not 0 <= value <= 1 << 16:
            raise _Refuse(f"{where}[{key!r}] is not a whole number of divisions in [0, 65536]")
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
