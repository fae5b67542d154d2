"""A card's trace replayed through the allocator's model under the snapshot's own settings, and how far the
model agrees with the card, request by request.

The model starts in the state walked back from the final segments (`start.py`) and serves every `alloc`
with the card's stream; a new segment goes to the address the card's `segment_alloc` (or `segment_map`)
gave it, so that ties between equal free blocks break as they did on the card. The card's `segment_free`
(and `segment_unmap`) events release the same segments in the model: a card gives cached memory back
when the driver runs short, which depends on what else used the device; the trace says when. A run of
releases whose frames name `emptyCache` is one `empty_cache()` of the model (pages of expandable
segments included).

Pools are kept apart: each request is served in the pool its trace entry names (`pool_id`; the final
segments' `segment_pool_id` for the start), so that a private pool's blocks serve only its requests. A
private pool stays in use until an `emptyCache` release of the card names it: then the model lets it go
as a deleted MemPool (`delete_pool`), and a run of such releases that begins in a private pool is that
pool's `emptyCache(id)`, which leaves the default pool alone.

Agreement, per request: the segment decision (a new segment, or a cached block), the placement (the
address the request got) and reserved memory after it. An `oom` event is reproduced where the card's
capacity can be derived: its reserved bytes then plus `device_free`, the driver's free memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cuda_allocator_model.constants import DEFAULT_POOL, PoolId
from cuda_allocator_model.model import AllocatorOutOfMemory, CachingAllocatorModel
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.snapshots.records import Event, Snapshot
from cuda_allocator_model.snapshots.start import Pools, StartState, restore, start_state

__all__ = ["Agreement", "PoolAtEnd", "agree", "derived_capacity", "emptied_by", "pools_at_end"]

_GROW = frozenset({"segment_alloc", "segment_map"})
_SHRINK = frozenset({"segment_free", "segment_unmap"})
_INVENTED = 1 << 62  # where the model puts a segment the card did not make: above every card address


@dataclass(frozen=True)
class PoolAtEnd:
    """One pool's reserved bytes when the snapshot was taken: the card's (its final segments) and the model's."""

    pool: PoolId
    card: int
    model: int


@dataclass(frozen=True)
class Agreement:
    """How the model's replay of one device's trace agrees with the card."""

    device: int
    events: int
    requests: int
    decisions_matched: int
    new_segments: int  # the card's requests that took a new segment
    placements_matched: int
    reserved_matched: int  # requests after which the model reserves what the card does
    peak_reserved_card: int
    peak_reserved_model: int
    unallocated_at_peak: int  # the model's reserved but unallocated bytes when its reserved peaked
    releases_unmatched: int  # card segment_free events the model could not follow
    card_oom_at: int | None  # the request index of the card's first oom event
    model_oom_at: int | None  # ... and of the model's first out-of-memory
    capacity: int | None  # derived from the oom event's device_free
    start: StartState
    first_mismatch: int | None  # the first request where decision, placement or reserved differ
    pools: tuple[PoolAtEnd, ...] = ()  # where a private pool held memory: each pool's reserved bytes at the end

    @property
    def exact(self) -> bool:
        return (
            self.decisions_matched == self.requests
            and self.placements_matched == self.requests
            and self.reserved_matched == self.requests
            and self.peak_reserved_card == self.peak_reserved_model
            and self.card_oom_at == self.model_oom_at
            and all(p.card == p.model for p in self.pools)
        )


def emptied_by(event: Event) -> bool:
    """Whether a release of the card's is `torch.cuda.empty_cache()`'s (its frames name emptyCache)."""
    return any("emptyCache" in f.name for f in event.frames)


def derived_capacity(trace: tuple[Event, ...], start_reserved: int) -> int | None:
    """The reserved bytes the card could reach: its reserved bytes at the first `oom` event plus the
    driver's free bytes then; None without an oom event that carries `device_free`."""
    reserved = start_reserved
    for e in trace:
        if e.action in _GROW:
            reserved += e.size
        elif e.action in _SHRINK:
            reserved -= e.size
        elif e.action == "oom" and e.device_free is not None:
            return reserved + e.device_free
    return None


def agree(snapshot: Snapshot, device: int = 0, settings: AllocatorSettings | None = None) -> Agreement:
    """Replay `device`'s trace through the model (the snapshot's settings unless given) and count agreement."""
    trace = snapshot.trace(device)
    start = start_state(snapshot, device)
    model = CachingAllocatorModel(settings or snapshot.allocator_settings or AllocatorSettings())
    restore(model, start)
    model.place_next_segment(_INVENTED)
    model.capacity = derived_capacity(trace, start.reserved)
    agreement = _Replay(model, start).run(trace, device)
    return replace(agreement, pools=pools_at_end(snapshot, device, model))


