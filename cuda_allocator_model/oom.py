"""The allocator model's new segments, the retries that give cached ones back, and its out-of-memory error."""

from __future__ import annotations

from bisect import bisect_left

from cuda_allocator_model.blocks import SIZE_SHIFT, Block, Pool
from cuda_allocator_model.constants import (
    DEFAULT_POOL,
    MIN_LARGE_ALLOC,
    ONE_EXABYTE,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    PoolId,
)
from cuda_allocator_model.expandable import ExpandableSegments
from cuda_allocator_model.sizes import format_size


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
        fraction: float | None = None,
    ) -> None:
        self.requested = requested  # the rounded request size
        self.segment = segment  # the new segment's size: what CUDA's "Tried to allocate" names
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity
        self.fraction = fraction  # the per-process memory fraction the capacity is, where it is one
        super().__init__(self._message(expandable_segments))

    @property
    def unallocated(self) -> int:
        """Reserved but unallocated bytes: the fragmentation no retry could give back."""
        return self.reserved - self.allocated

    def _message(self, expandable_segments: bool) -> str:
        if self.segment >= ONE_EXABYTE:
            return "CUDA out of memory (allocator model). Tried to allocate more than 1EB memory."
        limit = "" if self.fraction is None else f" (per_process_memory_fraction {self.fraction!r} of the card)"
        text = (
            f"CUDA out of memory (allocator model). Tried to allocate {format_size(self.segment)}. "
            f"Of the capacity of {format_size(self.capacity)}{limit}, {format_size(self.reserved)} is reserved by "
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


class NewMemory(ExpandableSegments):
    """get_allocation_size, alloc_block, release_available_cached_blocks, release_cached_blocks and
    release_block: a new segment, or new pages, and what is given back before asking again."""

    __slots__ = ()

    def allocation_size(self, size: int) -> int:
        """The size of the segment torch asks for to serve a rounded request of `size` (get_allocation_size)."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self._large_segment
        return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE

    def _new_memory(self, pool: Pool, size: int, stream: int) -> Block:
        """alloc_block, then the retries of malloc, then the out-of-memory error."""
        segment = self.allocation_size(size)
        block = self._alloc_block(pool, size, segment, stream)
        if block is None and pool.owner is None and self._lenders:
            block = self._from_pools_used_on_oom(pool.small, size, stream)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, segment, stream)
        if block is None and not self._routes:  # no retry while an allocation to a private pool is underway
            self._release_cached_blocks(DEFAULT_POOL)
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, size, segment, stream)
        if block is None:
            self.num_ooms += 1
            raise self._out_of_memory(size, segment)
        return block

    def _out_of_memory(self, size: int, segment: int) -> AllocatorOutOfMemory:
        """The error for a request of `size` that needed a new segment of `segment` bytes, naming the limit
        it ran into: the memory fraction's, else the capacity."""
        fraction = self._fraction_limit()
        if fraction is not None and self.reserved + segment > fraction:
            # PYTORCH_CUDA_ALLOC_CONF's fraction is named; set_per_process_memory_fraction's is the caller's
            share = self.settings.per_process_memory_fraction if self.fraction_limit is None else None
            return AllocatorOutOfMemory(size, segment, self.allocated, self.reserved, fraction, self._expandable, share)
        limit = self.capacity if self.capacity is not None else fraction
        limit = self.reserved if limit is None else limit
        return AllocatorOutOfMemory(size, segment, self.allocated, self.reserved, limit, self._expandable)

    def _fraction_limit(self) -> int | None:
        """The limit of `torch.cuda.set_per_process_memory_fraction` (`fraction_limit`), else that of
        per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF on the card predicted; None: none."""
        return self.fraction_limit if self.fraction_limit is not None else self.settings.fraction_limit

    def _alloc_block(self, pool: Pool, size: int, segment: int, stream: int) -> Block | None:
        """A new segment of `segment` bytes (or new pages) for a request of `size`; None when refused."""
        fraction = self._fraction_limit()
        if fraction is not None and self.reserved + segment > fraction:
            return None  # the memory fraction: refused without asking the driver
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity is not None and self.reserved + segment > self.capacity:
            return None  # cudaMalloc fails
        block = self._new_segment(pool, segment, stream, False, segment)
        self.reserved += segment
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return block

    def _from_pools_used_on_oom(self, small: bool, size: int, stream: int) -> Block | None:
        """try_mempool_fallback: the best cached block (get_free_block, expandable segments not searched) of
        the first MemPool made with use_on_oom that has one, taken out of its free list; else None."""
        for private in self._lenders:
            pool = private.small if small else private.large
            free = pool.free.get(stream)
            if not free:
                continue
            i = bisect_left(free, size << SIZE_SHIFT)
            while i < len(free) and pool.blocks[free[i]].seg.expandable:
                i += 1
            if i == len(free):
                continue
            block = pool.blocks[free[i]]
            if self._oversize and (
                (block.size >= self._max_split) if size < self._max_split else (block.size >= size + self._rounding)
            ):
                continue
            del pool.blocks[free.pop(i)]
            return block
        return None

    def _release_block(self, pool: Pool, block: Block) -> None:
        """cudaFree of a whole cached segment (release_block)."""
        assert block.prev is None and block.next is None, "only a whole cached segment is released"
        pool.remove(block)
        self._drop_segment(block.seg)
        self.reserved -= block.size

    def _release_available_cached_blocks(self, pool: Pool, size: int, stream: int) -> bool:
        """Free one cached unsplit block big enough, or the largest oversize ones (only with max_split_size)."""
        max_split = self._max_split
        if not self._oversize:
            return False
        free = pool.free.get(stream)
        if not free:
            return False
        target = max(size, max_split)
        i = bisect_left(free, target << SIZE_SHIFT)
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

    def _release_cached_blocks(self, pool_id: PoolId) -> None:
        """release_cached_blocks(pool_id): the default pool's cached segments (pool_id the default, no
        allocation to a private pool underway), then those of each private pool no longer in use (only
        `pool_id`'s when it names one); a private pool left with no segment is forgotten."""
        if pool_id == DEFAULT_POOL and not self._routes:
            self._release_blocks(self._default_large)
            self._release_blocks(self._default_small)
        for private in [p for p in self._freeable.values() if pool_id in (DEFAULT_POOL, p.id)]:
            self._release_blocks(private.small)
            self._release_blocks(private.large)
            if not private.small.segments and not private.large.segments:  # forgotten, as torch erases it
                del self._pools[private.id], self._freeable[private.id]
                if private.use_on_oom:
                    self._lenders.remove(private)

    def _release_blocks(self, pool: Pool) -> None:
        """release_blocks: every unsplit cached block of `pool` to the driver; free expandable pages unmapped."""
        blocks = pool.blocks
        to_unmap: list[Block] = []
        for stream in sorted(pool.free):
            kept: list[int] = []
            for key in pool.free[stream]:
                block = blocks[key]
                if block.seg.expandable:
                    to_unmap.append(block)
                    kept.append(key)
                elif block.prev is None and block.next is None:
                    del blocks[key]
                    self._drop_segment(block.seg)
                    self.reserved -= block.size
                else:
                    kept.append(key)
            pool.free[stream][:] = kept  # the same list: each segment of the stream holds it
        for block in to_unmap:
            self._unmap_block(pool, block)
            if block.prev is None and block.next is None and not block.mapped:
                pool.remove_unmapped(block)
                self._drop_segment(block.seg)  # release_expandable_segment
