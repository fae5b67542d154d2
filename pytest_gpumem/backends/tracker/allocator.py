"""A model of PyTorch's CUDA caching allocator, in pure Python: reserved memory, fragmentation and
out-of-memory as a card reports them, from a trace of allocations and frees (no torch, no GPU).

Read from torch's own source (our code, written to the rules below; none of theirs is copied):
`c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`: `malloc`, `round_size`,
`roundup_power2_next_division`, `get_pool`, `get_allocation_size`, `get_free_block`, `should_split`,
`alloc_found_block`, `alloc_block`, `release_available_cached_blocks`, `release_cached_blocks`,
`release_blocks`, `release_block`, `free_block`, `try_merge_blocks`, `find_expandable_block`,
`try_allocate_expandable_block`, `map_block`, `unmap_block`, `ExpandableSegment::map/unmap`,
`NativeCachingAllocator::allocate`), `c10/core/AllocatorConfig.{h,cpp}` (`ConfigTokenizer`,
`AcceleratorAllocatorConfig::parseArgs` and its `parse*` functions, `roundup_power2_divisions(size)`) and
`c10/cuda/CUDAAllocatorConfig.{h,cpp}` (`CUDAAllocatorConfig::parseArgs`, its keys). The allocator read
is the newest copy found among stored public sources (it has `is_expandable_segments_active`,
`large_segment_size()` and the CUDA 13 graph API), beside an older pytorch/pytorch copy (commit 001074d);
the torch this project pins (2.13.0, git cf30153c) ships the matching config headers
(`c10/core/AllocatorConfig.h`, `c10/cuda/CUDAAllocatorConfig.h`, with `large_segment_size_mb`) and its
`libc10.so` the same option names and messages, which this module was checked against.

The rules, each with the function it follows:

* Request size (`round_size`): below 512 B it is 512; else rounded up to 512 B, unless the power-of-two
  divisions `d` for the request's interval (16 intervals, [1 MiB, 2 MiB), [2, 4) ... the last one open;
  sizes under 1 MiB use the first) are above 1 and the size above `512 * d`: then it rounds up to the
  next of `d` equal steps between two powers of two (a power of two stays).
* Pools (`get_pool`): a rounded size of at most 1 MiB uses the small pool, else the large one; each pool
  keeps its own free blocks and segments.
* New segment size (`get_allocation_size`): 2 MiB in the small pool; `large_segment_size` (20 MiB,
  `large_segment_size_mb`) below 10 MiB; else the size rounded up to 2 MiB.
* Best fit (`get_free_block`): free blocks ordered by (stream, size, address); the first at least the
  size on the request's stream, or none. Blocks of `max_split_size` or more are not handed to requests
  below it, and to larger requests only when less than `max_non_split_rounding_size` (default: the large
  segment size, 20 MiB) bigger than the request. With expandable segments a block's size for this search
  is its size plus the unmapped space right after it.
* Split (`should_split`): small pool, or expandable segments: when at least 512 B remain; large pool:
  when the request is below `max_split_size` and more than 1 MiB remains. An unsplit tail counts as
  allocated.
* Counters (`alloc_found_block`, `free_block`, `alloc_block`, `map_block`, `release_block`,
  `unmap_block`): allocated = sum of handed-out blocks; reserved = sum of segments (mapped pages with
  expandable segments); requested = sum of unrounded requests; inactive split = free blocks of a segment
  that has other blocks (expandable segments are left out of it, as torch leaves them out). Each has a
  peak; `reset_peak` sets every peak to its current value (`resetPeakStats`).
* Free (`free_block`, `try_merge_blocks`): the block merges with free neighbours in its segment.
* New memory and the out-of-memory path (`malloc`, `alloc_block`, `release_available_cached_blocks`,
  `release_cached_blocks`): when no block fits, a new segment (or new pages) is asked for; it fails when
  it would take reserved memory past `capacity`. Then, only when `max_split_size` is set, the allocator
  frees the smallest cached unsplit block of at least max(request, max_split_size) on the stream, or
  else its largest oversize blocks until that much is freed, and asks again; then it frees every cached
  unsplit block of both pools (and unmaps free pages of expandable segments) and asks a last time; then
  it raises. `fraction_limit` models `torch.cuda.set_per_process_memory_fraction`: the request fails
  without asking when reserved + the new segment size would pass it (for expandable segments torch
  compares the segment size, not the pages it would map).
* Expandable segments (`find_expandable_block`, `try_allocate_expandable_block`, `map_block`,
  `unmap_block`, `release_blocks`): one virtual segment per pool and stream, mapped in pages of 2 MiB
  (small) and the large segment size (large); a request takes the lowest address with enough free and
  unmapped space, mapping just the pages it lacks; freeing unmaps nothing; `empty_cache()` and the
  out-of-memory retry unmap every whole free page, and drop a segment left with no mapped page.
* `empty_cache()` (`emptyCache` -> `release_cached_blocks`): releases every segment with no live block
  (and unmaps free pages).
* A request of 0 bytes touches nothing (`allocate` skips `malloc` for size 0); one of 1 EiB or more
  fails at once ("Tried to allocate more than 1EB memory").

Not modelled: cross-stream use (`record_stream`, events: a block is free as soon as it is freed), CUDA
graph private pools and `MemPool`s, `garbage_collection_threshold` (acts only with a memory fraction),
`throw_on_cudamalloc_oom`, memory outside the allocator (context, NCCL, cuBLAS workspaces are the
caller's), and the driver's choice of addresses: new segments here take increasing addresses, so when
two free blocks of one size tie in different segments the older segment wins, where the driver's
address decides on a card. An expandable segment's address space is 9/8 of `capacity` (torch: 9/8 of
the card's memory), or practically unlimited without a capacity.

Differences between the torch versions read (the newest is followed): an older copy of the allocator
(2024, before `large_segment_size_mb` and `max_non_split_rounding_mb`) used a fixed 20 MiB (`kLargeBuffer`)
for the large segment, the expandable large page and the oversize rounding limit; older configs filled
`roundup_power2_divisions:[...,>:d]` from the last named interval, newer ones from the one after it;
newer torch also reads `PYTORCH_ALLOC_CONF` when `PYTORCH_CUDA_ALLOC_CONF` is unset (`from_environ`); the
generic `c10/core/CachingDeviceAllocator.h` (other backends) orders free blocks by (size, stream,
address), the CUDA allocator by (stream, size, address): the same on one stream. Torch's out-of-memory
message names the new segment's size (`alloc_size`) after "Tried to allocate", not the request (we keep
both), prints sizes with two decimals ("16.00 MiB"; ours: `format_size`, "16.0 MiB") and always ends with
the expandable-segments hint; ours gives it only when more than 20% of reserved memory is unallocated
and expandable segments are off.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Final

from pytest_gpumem.backends.tracker.allocator_config import (
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ONE_EXABYTE,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    UNLIMITED,
    AllocatorSettings,
)
from pytest_gpumem.sizes import format_size

__all__ = ["AllocatorOutOfMemory", "AllocatorSettings", "CachingAllocatorModel"]  # settings: allocator_config

# ------------------------------------------------------------------------------------------- the error


class AllocatorOutOfMemory(Exception):
    """The allocator could not serve a request: no cached block fits and, after its retry, a new segment
    (or new pages) would take reserved memory past the capacity. `str()` is one line in CUDA's terms."""

    def __init__(
        self,
        requested: int,
        segment: int,
        allocated: int,
        reserved: int,
        capacity: int,
        expandable_segments: bool = False,
    ) -> None:
        self.requested = requested  # the rounded request size
        self.segment = segment  # the new segment's size: what CUDA's "Tried to allocate" names
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity
        super().__init__(self._message(expandable_segments))

    @property
    def unallocated(self) -> int:
        """Reserved but unallocated bytes: the fragmentation no retry could give back."""
        return self.reserved - self.allocated

    def _message(self, expandable_segments: bool) -> str:
        if self.segment >= ONE_EXABYTE:
            return "CUDA out of memory (allocator model). Tried to allocate more than 1EB memory."
        text = (
            f"CUDA out of memory (allocator model). Tried to allocate {format_size(self.segment)}. "
            f"Of the capacity of {format_size(self.capacity)}, {format_size(self.reserved)} is reserved by "
            f"PyTorch, of which {format_size(self.allocated)} is allocated and {format_size(self.unallocated)} "
            "reserved but unallocated"
        )
        if not expandable_segments and self.unallocated * 5 > self.reserved:
            text += (
                "; if reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation"
            )
        return text

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_oom, (self.requested, self.segment, self.allocated, self.reserved, self.capacity, str(self)))