def pools_at_end(snapshot: Snapshot, device: int, model: CachingAllocatorModel) -> tuple[PoolAtEnd, ...]:
    """Each pool's reserved bytes at the end of the trace, on the card and in the model, the default pool
    first; none where only the default pool held memory (its figures are the device's)."""
    card: dict[PoolId, int] = {}
    for s in snapshot.segments:
        if s.device == device:
            card[s.pool] = card.get(s.pool, 0) + s.total_size
    held = model.reserved_by_pool()
    pools = sorted(card.keys() | held.keys(), key=lambda pool: (pool != DEFAULT_POOL, pool))
    if pools in ([], [DEFAULT_POOL]):
        return ()
    return tuple(PoolAtEnd(pool, card.get(pool, 0), held.get(pool, 0)) for pool in pools)


class _Replay:
    """The replay loop and its counters."""

    def __init__(self, model: CachingAllocatorModel, start: StartState) -> None:
        self.model = model
        self.pools = Pools(model, (s.pool for s in start.segments))
        self.start = start
        self.card_reserved = self.peak_card = start.reserved
        self.requests = self.decisions = self.new = self.placements = self.reserved = 0
        self.releases_unmatched = 0
        self.card_oom: int | None = None
        self.model_oom: int | None = None
        self.first_mismatch: int | None = None
        self.peak_model = self.unallocated = 0

    def run(self, trace: tuple[Event, ...], device: int) -> Agreement:
        model = self.model
        pending: list[int] = []  # addresses of the segments the card made since the last request
        emptied = False  # within a run of releases that one empty_cache() made
        for e in trace:
            action = e.action
            if action in _SHRINK and emptied_by(e):
                self.card_reserved -= e.size
                self.pools.emptied(e, emptied)
                emptied = True
                continue
            emptied = False
            if action == "alloc":
                self.serve(e, pending)
                pending.clear()
            elif action == "free_completed":
                model.free(e.addr)
            elif action in _GROW:
                self.card_reserved += e.size
                self.peak_card = max(self.peak_card, self.card_reserved)
                pending.append(e.addr)
            elif action in _SHRINK:
                self.card_reserved -= e.size
                self.releases_unmatched += not self.release(e)
            elif action == "oom":
                self.oom(e)
        return Agreement(
            device, len(trace), self.requests, self.decisions, self.new, self.placements, self.reserved,
            self.peak_card, model.peak_reserved, self.unallocated, self.releases_unmatched, self.card_oom,
            self.model_oom, model.capacity, self.start, self.first_mismatch,
        )  # fmt: skip

    def serve(self, e: Event, pending: list[int]) -> None:
        model = self.model
        if e.pool is not self.pools.current:  # the default pool's entries share one tuple
            self.pools.to(e.pool)
        invented = model.next_segment_address  # where a segment the card did not make goes
        if pending:
            model.place_next_segment(pending[0])
        before_address, before_reserved = model.next_segment_address, model.reserved
        index = self.requests
        self.requests += 1
        try:
            model.malloc(e.addr, e.size, e.stream)
        except AllocatorOutOfMemory:
            model.place_next_segment(invented)
            if self.model_oom is None:
                self.model_oom = index
            self._mismatch(index)
            return
        after = model.next_segment_address
        if pending:
            model.place_next_segment(invented)
        reserved = model.reserved
        made = after != before_address or reserved > before_reserved
        if reserved > self.peak_model:
            self.peak_model = reserved
            self.unallocated = reserved - model.allocated
        decided = made == bool(pending)
        placed = model.block_address(e.addr) == e.addr
        matched = reserved == self.card_reserved
        self.new += bool(pending)
        self.decisions += decided
        self.placements += placed
        self.reserved += matched
        if not (decided and placed and matched):
            self._mismatch(index)

    def _mismatch(self, index: int) -> None:
        if self.first_mismatch is None:
            self.first_mismatch = index

    def release(self, e: Event) -> bool:
        if e.action == "segment_free":
            return self.model.release_segment_at(e.addr)
        return False  # unmapping part of an expandable segment: not followed

    def oom(self, e: Event) -> None:
        """The card ran out serving a request of `e.size` (rounded) bytes: the model should too."""
        if self.card_oom is None:
            self.card_oom = self.requests
        key = -1 - self.requests  # no card address: the request was never served
        self.pools.to(e.pool)
        try:
            self.model.malloc(key, e.size, e.stream)
        except AllocatorOutOfMemory:
            if self.model_oom is None:
                self.model_oom = self.requests
            return
        self.model.free(key)
