"""The allocator's state when a trace's recording began, walked back from the snapshot's final `segments`.

Walking the trace backwards from the end undoes each event: an `alloc` makes its block not yet live, a
`free_completed` makes it live again (sizes in the trace are the requested bytes), a `segment_alloc` or
`segment_map` removes memory, a `segment_free` or `segment_unmap` puts it back. What is left are the
segments and the requests live at the start. Block sizes follow from the allocator's rules: in the small
pool and in expandable segments a live block is its request rounded (they split whenever 512 B remain);
in the large pool no free block is 1 MiB or smaller, so a gap of at most 1 MiB after a live block is that
block's unsplit tail. Free blocks are the gaps between live ones (free neighbours always merge).

Where this cannot be exact it says why (`StartState.caveats`): a ring buffer that wrapped (`max_entries`)
dropped the first events: newer torch says so (`trace_alloc_overflowed`), and without it a trace whose
event count is a round number may have wrapped; a block that the
walk finds inconsistent (an `alloc` of an address still live); with `max_split_size`, a live oversize
block followed by a gap (its unsplit remainder may be larger than 1 MiB).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field

from cuda_allocator_model.blocks import RestoredPiece, RestoredSegment
from cuda_allocator_model.constants import DEFAULT_POOL, SMALL_BUFFER, MiB, PoolId
from cuda_allocator_model.model import CachingAllocatorModel
from cuda_allocator_model.snapshots.records import Event, Snapshot

__all__ = ["LiveBlock", "Pools", "StartSegment", "StartState", "may_have_wrapped", "restore", "start_state"]

Run = tuple[int, int]  # (address, size) of mapped memory
RunKey = tuple[PoolId, bool, int]  # an expandable segment's pool, small pool?, stream


@dataclass(frozen=True)
class LiveBlock:
    """A request live when recording began: its address, requested bytes and stream."""

    address: int
    requested: int
    stream: int
    pool: PoolId = DEFAULT_POOL


@dataclass(frozen=True)
class StartSegment:
    """Memory the allocator held when recording began: one segment, or a mapped run of an expandable one."""

    address: int
    size: int
    small: bool
    stream: int
    expandable: bool
    pool: PoolId = DEFAULT_POOL


@dataclass(frozen=True)
class StartState:
    """The segments and live requests of one device when recording began."""

    segments: tuple[StartSegment, ...]
    live: tuple[LiveBlock, ...]
    caveats: tuple[str, ...] = field(default=())

    @property
    def empty(self) -> bool:
        return not self.segments

    @property
    def exact(self) -> bool:
        return not self.caveats

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def requested(self) -> int:
        return sum(b.requested for b in self.live)


def may_have_wrapped(count: int) -> bool:
    """Whether a trace of `count` events may be a wrapped ring buffer: `max_entries` is set by people, to
    round numbers (10,000, 100,000); a snapshot does not record it."""
    return count >= 1000 and count % 1000 == 0


def start_state(snapshot: Snapshot, device: int = 0) -> StartState:
    """The state of `device` when its recording began."""
    trace = snapshot.trace(device)
    plain: dict[int, StartSegment] = {}
    runs: dict[RunKey, list[Run]] = {}
    live: dict[int, LiveBlock | Event] = {}  # an event freed it, where the walk back made it live
    for s in snapshot.segments:
        if s.device != device:
            continue
        small = s.segment_type == "small"
        if s.is_expandable:
            runs.setdefault((s.pool, small, s.stream), []).append((s.address, s.total_size))
        else:
            plain[s.address] = StartSegment(s.address, s.total_size, small, s.stream, False, s.pool)
        for b in s.blocks:
            if b.state.startswith("active"):
                live[b.address] = LiveBlock(b.address, b.requested_size, s.stream, s.pool)
    conflicts = _walk_back(trace, plain, runs, live)
    blocks = [b if isinstance(b, LiveBlock) else LiveBlock(b.addr, b.size, b.stream, b.pool) for b in live.values()]
    caveats = []
    if snapshot.overflowed:
        caveats.append("the ring buffer wrapped (trace_alloc_overflowed): its first events were dropped")
    elif snapshot.overflowed is None and may_have_wrapped(len(trace)):
        caveats.append(f"{len(trace)} events, a round number: the ring buffer (max_entries) may have wrapped")
    if conflicts:
        caveats.append(f"{conflicts} events disagree with the final segments")
    max_split = snapshot.allocator_settings.max_split_size if snapshot.allocator_settings else None
    oversize = sum(1 for b in blocks if max_split is not None and b.requested >= max_split)
    if oversize:
        caveats.append(f"{oversize} live blocks of max_split_size or more: an unsplit remainder over 1 MiB is missed")
    segments = [*plain.values()]
    for (pool, small, stream), rs in runs.items():
        segments += [StartSegment(a, n, small, stream, True, pool) for a, n in rs]
    segments.sort(key=lambda s: s.address)
    return StartState(tuple(segments), tuple(sorted(blocks, key=lambda b: b.address)), tuple(caveats))


def _walk_back(
    trace: tuple[Event, ...],
    plain: dict[int, StartSegment],
    runs: dict[RunKey, list[Run]],
    live: dict[int, LiveBlock | Event],
) -> int:
    """Undo every event of `trace`, last first; the number of events that did not fit the state."""
    conflicts = 0
    for e in reversed(trace):
        action = e.action
        if action == "alloc":
            conflicts += live.pop(e.addr, None) is None
        elif action == "free_completed":
            conflicts += e.addr in live
            live[e.addr] = e  # most are made not live again further back: a LiveBlock for those left only
        elif action == "segment_alloc":
            conflicts += plain.pop(e.addr, None) is None
        elif action == "segment_free":
            plain[e.addr] = StartSegment(e.addr, e.size, e.size == SMALL_BUFFER, e.stream, False, e.pool)
        elif action in ("segment_map", "segment_unmap"):
            key = _run_key(runs, e)
            rest = [piece for run in runs.get(key, []) for piece in _without(run, (e.addr, e.size))]
            runs[key] = _merged(rest + ([(e.addr, e.size)] if action == "segment_unmap" else []))
    return conflicts


def _run_key(runs: dict[RunKey, list[Run]], e: Event) -> RunKey:
    """The (pool, small pool?, stream) whose expandable segment holds `e`'s address."""
    for key, rs in runs.items():
        if key[0] == e.pool and key[2] == e.stream and any(a <= e.addr < a + n for a, n in rs):
            return key
    return (e.pool, e.size <= SMALL_BUFFER and e.size % (2 * MiB) == 0 and e.size < 20 * MiB, e.stream)