def _rebuild_oom(
    requested: int, segment: int, allocated: int, reserved: int, capacity: int, message: str
) -> AllocatorOutOfMemory:
    error = AllocatorOutOfMemory(requested, segment, allocated, reserved, capacity)
    error.args = (message,)
    return error


# ----------------------------------------------------------------------------------------- the model

# A pool keeps one sorted list of free blocks per stream; a block's place in it is one int, (size,
# address) in that order of significance (ints compare far faster than tuples): with the stream first,
# torch's BlockComparatorSize order.
_SIZE_SHIFT: Final = 64
_SPARE_BLOCKS: Final = 256  # block objects kept for reuse: splits and merges come in pairs


class _Segment:
    """One cudaMalloc, or one expandable segment's address space."""

    __slots__ = ("base", "expandable", "head", "page", "small", "stream", "vsize")

    def __init__(self, base: int, vsize: int, small: bool, stream: int, expandable: bool, page: int) -> None:
        self.base = base
        self.vsize = vsize
        self.small = small
        self.stream = stream
        self.expandable = expandable
        self.page = page
        self.head: _Block | None = None  # the block at the lowest address


class _Block:
    """A piece of a segment: handed out, cached free, or (expandable segments) unmapped address space."""

    __slots__ = ("addr", "allocated", "key", "mapped", "next", "prev", "requested", "seg", "size")

    def __init__(self, addr: int, size: int, seg: _Segment) -> None:
        self.addr = addr
        self.size = size
        self.seg = seg
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.requested = 0
        self.key = 0  # (size, address) while in a free list


