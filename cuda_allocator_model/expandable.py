"""The allocator model's expandable segments: one address space per pool and stream, mapped page by page."""

from __future__ import annotations

from cuda_allocator_model.blocks import AllocatorState, Block, Pool
from cuda_allocator_model.constants import SMALL_BUFFER


class ExpandableSegments(AllocatorState):
    """find_expandable_block, try_allocate_expandable_block, map_block and unmap_block."""

    __slots__ = ()

    def _find_expandable_block(self, pool: Pool, size: int, stream: int) -> Block:
        """The lowest address with `size` bytes of free and unmapped space, else a new segment."""
        for addr in pool.unmapped.get(stream, ()):
            candidate = pool.unmapped_blocks[addr]
            before = candidate.prev
            if before is not None and not before.allocated:
                candidate = before
            room = 0
            walk: Block | None = candidate
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return candidate
        page = SMALL_BUFFER if pool.small else self._large_segment
        if self.capacity is not None:  # torch reserves 9/8 of the card's memory
            total = self.capacity + self.capacity // 8
            vsize = max(1, -(-total // page)) * page
        else:  # an unlimited device: address space for any request (below 1 EiB, refused before)
            vsize = max((1 << 40) // page, -(-size // page)) * page
        block = self._new_segment(pool, vsize, stream, True, page)
        pool.add_unmapped(block)
        return block

    def _map_block(self, pool: Pool, to_map: Block, size: int) -> bool:
        """Map the pages covering the first `size` bytes of unmapped block `to_map` (map_block)."""
        seg = to_map.seg
        page = seg.page
        mapped = -(-size // page) * page  # ExpandableSegment::map maps whole pages
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate fails: nothing of this call stays mapped
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.addr + mapped, to_map.size - mapped, seg)
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

    def _try_allocate_expandable_block(self, pool: Pool, size: int, stream: int) -> Block | None:
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

    def _unmap_block(self, pool: Pool, block: Block) -> None:
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
            piece = Block(block.addr, before, seg)
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
            piece = Block(start + length, after, seg)
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


def expandable_best_fit(pool: Pool, free: list[int], i: int) -> int:
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


def _expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)
