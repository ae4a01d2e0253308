"""expandable_segments:True: one growing virtual segment per pool, mapped in pages.

c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments] and the functions named
below: the pool reserves a large virtual range and maps physical pages (2 MiB for the small
pool, 20 MiB for the large) at the lowest address where a request fits, merging the newly
mapped pages with the free block before them; freeing unmaps only whole free pages.
"""
from __future__ import annotations

from bisect import bisect_left

# ExpandableSegment reserves 1 1/8 of the GPU's memory of address space; any range far
# larger than a request works the same here.
_VIRTUAL_RANGE = 1 << 44


class ExpandableMixin:
    """The expandable-segment half of CachingAllocator (see model.py)."""

    def _segment(self, pool):
        from vramplan.allocator.model import Block
        if pool.segment_base is None:
            pool.segment_base = self._next_addr
            self._next_addr += _VIRTUAL_RANGE
            pool.unmapped = [Block(_VIRTUAL_RANGE, pool.segment_base, pool, mapped=False)]
        return pool.segment_base

    def _expandable_best_fit(self, pool, i: int):
        """get_free_block's expandable branch: a block followed by unmapped pages counts as
        the size it can grow to, so another block that fits is preferred to it."""
        keys, blocks = pool.keys, pool.blocks

        def grow(b):
            nxt = b.next
            return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

        while i + 1 < len(keys) and grow(blocks[keys[i + 1]]) < grow(blocks[keys[i]]):
            i += 1
        return blocks[keys[i]]

    def _find_expandable_block(self, pool, size: int):
        """find_expandable_block: the lowest unmapped range (with the free block just before
        it) that has `size` bytes of free or unmapped space."""
        self._segment(pool)
        for u in pool.unmapped:
            c = u.prev if u.prev is not None and not u.prev.allocated and u.prev.mapped else u
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        return None

    def _try_allocate_expandable_block(self, pool, size: int):
        """try_allocate_expandable_block: map pages until the candidate holds `size`."""
        cand = self._find_expandable_block(pool, size)
        if cand is None:
            return None
        if not cand.mapped and not self._map_block(cand, min(cand.size, size)):
            return None
        while cand.size < size:
            nxt = cand.next
            if not self._map_block(nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt
        pool.erase(cand)
        return cand

    def _map_block(self, block, size: int) -> bool:
        """map_block: map whole pages from the block's start, leave the rest unmapped, merge
        with free mapped neighbours; False when the device has no room (cuMemCreate OOM)."""
        from vramplan.allocator.model import Block
        pool = block.pool
        mapped = -(-size // pool.page) * pool.page
        if self.reserved + mapped > self.allowed:
            return False
        pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.size - mapped, block.addr + mapped, pool, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            _insert_by_addr(pool.unmapped, rest)
            block.size = mapped
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self._grow(mapped)
        return True

    def _unmap_block(self, block) -> None:
        """unmap_block: return the whole free pages inside a cached block to the driver."""
        from vramplan.allocator.model import Block
        pool, page = block.pool, block.pool.page
        base = pool.segment_base
        first = -(-(block.addr - base) // page)
        last = (block.addr + block.size - base) // page
        if first >= last:
            return
        pool.erase(block)
        start, length = base + first * page, (last - first) * page
        if start > block.addr:
            before = Block(start - block.addr, block.addr, pool)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        tail = block.addr + block.size - (start + length)
        if tail > 0:
            after = Block(tail, start + length, pool)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = start, length, False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        _insert_by_addr(pool.unmapped, block)
        self.reserved -= length
        self.num_device_free += 1

    def _expandable_ranges(self) -> list[tuple[str, int]]:
        """One entry per contiguous mapped range (DeviceCachingAllocator::snapshot)."""
        out = []
        for pool in (self.small, self.large):
            if pool.segment_base is None or not pool.unmapped:
                continue
            b = pool.unmapped[0]
            while b.prev is not None:
                b = b.prev
            run = 0
            while b is not None:
                if b.mapped:
                    run += b.size
                elif run:
                    out.append(("small" if pool.small else "large", run))
                    run = 0
                b = b.next
            if run:
                out.append(("small" if pool.small else "large", run))
        return out


def _insert_by_addr(blocks: list, block) -> None:
    blocks.insert(bisect_left([b.addr for b in blocks], block.addr), block)