class _Pool:
    """The small or the large pool: its cached free blocks and (expandable segments) unmapped ranges,
    one sorted list per stream."""

    __slots__ = ("blocks", "free", "small", "unmapped", "unmapped_blocks")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: dict[int, list[int]] = {}  # stream -> sorted keys of its mapped free blocks
        self.blocks: dict[int, _Block] = {}  # key -> free block
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of its unmapped blocks
        self.unmapped_blocks: dict[int, _Block] = {}  # address -> unmapped block

    def stream_list(self, stream: int) -> list[int]:
        free = self.free.get(stream)
        if free is None:
            free = self.free[stream] = []
        return free

    def add(self, block: _Block) -> None:
        key = block.key = (block.size << _SIZE_SHIFT) | block.addr
        insort(self.stream_list(block.seg.stream), key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = block.key
        free = self.free[block.seg.stream]
        del free[bisect_left(free, key)]
        del self.blocks[key]

    def add_unmapped(self, block: _Block) -> None:
        unmapped = self.unmapped.get(block.seg.stream)
        if unmapped is None:
            unmapped = self.unmapped[block.seg.stream] = []
        insort(unmapped, block.addr)
        self.unmapped_blocks[block.addr] = block

    def remove_unmapped(self, block: _Block) -> None:
        unmapped = self.unmapped[block.seg.stream]
        del unmapped[bisect_left(unmapped, block.addr)]
        del self.unmapped_blocks[block.addr]


class CachingAllocatorModel:
    """The caching allocator's state for one device: segments, blocks, and torch's counters.

    `malloc(key, nbytes)` serves a request the way `torch.empty(nbytes, dtype=torch.uint8)` would on the
    card and returns the bytes counted as allocated for it; `free(key)` gives it back; `empty_cache()` is
    `torch.cuda.empty_cache()`. `capacity` (mutable) is the reserved memory past which a new segment
    fails; `fraction_limit` models `torch.cuda.set_per_process_memory_fraction` (fraction x card memory).
    Counters (`allocated`, `reserved`, `requested`, `inactive_split`, their `peak_*`) are plain attributes,
    to be read, not written.
    """

    __slots__ = (
        "_divided",
        "_expandable",
        "_large",
        "_large_segment",
        "_live",
        "_max_split",
        "_next_address",
        "_oversize",
        "_rounding",
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
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._segments: dict[int, _Segment] = {}  # by base address
        self._spare: list[_Block] = []
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

    # ------------------------------------------------------------------------------------ public API

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> int:
        """Serve request `key` of `nbytes` bytes on `stream`; the bytes counted as allocated for it.

        0 bytes: nothing is allocated and 0 returned (torch hands out a null pointer without asking the
        allocator). A key still live is freed first. Raises AllocatorOutOfMemory.
        """
        if nbytes <= 0:
            if nbytes == 0:
                return 0
            raise ValueError(f"a request of {nbytes} bytes")
        if nbytes >= 1152921504606846976:  # ONE_EXABYTE
            raise AllocatorOutOfMemory(nbytes, nbytes, self.allocated, self.reserved, ONE_EXABYTE)
        live = self._live
        if key in live:
            self.free(key)
        # round_size
        # (literal constants on the hot path: a global's lookup costs as much as the arithmetic)
        if nbytes <= 512:  # MIN_BLOCK
            size = 512
        elif self._divided:
            size = self._round_divided(nbytes)
        else:
            size = (nbytes + 511) & ~511
        small = size <= 1048576  # SMALL_SIZE
        pool = self._small if small else self._large
        blocks = pool.blocks
        # get_free_block: the best fit on the stream, within the max_split_size rules
        free = pool.free.get(stream)
        block: _Block | None = None
        if free:
            i = bisect_left(free, size << 64)
            if i < len(free):
                block = blocks[free[i]]
                if block.seg.expandable:
                    i = _expandable_best_fit(pool, free, i)
                    block = blocks[free[i]]
                if self._oversize and (
                    (block.size >= self._max_split) if size < self._max_split else (block.size >= size + self._rounding)
                ):
                    block = None  # no oversize block below max_split_size, nor one too much bigger above it
                else:
                    del blocks[free.pop(i)]
        if block is None:
            block = self._new_memory(pool, size, stream)
            free = pool.stream_list(stream)
        # should_split, alloc_found_block
        rest = block.size - size
        split = rest >= 512 if (small or self._expandable) else (size < self._max_split and rest > 1048576)
        seg = block.seg
        if split:
            already_split = block.prev is not None or block.next is not None
            addr = block.addr + size
            spare = self._spare
            if spare:
                remaining = spare.pop()
                remaining.addr = addr
                remaining.size = rest
                remaining.seg = seg
            else:
                remaining = _Block(addr, rest, seg)
            following = block.next
            remaining.prev = block
            remaining.next = following
            if following is not None:
                following.prev = remaining
            block.next = remaining
            block.size = size
            rkey = remaining.key = (rest << 64) | addr
            assert free is not None
            insort(free, rkey)
            blocks[rkey] = remaining
            if not seg.expandable:
                if already_split:
                    self.inactive_split -= size
                else:
                    self.inactive_split += rest
                    if self.inactive_split > self.peak_inactive_split:
                        self.peak_inactive_split = self.inactive_split
        elif not seg.expandable and (block.prev is not None or block.next is not None):
            self.inactive_split -= block.size
        block.allocated = True
        block.requested = nbytes
        live[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self.requested += nbytes
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return block.size

    def free(self, key: int) -> None:
        """Give request `key` back (a key that is not live is ignored): free_block, merging with free
        neighbours (try_merge_blocks, written out: the hot path)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        size = block.size
        self.allocated -= size
        self.requested -= block.requested
        block.allocated = False
        block.requested = 0
        seg = block.seg
        pool = self._small if seg.small else self._large
        free = pool.free[seg.stream]  # the block's segment was made for this stream: the list exists
        blocks = pool.blocks
        spare = self._spare
        merged = 0
        before = block.prev
        if before is not None and not before.allocated and before.mapped:
            bkey = before.key
            del free[bisect_left(free, bkey)]
            del blocks[bkey]
            block.addr = before.addr
            first = before.prev
            block.prev = first
            if first is None:
                seg.head = block
            else:
                first.next = block
            merged = before.size
            if len(spare) < 256:  # _SPARE_BLOCKS
                before.prev = before.next = None
                spare.append(before)
        after = block.next
        if after is not None and not after.allocated and after.mapped:
            akey = after.key
            del free[bisect_left(free, akey)]
            del blocks[akey]
            last = after.next
            block.next = last
            if last is not None:
                last.prev = block
            merged += after.size
            if len(spare) < 256:  # _SPARE_BLOCKS
                after.prev = after.next = None
                spare.append(after)
        size += merged
        block.size = size
        fkey = block.key = (size << 64) | block.addr
        insort(free, fkey)
        blocks[fkey] = block
        if not seg.expandable:
            change = size - merged if (block.prev is not None or block.next is not None) else -merged
            if change:
                self.inactive_split += change
                if self.inactive_split > self.peak_inactive_split:
                    self.peak_inactive_split = self.inactive_split

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release every segment with no live block; unmap free expandable pages."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """Every peak to its current value (torch.cuda.reset_peak_memory_stats)."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_requested = self.requested
        self.peak_inactive_split = self.inactive_split

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        """(segment size, [(block size, allocated?) in address order]) per segment, in address order; an
        expandable segment shows each run of mapped pages as one segment, as torch's snapshot does."""
        out: list[tuple[int, list[tuple[int, bool]]]] = []
        for base in sorted(self._segments):
            block = self._segments[base].head
            run: list[tuple[int, bool]] = []
            while block is not None:
                if block.mapped:
                    run.append((block.size, block.allocated))
                elif run:
                    out.append((sum(size for size, _ in run), run))
                    run = []
                block = block.next
            if run:
                out.append((sum(size for size, _ in run), run))
        return out

    def live_blocks(self) -> dict[int, int]:
        """The block size held by each live request key."""
        return {key: block.size for key, block in self._live.items()}

    def round_size(self, nbytes: int) -> int:
        """The size torch rounds a request of `nbytes` to (round_size), for nbytes > 0."""
        if nbytes <= MIN_BLOCK:
            return MIN_BLOCK
        return self._round_divided(nbytes) if self._divided else (nbytes + 511) & ~511

    def allocation_size(self, size: int) -> int:
        """The size of the segment torch asks for to serve a rounded request of `size` (get_allocation_size)."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self._large_segment
        return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE

    def check_consistency(self) -> None:
        """Assert the model's own invariants (for tests): blocks tile each segment, no two free mapped
        neighbours, the free lists hold exactly the free mapped blocks, the counters are the sums they name."""
        allocated = reserved = inactive = 0
        free_keys: dict[bool, set[int]] = {}
        for seg in self._segments.values():
            block = seg.head
            assert block is not None and block.prev is None and block.addr == seg.base
            end = seg.base
            while block is not None:
                assert block.addr == end and block.size > 0 and block.seg is seg
                end += block.size
                if block.mapped:
                    reserved += block.size
                    if block.allocated:
                        allocated += block.size
                    else:
                        free_keys.setdefault(seg.small, set()).add(block.key)
                        assert block.key == (block.size << _SIZE_SHIFT) | block.addr
                        if not seg.expandable and (block.prev is not None or block.next is not None):
                            inactive += block.size
                        if block.next is not None and block.next.mapped:
                            assert block.next.allocated, "two free neighbours were not merged"
                else:
                    assert not block.allocated and (block.addr - seg.base) % seg.page == 0
                assert block.next is None or block.next.prev is block
                block = block.next
            assert end == seg.base + seg.vsize
        for pool in (self._small, self._large):
            keys = [key for stream in pool.free.values() for key in stream]
            assert all(stream == sorted(stream) for stream in pool.free.values())
            assert set(keys) == free_keys.get(pool.small, set()) == set(pool.blocks)
        assert allocated == self.allocated == sum(block.size for block in self._live.values())
        assert reserved == self.reserved and inactive == self.inactive_split
        assert self.requested == sum(block.requested for block in self._live.values())

    # ------------------------------------------------------------------------------------- internals

    def _round_divided(self, nbytes: int) -> int:
        divisions = self.settings.divisions_for(nbytes)
        if divisions > 1 and nbytes > MIN_BLOCK * divisions:
            # roundup_power2_next_division
            if nbytes & (nbytes - 1) == 0:
                return nbytes
            floor = 1 << (nbytes.bit_length() - 1)
            step = floor >> (divisions.bit_length() - 1)
            if step == 0:
                return floor << 1
            low = nbytes & ~(step - 1)
            return nbytes if low == nbytes else low + step
        return (nbytes + 511) & ~511

    def _new_memory(self, pool: _Pool, size: int, stream: int) -> _Block:
        """alloc_block, then the retries of malloc, then the out-of-memory error."""
        segment = self.allocation_size(size)
        block = self._alloc_block(pool, size, segment, stream)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, segment, stream)
        if block is None:
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, size, segment, stream)
        if block is None:
            self.num_ooms += 1
            limit = self._failed_limit(segment)
            raise AllocatorOutOfMemory(size, segment, self.allocated, self.reserved, limit, self._expandable)
        return block

    def _failed_limit(self, segment: int) -> int:
        if self.fraction_limit is not None and self.reserved + segment > self.fraction_limit:
            return self.fraction_limit
        if self.capacity is not None:
            return self.capacity
        return self.fraction_limit if self.fraction_limit is not None else self.reserved

    def _alloc_block(self, pool: _Pool, size: int, segment: int, stream: int) -> _Block | None:
        if self.fraction_limit is not None and self.reserved + segment > self.fraction_limit:
            return None  # the memory fraction: refused without asking the driver
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity is not None and self.reserved + segment > self.capacity:
            return None  # cudaMalloc fails
        base = self._next_address
        self._next_address += segment
        seg = _Segment(base, segment, pool.small, stream, False, segment)
        block = _Block(base, segment, seg)
        seg.head = block
        self._segments[base] = seg
        self.reserved += segment
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return block

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """cudaFree of a whole cached segment (release_block)."""
        assert block.prev is None and block.next is None, "only a whole cached segment is released"
        pool.remove(block)
        del self._segments[block.seg.base]
        self.reserved -= block.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """Free one cached unsplit block big enough, or the largest oversize ones (only with max_split_size)."""
        max_split = self._max_split
        if not self._oversize:
            return False
        free = pool.free.get(stream)
        if not free:
            return False
        target = max(size, max_split)
        i = bisect_left(free, target << _SIZE_SHIFT)
        if i < len(free) and not pool.blocks[free[i]].seg.expandable:
            self._release_block(pool, pool.blocks[free[i]])
            return True
        # no single block is large enough: free oversize blocks, the largest first
        released = 0
        i -= 1
        while released < target and i >= 0:
            block = pool.blocks[free[i]]
            if block.size < max_split:
                break
            if not block.seg.expandable:
                released += block.size
                self._release_block(pool, block)
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks: every unsplit cached block to the driver; free expandable pages unmapped."""
        for pool in (self._large, self._small):
            blocks = pool.blocks
            to_unmap: list[_Block] = []
            for stream in sorted(pool.free):
                kept: list[int] = []
                for key in pool.free[stream]:
                    block = blocks[key]
                    if block.seg.expandable:
                        to_unmap.append(block)
                        kept.append(key)
                    elif block.prev is None and block.next is None:
                        del blocks[key]
                        del self._segments[block.seg.base]
                        self.reserved -= block.size
                    else:
                        kept.append(key)
                pool.free[stream] = kept
            for block in to_unmap:
                self._unmap_block(pool, block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.remove_unmapped(block)
                    del self._segments[block.seg.base]  # release_expandable_segment

    def _try_merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> int:
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

    # ------------------------------------------------------------------------- expandable segments

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        """The lowest address with `size` bytes of free and unmapped space, else a new segment."""
        for addr in pool.unmapped.get(stream, ()):
            candidate = pool.unmapped_blocks[addr]
            before = candidate.prev
            if before is not None and not before.allocated:
                candidate = before
            room = 0
            walk: _Block | None = candidate
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return candidate
        page = SMALL_BUFFER if pool.small else self._large_segment
        if self.capacity is not None:  # torch reserves 9/8 of the card's memory
            total = self.capacity + self.capacity // 8
            vsize = max(1, -(-total // page)) * page
        else:
            vsize = (1 << 40) // page * page
        base = self._next_address
        self._next_address += vsize
        seg = _Segment(base, vsize, pool.small, stream, True, page)
        block = _Block(base, vsize, seg)
        block.mapped = False
        seg.head = block
        self._segments[base] = seg
        pool.add_unmapped(block)
        return block

    def _map_block(self, pool: _Pool, to_map: _Block, size: int) -> bool:
        """Map the pages covering the first `size` bytes of unmapped block `to_map` (map_block)."""
        seg = to_map.seg
        page = seg.page
        mapped = -(-size // page) * page  # ExpandableSegment::map maps whole pages
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate fails: nothing of this call stays mapped
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, seg)
            rest.mapped = False
            rest.prev = to_map
            rest.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            pool.add_unmapped(rest)
        self._try_merge(pool, to_map, to_map.prev)
        self._try_merge(pool, to_map, to_map.next)
        pool.add(to_map)
        self.reserved += mapped
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free -> unmapped -> ...: map what is missing, merging as it goes
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """Unmap the whole free pages of free block `block` (unmap_block)."""
        seg = block.seg
        page = seg.page
        offset = block.addr - seg.base
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return
        pool.remove(block)
        start = seg.base + begin * page
        length = (end - begin) * page
        before = start - block.addr
        if before > 0:
            piece = _Block(block.addr, before, seg)
            piece.prev = block.prev
            piece.next = block
            if block.prev is None:
                seg.head = piece
            else:
                block.prev.next = piece
            block.prev = piece
            pool.add(piece)
        after = block.size - before - length
        if after > 0:
            piece = _Block(start + length, after, seg)
            piece.prev = block
            piece.next = block.next
            if block.next is not None:
                block.next.prev = piece
            block.next = piece
            pool.add(piece)
        block.addr = start
        block.size = length
        block.mapped = False
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        pool.add_unmapped(block)
        self.reserved -= length


def _expandable_best_fit(pool: _Pool, free: list[int], i: int) -> int:
    """From the first block that fits, move on while the next block, counted with the unmapped space after
    it, is smaller (get_free_block with expandable segments); the index chosen."""
    blocks = pool.blocks
    block = blocks[free[i]]
    n = len(free)
    while block.seg.expandable and i + 1 < n:
        candidate = blocks[free[i + 1]]
        if _expandable_size(candidate) >= _expandable_size(block):
            break
        i += 1
        block = candidate
    return i


def _expandable_size(block: _Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)
