"""The allocator model's data: segments, blocks, the pools' free lists and counters; merges, invariants.

Pools (`get_pool`, `PrivatePool`): the default pool is a small and a large `Pool`; each private pool (a
`MemPool`, a CUDA graph's) has a small and a large `Pool` of its own. A segment belongs to one `Pool`, its
blocks serve only that pool's requests, and its free blocks are in only that pool's lists.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Final

from cuda_allocator_model.constants import DEFAULT_POOL, UNLIMITED, PoolId
from cuda_allocator_model.settings import AllocatorSettings

# A pool keeps one sorted list of free blocks per stream; a block's place in it is one int, (size,
# address) in that order of significance (ints compare far faster than tuples): with the stream first,
# torch's BlockComparatorSize order.
SIZE_SHIFT: Final = 64
SPARE_BLOCKS: Final = 256  # block objects kept for reuse: splits and merges come in pairs
ROUNDED_KEPT: Final = 4096  # rounded request sizes kept (with power-of-two divisions), then cleared


class Segment:
    """One cudaMalloc, or one expandable segment's address space."""

    __slots__ = ("base", "blocks", "expandable", "free", "head", "page", "pool", "small", "stream", "vsize")

    def __init__(self, base: int, vsize: int, pool: Pool, stream: int, expandable: bool, page: int) -> None:
        self.base = base
        self.vsize = vsize
        self.pool = pool  # the pool whose requests its blocks serve
        self.small = pool.small
        self.stream = stream
        self.free = pool.stream_list(stream)  # its stream's free list in its pool: made with its first segment
        self.blocks = pool.blocks
        self.expandable = expandable
        self.page = page
        self.head: Block | None = None  # the block at the lowest address


class Block:
    """A piece of a segment: handed out, cached free, or (expandable segments) unmapped address space."""

    __slots__ = ("addr", "allocated", "key", "mapped", "next", "prev", "requested", "seg", "size")

    def __init__(self, addr: int, size: int, seg: Segment) -> None:
        self.addr = addr
        self.size = size
        self.seg = seg
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = True
        self.requested = 0
        self.key = 0  # (size, address) while in a free list


