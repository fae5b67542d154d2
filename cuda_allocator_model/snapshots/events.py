"""A device's trace read into `Event`s: a quick path in one loop where every field has its type and range,
the checks that say what is wrong elsewhere; each distinct frame and list of frames is checked once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cuda_allocator_model.constants import DEFAULT_POOL, PoolId
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
from cuda_allocator_model.snapshots.records import ACTIONS, MAX_ADDRESS, MAX_SIZE, Event, Frame

__all__ = ["Frames", "read_pool", "read_trace"]


def read_pool(raw: Mapping[Any, Any], where: str, key: str = "segment_pool_id") -> PoolId:
    pool = raw.get(key, DEFAULT_POOL)
    if pool is None:
        return DEFAULT_POOL
    if not (
        isinstance(pool, (tuple, list))
        and len(pool) == 2
        and all(type(p) is int and 0 <= p < MAX_ADDRESS for p in pool)
    ):
        raise Refuse(f"{where}: {key!r} is not a pair of whole numbers in [0, 2**64)")
    return DEFAULT_POOL if pool[0] == pool[1] == 0 else (pool[0], pool[1])


class Frames:
    """One `Frame` per distinct frame dict and one tuple per distinct list of them: a trace shares them, so
    each is checked once."""

    def __init__(self, budget: Budget) -> None:
        self.known: dict[int, Frame] = {}
        self.lists: dict[int, tuple[Frame, ...]] = {id(()): ()}  # () stands for 'frames' absent
        self.budget = budget

    def of(self, raw: object, where: str) -> tuple[Frame, ...]:
        done = self.lists.get(id(raw))
        if done is not None:
            return done
        if not isinstance(raw, list):
            raise Refuse(f"{where}: 'frames' is {article(kind_of(raw))}, not a list")
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
            raise Refuse(f"{where}: a frame is {article(kind_of(raw))}, not a dict")
        here = f"{where} frame"
        return Frame(text(raw, "name", here), text(raw, "filename", here), field(raw, "line", int, here))


def read_trace(raw: object, where: str, frames: Frames, budget: Budget) -> tuple[Event, ...]:
    """The events of one device: a quick path, in one loop, where every field has its type and range (and
    the frames were seen), else the checks that say what is wrong (and make text printable)."""
    records = record_list(raw, where, budget)
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


def _checked_event(raw: Mapping[Any, Any], where: str, frames: Frames) -> Event:
    action = field(raw, "action", str, where)
    if action not in ACTIONS:
        raise Refuse(f"{where}: unknown action {printable(action[:40])!r}")
    return Event(
        action,
        bounded(raw, "addr", where, MAX_ADDRESS, 0),
        bounded(raw, "size", where, MAX_SIZE, 0 if action == "annotate" else ...),
        bounded(raw, "stream", where, MAX_ADDRESS, 0),
        frames.of(raw.get("frames", ()), where),
        field(raw, "time_us", int, where, None),
        text(raw, "compile_context", where, None),
        text(raw, "user_metadata", where, None),
        bounded(raw, "device_free", where, MAX_SIZE, None),
        read_pool(raw, where, "pool_id"),
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
