"""A reader of the CUDA caching allocator's memory snapshots (`torch.cuda.memory._dump_snapshot()` pickles)
into typed, frozen records, without running any code a file names.

The unpickler refuses every global (no class, no function, no reducer: a snapshot is plain dicts, lists,
tuples, strings, numbers and booleans), so a file can only describe memory, never act. Every format since
torch 2.0 reads: the keys a version added (`time_us`, `allocator_settings`, `external_annotations`,
`compile_context`, `user_metadata`, `device_free`) are optional. Anything else (not a pickle, a cut file, a
Git LFS pointer, a pickle with a global, a dict without a snapshot's shape) raises `ModelError` with one
line naming the file and what was found.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeVar

from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.settings import INTERVALS, AllocatorSettings

__all__ = [
    "ACTIONS",
    "Annotation",
    "Event",
    "Frame",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
    "format_tier",
    "read_snapshot",
    "snapshot_from_bytes",
]

ACTIONS: Final = frozenset(
    {
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
    """The snapshot in the file at `path`; ModelError (one line, naming the file) for anything else."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the snapshot ({exc.strerror or type(exc).__name__})") from None
    return snapshot_from_bytes(data, str(path))


def snapshot_from_bytes(data: bytes, name: str = "<bytes>") -> Snapshot:
    """The snapshot pickled in `data`; `name` is what error messages call it."""
    try:
        raw = _unpickle(data)
        return _snapshot(raw, name)
    except _Refuse as exc:
        raise ModelError(f"{name}: {exc}") from None


def _unpickle(data: bytes) -> Any:
    if data.startswith(_LFS_POINTER):
        raise _Refuse("a Git LFS pointer, not the snapshot it stands for (fetch it with `git lfs pull`)")
    if not data:
        raise _Refuse("an empty file, not a snapshot")
    try:
        return _NoGlobals(io.BytesIO(data)).load()
    except _Refuse:
        raise
    except EOFError:
        raise _Refuse(f"a pickle cut short after {len(data)} bytes (truncated)") from None
    except (pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError, MemoryError) as exc:
        if "truncated" in str(exc):
            raise _Refuse(f"a pickle cut short after {len(data)} bytes (truncated)") from None
        head = data[:16]
        raise _Refuse(f"not a pickle, or a damaged one ({type(exc).__name__}; starts with {head!r})") from None
    except RecursionError:
        raise _Refuse("a pickle nested too deeply to be a snapshot") from None


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


def _records(value: object, where: str) -> list[Mapping[Any, Any]]:
    if not isinstance(value, list):
        raise _Refuse(f"{where} is {_a(_kind(value))}, not a list")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _Refuse(f"{where}[{i}] is {_a(_kind(item))}, not a dict")
    return value


def _snapshot(raw: object, name: str) -> Snapshot:
    if not isinstance(raw, dict):
        raise _Refuse(f"not a memory snapshot: the pickle holds {_a(_kind(raw))}, not a dict")
    if "segments" not in raw or "device_traces" not in raw:
        keys = ", ".join(sorted(map(str, raw)))[:80] or "none"
        raise _Refuse(f"not a memory snapshot: a dict without 'segments' and 'device_traces' (keys: {keys})")
    segments = tuple(_segment(s, f"segments[{i}]") for i, s in enumerate(_records(raw["segments"], "segments")))
    traces_raw = raw["device_traces"]
    if not isinstance(traces_raw, list):
        raise _Refuse(f"'device_traces' is {_a(_kind(traces_raw))}, not a list")
    frames = _Frames()
    traces = tuple(_trace(t, f"device_traces[{d}]", frames) for d, t in enumerate(traces_raw))
    settings, conf = _settings(raw.get("allocator_settings"))
    marks = _records(raw.get("external_annotations", []), "'external_annotations'")
    annotations = tuple(_annotation(a, i) for i, a in enumerate(marks))
    tier = format_tier(raw, traces)
    return Snapshot(name, segments, traces, settings, conf, annotations, tier)


