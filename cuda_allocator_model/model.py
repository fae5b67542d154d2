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
  keeps its own free blocks and segments. A private pool (`MemPool`, a CUDA graph's: `PrivatePool`) has a
  small and a large pool of its own; requests go to the one whose allocation was begun last
  (`beginAllocateToPool`, `use_mem_pool`, graph capture) until it ends (`endAllocateToPool`), else to the
  default pool. A pool's blocks serve only its requests and a block is freed into its own pool.
* `MemPool(use_on_oom=True)` (`try_mempool_fallback`): a default-pool request that found no cached block
  and no new memory takes the best cached block of the first such pool that has one (pools in the order
  made; torch's set has no order), before any cached memory is released; only blocks outside expandable
  segments. `MemPool(no_split=True)` (`should_split`): a block of the pool is handed out whole.
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
  frees the smallest cached unsplit block of at least max(request, max_split_size) on the stream in the
  request's pool, or else its largest oversize blocks until that much is freed, and asks again; then,
  unless an allocation to a private pool is underway, it does what `empty_cache()` does and asks a last
  time; then it raises. `fraction_limit` models `torch.cuda.set_per_process_memory_fraction`: the request fails
  without asking when reserved + the new segment size would pass it (for expandable segments torch
  compares the segment size, not the pages it would map).
* Expandable segments (`find_expandable_block`, `try_allocate_expandable_block`, `map_block`,
  `unmap_block`, `release_blocks`): one virtual segment per pool and stream, mapped in pages of 2 MiB
  (small) and the large segment size (large); a request takes the lowest address with enough free and
  unmapped space, mapping just the pages it lacks; freeing unmaps nothing; `empty_cache()` and the
  out-of-memory retry unmap every whole free page, and drop a segment left with no mapped page.
* `empty_cache()` (`emptyCache` -> `release_cached_blocks`): releases every segment with no live block
  (and unmaps free pages) of the default pool, unless an allocation to a private pool is underway, and of
  every private pool no longer in use (`releasePool` took its use count to 0: the MemPool deleted, the
  graph reset); such a pool left with no segment is forgotten. A MemPool's destructor
  (`emptyCache(id)`, `delete_pool`) releases only its own pool's, once no longer in use.
* A request of 0 bytes touches nothing (`allocate` skips `malloc` for size 0); one of 1 EiB or more
  fails at once ("Tried to allocate more than 1EB memory").

Not modelled: cross-stream use (`record_stream`, events: a block is free as soon as it is freed), a
`MemPool` with an allocator of its own (its memory is that allocator's; torch turns expandable segments
off for it), graph capture's reuse of freed blocks (`graph_capture_record_stream_reuse`), the checkpointed
state of a graph's pool, `garbage_collection_threshold` (acts only with a memory fraction),
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

Where the rules live: here `malloc` and `free` (request size, best fit, the split, merging: the hot path,
written out), `blocks` (segments, blocks, pools, the merges of expandable pages, the invariants),
`oom` (new segments, the retries, the error), `expandable` (expandable segments),
`settings` (the settings and constants).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from cuda_allocator_model.blocks import Block, PrivatePool
from cuda_allocator_model.constants import DEFAULT_POOL, MIN_BLOCK, ONE_EXABYTE, PoolId
from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.expandable import expandable_best_fit
from cuda_allocator_model.oom import AllocatorOutOfMemory, NewMemory
from cuda_allocator_model.settings import AllocatorSettings

__all__ = ["DEFAULT_POOL", "AllocatorOutOfMemory", "AllocatorSettings", "CachingAllocatorModel", "PoolId"]


class CachingAllocatorModel(NewMemory):
    """The caching allocator's state for one device: segments, blocks, and torch's counters.

    `malloc(key, nbytes)` serves a request the way `torch.empty(nbytes, dtype=torch.uint8)` would on the
    card and returns the bytes counted as allocated for it; `free(key)` gives it back; `empty_cache()` is
    `torch.cuda.empty_cache()`. `capacity` (mutable) is the reserved memory past which a new segment
    fails; `fraction_limit` models `torch.cuda.set_per_process_memory_fraction` (fraction x card memory).
    Counters (`allocated`, `reserved`, `requested`, `inactive_split`, their `peak_*`) are plain attributes,
    to be read, not written; they count every pool, as torch's do.

    Private pools, as torch drives them: `torch.cuda.MemPool(use_on_oom=u, no_split=n)` is
    `create_pool(id, use_on_oom=u, no_split=n)`; `with torch.cuda.use_mem_pool(pool):` is
    `allocate_to_pool(id)` ... `allocate_to_pool(None)`, `release_pool(id)`; deleting the MemPool is
    `delete_pool(id)`. A CUDA graph's capture is `allocate_to_pool(id)` ...
    `allocate_to_pool(None)` (its pool made there, in use by the graph), and `graph.reset()` is
    `release_pool(id)`.
    """

    __slots__ = ()

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> int:
        """Serve request `key` of `nbytes` bytes on `stream`; the bytes counted as allocated for it.

        0 bytes: nothing is allocated and 0 returned (torch hands out a null pointer without asking the
        allocator). A key still live is freed first. Raises AllocatorOutOfMemory.
        """
        if nbytes <= 0 or nbytes >= 1152921504606846976:  # ONE_EXABYTE
            return self._unservable(nbytes)
        live = self._live
        if key in live:
            self.free(key)
        # round_size (literal constants on the hot path: a global's lookup costs as much as the arithmetic)
        if nbytes <= 512:  # MIN_BLOCK
            size = 512
        elif self._divided:
            size = self._rounded.get(nbytes) or self._round_divided(nbytes)
        else:
            size = (nbytes + 511) & -512
        small = size <= 1048576  # SMALL_SIZE
        pool = self._small if small else self._large
        # get_free_block: the best fit on the stream, within the max_split_size rules
        try:
            free = pool.free[stream]
        except KeyError:  # no segment on this stream yet
            free = []
        block: Block | None = None
        if free:
            i = bisect_left(free, size << 64)  # SIZE_SHIFT
            if i < len(free):
                block = pool.blocks[free[i]]
                if block.seg.expandable:
                    i = expandable_best_fit(pool, free, i)
                    block = pool.blocks[free[i]]
                if self._oversize and (
                    (block.size >= self._max_split) if size < self._max_split else (block.size >= size + self._rounding)
                ):
                    block = None  # no oversize block below max_split_size, nor one too much bigger above it
                else:
                    del pool.blocks[free.pop(i)]
        if block is None:
            block = self._new_memory(pool, size, stream)
            pool = block.seg.pool  # a MemPool's used on out-of-memory may have served it
            free = block.seg.free
        # should_split, alloc_found_block
        rest = block.size - size
        seg = block.seg
        if (rest >= 512 if (small or self._expandable) else (size < self._max_split and rest > 1048576)) and (
            not pool.no_split
        ):
            # the split, written out: its last `rest` bytes a free block after it
            before = block.prev is not None or block.next is not None
            addr = block.addr + size
            spare = self._spare
            if spare:
                remaining = spare.pop()
                remaining.addr = addr
                remaining.size = rest
                remaining.seg = seg
            else:
                remaining = Block(addr, rest, seg)
            following = block.next
            remaining.prev = block
            remaining.next = following
            if following is not None:
                following.prev = remaining
            block.next = remaining
            block.size = size
            rkey = remaining.key = (rest << 64) | addr  # SIZE_SHIFT
            insort(free, rkey)
            pool.blocks[rkey] = remaining
            if not seg.expandable:
                if before:
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

    def _unservable(self, nbytes: int) -> int:
        """A request of 0 bytes (0: nothing is touched), of fewer (ValueError) or of 1 EiB or more (out of memory)."""
        if nbytes == 0:
            return 0
        if nbytes < 0:
            raise ValueError(f"a request of {nbytes} bytes")
        raise AllocatorOutOfMemory(nbytes, nbytes, self.allocated, self.reserved, ONE_EXABYTE)

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
        free = seg.free
        blocks = seg.blocks
        whole = size  # the block's bytes with its free neighbours'
        spare = self._spare  # a merged neighbour's object, kept for a later split
        before = block.prev
        if before is not None and not before.allocated and before.mapped:
            bkey = before.key
            del free[bisect_left(free, bkey)]
            del blocks[bkey]
            block.addr = before.addr
            first = block.prev = before.prev
            if first is None:
                seg.head = block
            else:
                first.next = block
            whole += before.size
            if len(spare) < 256:  # SPARE_BLOCKS
                spare.append(before)
        after = block.next
        if after is not None and not after.allocated and after.mapped:
            akey = after.key
            del free[bisect_left(free, akey)]
            del blocks[akey]
            last = block.next = after.next
            if last is not None:
                last.prev = block
            whole += after.size
            if len(spare) < 256:  # SPARE_BLOCKS
                spare.append(after)
        block.size = whole
        fkey = block.key = (whole << 64) | block.addr
        insort(free, fkey)
        blocks[fkey] = block
        if not seg.expandable:
            if block.prev is not None or block.next is not None:  # still split: the freed bytes are inactive now
                inactive = self.inactive_split = self.inactive_split + size
                if inactive > self.peak_inactive_split:
                    self.peak_inactive_split = inactive
            elif whole != size:  # the segment whole again: its merged neighbours were inactive
                self.inactive_split -= whole - size

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache() (`emptyCache`): release every segment with no live block and unmap free
        expandable pages, of the default pool (unless an allocation to a private pool is underway) and of
        every private pool no longer in use."""
        self._release_cached_blocks(DEFAULT_POOL)

    def create_pool(self, pool: PoolId, *, use_on_oom: bool = False, no_split: bool = False) -> None:
        """`torch.cuda.MemPool(use_on_oom=..., no_split=...)` whose id is `pool` (`createOrIncrefPool`,
        `setUseOnOOM`, `setNoSplit`): a private pool in use once; a pool that exists is in use once more."""
        private = self._incref(pool)
        if use_on_oom and not private.use_on_oom:
            private.use_on_oom = True
            self._lenders.append(private)
        if no_split:
            private.no_split = private.small.no_split = private.large.no_split = True

    def allocate_to_pool(self, pool: PoolId | None) -> None:
        """Requests go to private pool `pool` from now on (`beginAllocateToPool`: made, or in use once more)
        until `allocate_to_pool(None)` ends the allocation to the pool begun last (`endAllocateToPool`)."""
        if pool is not None:
            self._routes.append(self._incref(pool))
        elif self._routes:
            self._routes.pop()
        else:
            raise ModelError("allocate_to_pool(None): no allocation to a private pool is underway")
        private = self._routes[-1] if self._routes else None
        self._small = self._default_small if private is None else private.small
        self._large = self._default_large if private is None else private.large

    def delete_pool(self, pool: PoolId) -> None:
        """The MemPool of id `pool` deleted (`~MemPool`: `setUseOnOOM(false)`, `releasePool`, then
        `emptyCache(pool)`): lent no more, one user fewer and, with none left, its cached segments released."""
        self.release_pool(pool)
        private = self._pools[pool]
        if private.use_on_oom:
            private.use_on_oom = False
            self._lenders.remove(private)
        self._release_cached_blocks(pool)

    def release_pool(self, pool: PoolId) -> None:
        """One user of private pool `pool` fewer (`releasePool`: a MemPool deleted, a graph reset, a
        `use_mem_pool` ended); with none left, `empty_cache` releases its cached segments."""
        private = self._pools.get(pool)
        if private is None or private.use_count == 0:
            raise ModelError(f"release_pool({pool!r}): no private pool of that id is in use")
        private.use_count -= 1
        if private.use_count == 0:
            self._freeable[pool] = private

    def _incref(self, pool: PoolId) -> PrivatePool:
        """create_or_incref_pool: the private pool `pool`, made in use once, or in use once more."""
        if not (isinstance(pool, tuple) and len(pool) == 2 and all(type(part) is int for part in pool)):
            raise ModelError(f"a pool's id is a pair of whole numbers such as (0, 1), not {pool!r:.40}")
        if pool == DEFAULT_POOL:
            raise ModelError(f"{DEFAULT_POOL!r} is the default pool, not a private one")
        private = self._pools.get(pool)
        if private is None:
            private = self._pools[pool] = PrivatePool(pool)
        else:
            private.use_count += 1
            self._freeable.pop(pool, None)
        return private

    def reserved_by_pool(self) -> dict[PoolId, int]:
        """Reserved bytes (mapped) of each pool that holds a segment, the default pool first."""
        out: dict[PoolId, int] = {}
        for seg in self._segments.values():
            owner = seg.pool.owner
            pool = DEFAULT_POOL if owner is None else owner.id
            mapped = 0
            block = seg.head
            while block is not None:
                mapped += block.size if block.mapped else 0
                block = block.next
            out[pool] = out.get(pool, 0) + mapped
        return dict(sorted(out.items(), key=lambda item: (item[0] != DEFAULT_POOL, item[0])))

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

    def _round_divided(self, nbytes: int) -> int:
        """round_size with power-of-two divisions, kept in `_rounded` (the settings' divisions never change)."""
        rounded = self._rounded
        if len(rounded) >= 4096:  # ROUNDED_KEPT
            rounded.clear()
        size = rounded[nbytes] = self._divided_size(nbytes)
        return size

    def _divided_size(self, nbytes: int) -> int:
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