def _without(run: Run, cut: Run) -> list[Run]:
    a, n = run
    c, m = cut
    out = []
    if c > a:
        out.append((a, min(n, c - a)))
    if c + m < a + n:
        start = max(a, c + m)
        out.append((start, a + n - start))
    return [r for r in out if r[1] > 0]


def _merged(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for a, n in sorted(runs):
        if out and out[-1][0] + out[-1][1] >= a:
            last = out[-1]
            out[-1] = (last[0], max(last[0] + last[1], a + n) - last[0])
        else:
            out.append((a, n))
    return out


# ------------------------------------------------------------------------------------ into the model


def restore(model: CachingAllocatorModel, state: StartState) -> None:
    """Put `state` into a fresh `model`: its segments at their addresses, in their pools, each live request
    under its address as key. Expandable runs of one pool and stream become one segment (unmapped between
    and after them)."""
    expandable: dict[RunKey, list[StartSegment]] = {}
    for s in state.segments:
        if s.expandable:
            expandable.setdefault((s.pool, s.small, s.stream), []).append(s)
        else:
            model.restore_segment(_plain(model, s, _inside(state.live, s.address, s.size)))
    for key, parts in expandable.items():
        model.restore_segment(_expandable(model, key, parts, state.live))


def _inside(live: tuple[LiveBlock, ...], address: int, size: int) -> list[LiveBlock]:
    """The live blocks (sorted by address) within [address, address + size)."""
    first = bisect_left(live, address, key=lambda b: b.address)
    last = bisect_left(live, address + size, key=lambda b: b.address)
    return list(live[first:last])


def _plain(model: CachingAllocatorModel, s: StartSegment, blocks: list[LiveBlock]) -> RestoredSegment:
    pieces: list[RestoredPiece] = []
    end = s.address + s.size
    for i, b in enumerate(blocks):
        size = model.round_size(b.requested) if b.requested else 512
        following = blocks[i + 1].address if i + 1 < len(blocks) else end
        if not s.small and 0 < following - (b.address + size) <= MiB:
            size = following - b.address  # the unsplit tail
        _gap(pieces, b.address, s.address)
        pieces.append(RestoredPiece(b.address, size, b.address, b.requested))
    _gap(pieces, end, s.address)
    return RestoredSegment(s.address, s.size, s.small, s.stream, False, s.size, tuple(pieces), s.pool)


def _gap(pieces: list[RestoredPiece], upto: int, base: int, mapped: bool = True) -> None:
    """A free piece from the end of the last piece (or `base`) to `upto`, where there is room."""
    start = pieces[-1].address + pieces[-1].size if pieces else base
    if upto > start:
        pieces.append(RestoredPiece(start, upto - start, mapped=mapped))


def _expandable(
    model: CachingAllocatorModel, key: RunKey, parts: list[StartSegment], live: tuple[LiveBlock, ...]
) -> RestoredSegment:
    pool, small, stream = key
    page = SMALL_BUFFER if small else model.settings.large_segment_size
    base = parts[0].address
    end = parts[-1].address + parts[-1].size
    vsize = max((1 << 40) // page, -(-(end - base) // page)) * page
    pieces: list[RestoredPiece] = []
    for part in parts:
        _gap(pieces, part.address, base, mapped=False)
        for b in _inside(live, part.address, part.size):
            _gap(pieces, b.address, base)
            pieces.append(RestoredPiece(b.address, model.round_size(b.requested), b.address, b.requested))
        _gap(pieces, part.address + part.size, base)
    _gap(pieces, base + vsize, base, mapped=False)
    return RestoredSegment(base, vsize, small, stream, True, page, tuple(pieces), pool)


class Pools:
    """Each request of a trace served in its own pool (`pool_id`), as under `torch.cuda.use_mem_pool` while
    the trace's requests are a private pool's. A private pool is made when first seen and stays in use (a
    trace does not say when a program let it go) until the card's `empty_cache` releases its segments:
    then it is let go as a deleted MemPool is (`delete_pool`)."""

    __slots__ = ("current", "known", "model")

    def __init__(self, model: CachingAllocatorModel, known: Iterable[PoolId] = ()) -> None:
        self.model = model
        self.current = DEFAULT_POOL
        self.known = {pool for pool in known if pool != DEFAULT_POOL}  # the model holds them, in use once

    def to(self, pool: PoolId) -> None:
        """Requests go to `pool` from now on."""
        if pool == self.current:
            return
        model = self.model
        if self.current != DEFAULT_POOL:
            model.allocate_to_pool(None)
            model.release_pool(self.current)
        if pool != DEFAULT_POOL:
            if pool not in self.known:
                model.create_pool(pool)
                self.known.add(pool)
            model.allocate_to_pool(pool)
        self.current = pool

    def emptied(self, e: Event, within: bool) -> None:
        """A release of the card's `empty_cache` (`within`: not the first of its run): the first of a run
        empties the model's cache, unless it is a private pool's (that pool's own `emptyCache(id)`, which
        leaves the default pool alone); a private pool it names is let go."""
        if e.pool == DEFAULT_POOL:
            if not within:
                self.to(DEFAULT_POOL)
                self.model.empty_cache()
        else:
            self.let_go(e.pool)

    def let_go(self, pool: PoolId) -> None:
        """The program let private pool `pool` go and emptied the cache: its cached segments are released."""
        if pool in self.known:
            self.to(DEFAULT_POOL)
            self.model.delete_pool(pool)
            self.known.discard(pool)