def _segment(raw: Mapping[Any, Any], where: str) -> SnapshotSegment:
    blocks = tuple(
        SnapshotBlock(
            _field(b, "address", int, f"{where}.blocks[{j}]"),
            _field(b, "size", int, f"{where}.blocks[{j}]"),
            _field(b, "requested_size", int, f"{where}.blocks[{j}]", 0),
            _field(b, "state", str, f"{where}.blocks[{j}]"),
        )
        for j, b in enumerate(_records(raw.get("blocks", []), f"{where}.blocks"))
    )
    return SnapshotSegment(
        _field(raw, "device", int, where, 0),
        _field(raw, "address", int, where),
        _field(raw, "total_size", int, where),
        _field(raw, "stream", int, where, 0),
        _field(raw, "segment_type", str, where, "large"),
        _field(raw, "is_expandable", bool, where, False),
        blocks,
    )


class _Frames:
    """One `Frame` per distinct frame dict: a trace shares its frame dicts, so each is checked once."""

    def __init__(self) -> None:
        self.known: dict[int, Frame] = {}

    def of(self, raw: object, where: str) -> tuple[Frame, ...]:
        if not isinstance(raw, list):
            raise _Refuse(f"{where}: 'frames' is {_a(_kind(raw))}, not a list")
        known = self.known
        try:
            return tuple(map(known.__getitem__, map(id, raw)))
        except KeyError:
            for frame in raw:
                if id(frame) not in known:
                    known[id(frame)] = self.frame(frame, where)
            return tuple(map(known.__getitem__, map(id, raw)))

    @staticmethod
    def frame(raw: object, where: str) -> Frame:
        if not isinstance(raw, dict):
            raise _Refuse(f"{where}: a frame is {_a(_kind(raw))}, not a dict")
        here = f"{where} frame"
        return Frame(_field(raw, "name", str, here), _field(raw, "filename", str, here), _field(raw, "line", int, here))


def _trace(raw: object, where: str, frames: _Frames) -> tuple[Event, ...]:
    return tuple(_event(e, f"{where}[{i}]", frames) for i, e in enumerate(_records(raw, where)))


def _event(raw: Mapping[Any, Any], where: str, frames: _Frames) -> Event:
    """The event `raw`: a quick path where every field has its type, else the checks that say what is wrong."""
    get = raw.get
    action, addr, size, stream = get("action"), get("addr", 0), get("size"), get("stream", 0)
    time_us, context, metadata, free = get("time_us"), get("compile_context"), get("user_metadata"), get("device_free")
    if (
        type(action) is str
        and action in ACTIONS
        and type(addr) is int
        and type(size) is int
        and type(stream) is int
        and (time_us is None or type(time_us) is int)
        and (context is None or type(context) is str)
        and (metadata is None or type(metadata) is str)
        and (free is None or type(free) is int)
    ):
        return Event(action, addr, size, stream, frames.of(get("frames", []), where), time_us, context, metadata, free)
    return _checked_event(raw, where, frames)


def _checked_event(raw: Mapping[Any, Any], where: str, frames: _Frames) -> Event:
    action = _field(raw, "action", str, where)
    if action not in ACTIONS:
        raise _Refuse(f"{where}: unknown action {action[:40]!r}")
    return Event(
        action,
        _field(raw, "addr", int, where, 0),
        _field(raw, "size", int, where),
        _field(raw, "stream", int, where, 0),
        frames.of(raw.get("frames", []), where),
        _field(raw, "time_us", int, where, None),
        _field(raw, "compile_context", str, where, None),
        _field(raw, "user_metadata", str, where, None),
        _field(raw, "device_free", int, where, None),
    )


def _annotation(raw: Mapping[Any, Any], index: int) -> Annotation:
    where = f"external_annotations[{index}]"
    return Annotation(
        _field(raw, "stage", str, where),
        _field(raw, "name", str, where),
        _field(raw, "device", int, where, 0),
        _field(raw, "time_us", int, where, 0),
    )


def _settings(raw: object) -> tuple[AllocatorSettings | None, str | None]:
    """The allocator settings a snapshot records (torch >= 2.3), from its parsed keys."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise _Refuse(f"'allocator_settings' is {_a(_kind(raw))}, not a dict")
    where = "allocator_settings"
    conf = _field(raw, "PYTORCH_CUDA_ALLOC_CONF", str, where, None)
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
    values = [raw[key] for key in sorted(raw, key=lambda k: int(k) if str(k).isdigit() else 0)]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise _Refuse("allocator_settings: 'roundup_power2_divisions' holds a value that is no whole number")
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