class Pool:
    """The small or the large pool (`BlockPool`) of the default pool or of a private one: its cached free
    blocks and (expandable segments) unmapped ranges, one sorted list per stream."""

    __slots__ = ("blocks", "free", "no_split", "owner", "segments", "small", "unmapped", "unmapped_blocks")

    def __init__(self, small: bool, owner: PrivatePool | None = None) -> None:
        self.small = small
        self.owner = owner  # None: the default pool
        self.no_split = owner is not None and owner.no_split  # a block of it is handed out whole
        self.segments = 0  # how many segments it holds
        self.free: dict[int, list[int]] = {}  # stream -> sorted keys of its mapped free blocks
        self.blocks: dict[int, Block] = {}  # key -> free block
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of its unmapped blocks
        self.unmapped_blocks: dict[int, Block] = {}  # address -> unmapped block

    def stream_list(self, stream: int) -> list[int]:
        free = self.free.get(stream)
        if free is None:
            free = self.free[stream] = []
        return free

    def add(self, block: Block) -> None:
        key = block.key = (block.size << SIZE_SHIFT) | block.addr
        insort(self.stream_list(block.seg.stream), key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = block.key
        free = self.free[block.seg.stream]
        del free[bisect_left(free, key)]
        del self.blocks[key]

    def add_unmapped(self, block: Block) -> None:
        unmapped = self.unmapped.get(block.seg.stream)
        if unmapped is None:
            unmapped = self.unmapped[block.seg.stream] = []
        insort(unmapped, block.addr)
        self.unmapped_blocks[block.addr] = block

    def remove_unmapped(self, block: Block) -> None:
        unmapped = self.unmapped[block.seg.stream]
        del unmapped[bisect_left(unmapped, block.addr)]
        del self.unmapped_blocks[block.addr]


class PrivatePool:
    """A `MemPool`'s or a CUDA graph's pool (`PrivatePool`): its own small and large pools; `use_count`
    users (the MemPool object, each graph, each `use_mem_pool` underway); at 0 `empty_cache` may release its
    cached segments. `use_on_oom`: its cached blocks serve a default-pool request that found no memory;
    `no_split`: a block of it is never split."""

    __slots__ = ("id", "large", "no_split", "small", "use_count", "use_on_oom")

    def __init__(self, pool_id: PoolId, use_on_oom: bool = False, no_split: bool = False) -> None:
        self.id = pool_id
        self.use_count = 1
        self.use_on_oom = use_on_oom
        self.no_split = no_split
        self.small = Pool(small=True, owner=self)
        self.large = Pool(small=False, owner=self)


@dataclass(frozen=True, slots=True)
class RestoredPiece:
    """A block of a restored segment: live (`key` set), cached free, or unmapped address space."""

    address: int
    size: int
    key: int | None = None
    requested: int = 0
    mapped: bool = True


@dataclass(frozen=True, slots=True)
class RestoredSegment:
    """A segment as a card held it: `pieces` tile [base, base + vsize) in address order."""

    base: int
    vsize: int
    small: bool
    stream: int
    expandable: bool
    page: int
    pieces: tuple[RestoredPiece, ...]
    pool: PoolId = DEFAULT_POOL


class AllocatorState:
    """What the caching allocator holds for one device: its settings, pools, segments and live blocks,
    and torch's counters (plain attributes, to be read, not written)."""

    __slots__ = (
        "_default_large",
        "_default_small",
        "_divided",
        "_expandable",
        "_freeable",
        "_large",
        "_large_segment",
        "_lenders",
        "_live",
        "_max_split",
        "_next_address",
        "_oversize",
        "_pools",
        "_rounded",
        "_rounding",
        "_routes",
        "_segments",
        "_small",
        "_spare",
        "allocated",
        "capacity",
        "fraction_limit",
        "inactive_split",
        "num_alloc_retries",
        "num_ooms",
        "peak_allocated",
        "peak_inactive_split",
        "peak_requested",
        "peak_reserved",
        "requested",
        "reserved",
        "settings",
    )

    def __init__(self, settings: AllocatorSettings | None = None, capacity: int | None = None) -> None:
        self.settings = settings if settings is not None else AllocatorSettings()
        self.capacity: int | None = capacity
        self.fraction_limit: int | None = None
        s = self.settings
        self._max_split = UNLIMITED if s.max_split_size is None else s.max_split_size
        self._oversize = s.max_split_size is not None  # the oversize rules of get_free_block apply
        self._rounding = s.non_split_rounding
        self._large_segment = s.large_segment_size
        self._expandable = s.expandable_segments
        self._divided = bool(s.roundup_power2_divisions)
        self._rounded: dict[int, int] = {}  # request -> its rounded size, with power-of-two divisions
        self._default_small = self._small = Pool(small=True)  # _small, _large: where requests go now
        self._default_large = self._large = Pool(small=False)
        self._pools: dict[PoolId, PrivatePool] = {}  # graph_pools
        self._freeable: dict[PoolId, PrivatePool] = {}  # graph_pools_freeable: those no longer in use
        self._lenders: list[PrivatePool] = []  # use_on_oom_pools, in the order made
        self._routes: list[PrivatePool] = []  # captures_underway: the last one takes the requests
        self._live: dict[int, Block] = {}
        self._segments: dict[int, Segment] = {}  # by base address
        self._spare: list[Block] = []
        self._next_address = 1 << 32  # addresses are only compared; each new segment takes higher ones
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.inactive_split = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.peak_inactive_split = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    def _new_segment(self, pool: Pool, vsize: int, stream: int, expandable: bool, page: int) -> Block:
        """A segment of `vsize` bytes at the next addresses, as one block (mapped unless expandable)."""
        base = self._next_address
        self._next_address += vsize
        seg = Segment(base, vsize, pool, stream, expandable, page)
        block = Block(base, vsize, seg)
        block.mapped = not expandable
        seg.head = block
        self._add_segment(seg)
        return block

    # ---------------------------------------------------------- replaying a card's trace (snapshots/)

    @property
    def next_segment_address(self) -> int:
        """The address the next new segment takes."""
        return self._next_address

    def place_next_segment(self, address: int) -> None:
        """Put the next new segment at `address` (a card's, when its trace is replayed)."""
        self._next_address = address

    def block_address(self, key: int) -> int | None:
        """The address of the block live request `key` holds; None when it is not live."""
        block = self._live.get(key)
        return None if block is None else block.addr

    def restore_segment(self, segment: RestoredSegment) -> None:
        """Add a segment as a card held it (a trace's start): its pieces tile it, in address order."""
        pool = self._pool_of(segment.pool, segment.small)
        seg = Segment(segment.base, segment.vsize, pool, segment.stream, segment.expandable, segment.page)
        previous: Block | None = None
        for piece in segment.pieces:
            block = Block(piece.address, piece.size, seg)
            block.prev = previous
            if previous is None:
                seg.head = block
            else:
                previous.next = block
            previous = block
            self._restore_piece(pool, block, piece, len(segment.pieces) > 1)
        self._add_segment(seg)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        self.peak_inactive_split = max(self.peak_inactive_split, self.inactive_split)

    def _add_segment(self, seg: Segment) -> None:
        self._segments[seg.base] = seg
        seg.pool.segments += 1

    def _drop_segment(self, seg: Segment) -> None:
        del self._segments[seg.base]
        seg.pool.segments -= 1

    def _pool_of(self, pool_id: PoolId, small: bool) -> Pool:
        """The small or large pool of `pool_id` (a private pool not seen before is made, in use once)."""
        if pool_id == DEFAULT_POOL:
            return self._default_small if small else self._default_large
        private = self._pools.get(pool_id)
        if private is None:
            private = self._pools[pool_id] = PrivatePool(pool_id)
        return private.small if small else private.large

    def _all_pools(self) -> list[Pool]:
        pools = [self._default_small, self._default_large]
        for private in self._pools.values():
            pools += (private.small, private.large)
        return pools

    def _restore_piece(self, pool: Pool, block: Block, piece: RestoredPiece, split: bool) -> None:
        if piece.key is not None:
            block.allocated = True
            block.requested = piece.requested
            self._live[piece.key] = block
            self.allocated += block.size
            self.requested += piece.requested
        elif not piece.mapped:
            block.mapped = False
            pool.add_unmapped(block)
            return
        else:
            pool.add(block)
            if split and not block.seg.expandable:
                self.inactive_split += block.size
        self.reserved += block.size

    def release_segment_at(self, address: int) -> bool:
        """cudaFree of the cached segment at `address`, as a card's `segment_free` says; False when the
        model holds no wholly free segment there."""
        seg = self._segments.get(address)
        block = None if seg is None else seg.head
        if seg is None or block is None or seg.expandable or block.allocated or block.next is not None:
            return False
        seg.pool.remove(block)
        self._drop_segment(seg)
        self.reserved -= block.size
        return True

    def _try_merge(self, pool: Pool, dst: Block, src: Block | None) -> int:
        """Merge free neighbour `src` into `dst` (try_merge_blocks); the bytes taken in, or 0. `dst` is in
        no list while it changes."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is None:
                dst.seg.head = dst
            else:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def check_consistency(self) -> None:
        """Assert the model's own invariants (for tests): blocks tile each segment, no two free mapped
        neighbours, the free lists hold exactly the free mapped blocks, the counters are the sums they name."""
        allocated = reserved = inactive = 0
        free_keys: dict[int, set[int]] = {}
        for seg in self._segments.values():
            block = seg.head
            assert block is not None and block.prev is None and block.addr == seg.base
            assert seg.free is seg.pool.free[seg.stream] and seg.blocks is seg.pool.blocks
            end = seg.base
            while block is not None:
                assert block.addr == end and block.size > 0 and block.seg is seg
                end += block.size
                if block.mapped:
                    reserved += block.size
                    if block.allocated:
                        allocated += block.size
                    else:
                        free_keys.setdefault(id(seg.pool), set()).add(block.key)
                        inactive += self._checked_free_block(block)
                else:
                    assert not block.allocated and (block.addr - seg.base) % seg.page == 0
                assert block.next is None or block.next.prev is block
                block = block.next
            assert end == seg.base + seg.vsize
        for pool in self._all_pools():
            keys = [key for stream in pool.free.values() for key in stream]
            assert all(stream == sorted(stream) for stream in pool.free.values())
            assert set(keys) == free_keys.get(id(pool), set()) == set(pool.blocks)
            assert all(block.seg.pool is pool for block in pool.blocks.values())
            assert pool.segments == sum(seg.pool is pool for seg in self._segments.values())
        assert self._freeable == {p.id: p for p in self._pools.values() if p.use_count == 0}
        lenders = [id(p) for p in self._lenders]
        assert len(set(lenders)) == len(lenders) and set(lenders) == {
            id(p) for p in self._pools.values() if p.use_on_oom
        }
        assert allocated == self.allocated == sum(block.size for block in self._live.values())
        assert reserved == self.reserved and inactive == self.inactive_split
        assert self.requested == sum(block.requested for block in self._live.values())

    @staticmethod
    def _checked_free_block(block: Block) -> int:
        """A free mapped block's invariants; its bytes if they are inactive split, else 0."""
        assert block.key == (block.size << SIZE_SHIFT) | block.addr
        if block.next is not None and block.next.mapped:
            assert block.next.allocated, "two free neighbours were not merged"
        split = not block.seg.expandable and (block.prev is not None or block.next is not None)
        return block.size if split else 0
