"""A model of PyTorch's CUDA caching allocator (one device, one stream).

Follows c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, DeviceCachingAllocator); each
method names the C++ function it models. Addresses are virtual: each new segment gets a
fresh range, so best fit's tie-break on the address (BlockComparatorSize orders free blocks
by (stream, size, ptr)) prefers older segments, as cudaMalloc's rising addresses usually do.
Bytes are integers; nothing here knows about tensors or training.
"""
from __future__ import annotations

from bisect import bisect_left, insort

from vramplan.allocator.expandable import ExpandableMixin
from vramplan.spec.alloc_conf import AllocConf

MiB = 2**20
# c10/cuda/CUDACachingAllocator.cpp, top of the file:
K_MIN_BLOCK = 512            # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB       # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB     # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_LARGE_BUFFER = 20 * MiB    # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_ROUND_LARGE = 2 * MiB      # kRoundLarge: round up large allocations to 2 MiB
_NO_LIMIT = 1 << 62
_ADDR_BITS = 40  # addresses / 512 below 2**40: virtual ranges up to 512 TiB


class OutOfMemory(Exception):
    """The request could not be served even after freeing every cached block (malloc's
    'CUDA out of memory' path)."""

    def __init__(self, nbytes: int, allocated: int, reserved: int):
        super().__init__(f"tried to allocate {nbytes} bytes with {allocated} allocated, {reserved} reserved")
        self.nbytes, self.allocated, self.reserved = nbytes, allocated, reserved


class Block:
    """struct Block: a piece of a segment, free or allocated; prev/next link the pieces of
    one segment in address order."""

    __slots__ = ("size", "addr", "allocated", "prev", "next", "pool", "requested", "mapped", "gc_base")

    def __init__(self, size: int, addr: int, pool: "Pool", mapped: bool = True):
        self.size, self.addr, self.pool, self.mapped = size, addr, pool, mapped
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.requested = 0
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Pool:
    """struct BlockPool: free (cached) blocks ordered by (size, address) -- one integer key
    `size << _ADDR_BITS | addr / 512` per block (sizes and addresses are 512-byte
    multiples) -- plus the unmapped ranges of this pool's expandable segment."""

    __slots__ = ("small", "keys", "blocks", "unmapped", "gc_calls", "segment_base", "page")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}
        self.unmapped: list[Block] = []
        self.gc_calls = 0
        self.segment_base: int | None = None
        # Note [Expandable Segments]: 2 MiB pages for the small pool, 20 MiB for the large.
        self.page = K_SMALL_BUFFER if small else K_LARGE_BUFFER

    def insert(self, b: Block) -> None:
        """BlockPool::insert_into_blocks (records the gc age base)."""
        b.gc_base = self.gc_calls
        key = (b.size << _ADDR_BITS) | (b.addr >> 9)
        insort(self.keys, key)
        self.blocks[key] = b

    def erase(self, b: Block) -> None:
        key = (b.size << _ADDR_BITS) | (b.addr >> 9)
        del self.blocks[key]
        del self.keys[bisect_left(self.keys, key)]


def round_size(size: int, conf: AllocConf) -> int:
    """DeviceCachingAllocator::round_size: 512-byte multiples, or the next power-of-two
    division when roundup_power2_divisions applies to this size."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    divisions = _divisions_for(size, conf)
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def _divisions_for(size: int, conf: AllocConf) -> int:
    """AllocatorConfig::roundup_power2_divisions(size): intervals from 1 MB (index 0) to 64 GB."""
    idx = size.bit_length() - 1 - 20
    idx = min(max(idx, 0), len(conf.roundup_power2_divisions) - 1)
    return conf.roundup_power2_divisions[idx]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """DeviceCachingAllocator::roundup_power2_next_division: e.g. 1200 with 4 divisions of
    [1024, 2048) -> 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def allocation_size(size: int) -> int:
    """DeviceCachingAllocator::get_allocation_size: the size of a new segment."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class CachingAllocator(ExpandableMixin):
    """DeviceCachingAllocator for one device and one stream.

    capacity: bytes the allocator may reserve (the GPU's memory less the CUDA context and
    what lives outside the allocator); None for no limit. memory_fraction: as
    torch.cuda.set_per_process_memory_fraction (garbage_collection_threshold acts only
    when a fraction is set, as in malloc's `set_fraction &&` test)."""

    def __init__(self, conf: AllocConf | None = None, capacity: int | None = None,
                 memory_fraction: float | None = None):
        self.conf = conf or AllocConf()
        self.max_split = self.conf.max_split_size or _NO_LIMIT
        self.allowed = capacity if capacity is not None else _NO_LIMIT
        self.set_fraction = memory_fraction is not None
        if memory_fraction is not None:
            self.allowed = int(self.allowed * memory_fraction)
        self.gc_on = self.set_fraction and self.conf.garbage_collection_threshold > 0
        self._plain_round = not any(d > 1 for d in self.conf.roundup_power2_divisions)
        self._fast = not self.conf.expandable_segments and not self.gc_on
        self.small, self.large = Pool(True), Pool(False)
        self.reserved = self.allocated = self.requested = 0
        self.segments: dict[int, tuple[int, bool]] = {}
        """Regular segments by base address: (size, small pool)."""
        self._next_addr = 0
        self.num_retries = self.num_device_alloc = self.num_device_free = 0
        self.reset_peaks()

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats; also the moment of the live peak."""
        self.peak_reserved, self.peak_allocated, self.peak_requested = self.reserved, self.allocated, self.requested
        self.at_peak = (self.requested, self.allocated, self.reserved)

    # -- malloc / free -------------------------------------------------------------------

    def malloc(self, nbytes: int) -> Block:
        """DeviceCachingAllocator::malloc."""
        if self._plain_round and nbytes >= K_MIN_BLOCK:
            size = -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK
        else:
            size = round_size(nbytes, self.conf)
        pool = self.small if size <= K_SMALL_SIZE else self.large
        if self._fast:  # get_free_block without expandable segments or gc, inlined
            block, keys = None, pool.keys
            i = bisect_left(keys, size << _ADDR_BITS)
            if i < len(keys):
                key = keys[i]
                found = key >> _ADDR_BITS
                if not (found >= self.max_split and
                        (size < self.max_split or found >= size + self.conf.max_non_split_rounding)):
                    block = pool.blocks.pop(key)
                    del keys[i]
        else:
            block = self._get_free_block(pool, size)
        if block is None:
            if self.gc_on:
                self._garbage_collect()
            alloc = allocation_size(size)
            block = self._alloc_block(pool, size, alloc)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc)
            if block is None:
                self._release_cached_blocks()
                self.num_retries += 1
                block = self._alloc_block(pool, size, alloc)
            if block is None:
                raise OutOfMemory(size, self.allocated, self.reserved)
        return self._alloc_found_block(block, size, nbytes, self._should_split(block, size))

    def free(self, block: Block) -> None:
        """DeviceCachingAllocator::free -> free_block: merge with free neighbours of the same
        segment (try_merge_blocks), then cache the block in its pool."""
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = block.pool
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._try_merge(block, prev, pool)
        if nxt is not None and not nxt.allocated:
            self._try_merge(block, nxt, pool)
        pool.insert(block)

    # -- pieces of malloc ----------------------------------------------------------------

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
        """DeviceCachingAllocator::get_free_block: best fit, with the oversize rules."""
        if self.gc_on:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if self.conf.expandable_segments:
            block = self._expandable_best_fit(pool, i)
        # Do not return an oversized block for a large request ...
        if size < self.max_split and block.size >= self.max_split:
            return None
        # ... and an oversized one only within max_non_split_rounding (kLargeBuffer) of it.
        if size >= self.max_split and block.size >= size + self.conf.max_non_split_rounding:
            return None
        pool.erase(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """DeviceCachingAllocator::should_split."""
        remaining = block.size - size
        if block.pool.small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _alloc_block(self, pool: Pool, size: int, alloc: int) -> Block | None:
        """DeviceCachingAllocator::alloc_block: a new segment (cudaMalloc), or more pages of
        the expandable segment; None when the device (or the fraction) has no room."""
        if self.conf.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if self.reserved + alloc > self.allowed:
            return None
        block = Block(alloc, self._next_addr, pool)
        self.segments[block.addr] = (alloc, pool.small)
        self._next_addr += alloc
        self._grow(alloc)
        return block

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.num_device_alloc += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _alloc_found_block(self, block: Block, size: int, nbytes: int, split: bool) -> Block:
        """DeviceCachingAllocator::alloc_found_block: split off the remainder if asked."""
        if split:
            rest = block
            block = Block(size, rest.addr, rest.pool)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            rest.pool.insert(rest)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        self.requested += nbytes
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested >= self.peak_requested:
            self.peak_requested = self.requested
            self.at_peak = (self.requested, self.allocated, self.reserved)
        return block

    def _try_merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        """DeviceCachingAllocator::try_merge_blocks: dst absorbs a free neighbour."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.erase(src)
        else:
            pool.unmapped.remove(src)
        return src.size

    # -- giving memory back ----------------------------------------------------------------

    def _release_block(self, block: Block) -> None:
        """DeviceCachingAllocator::release_block: cudaFree a whole cached segment."""
        block.pool.erase(block)
        del self.segments[block.addr]
        self.reserved -= block.size
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """DeviceCachingAllocator::release_available_cached_blocks: with max_split_size set,
        free one oversize cached block large enough, else the largest ones until enough."""
        if self.max_split == _NO_LIMIT or self.conf.expandable_segments:
            return False
        want = max(size, self.max_split)
        keys = pool.keys
        i = bisect_left(keys, want << _ADDR_BITS)
        if i < len(keys):
            self._release_block(pool.blocks[keys[i]])
            return True
        released = 0
        j = i - 1
        while j >= 0 and released < want and keys[j] >> _ADDR_BITS >= self.max_split:
            block = pool.blocks[keys[j]]
            released += block.size
            self._release_block(block)
            j -= 1
        return released >= want

    def _release_cached_blocks(self) -> None:
        """DeviceCachingAllocator::release_cached_blocks -> release_blocks: free every cached
        block that is a whole segment; unmap the free pages of expandable segments."""
        for pool in (self.large, self.small):
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None:
                    continue
                if self.conf.expandable_segments:
                    self._unmap_block(block)
                elif not block.is_split():
                    self._release_block(block)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache()."""
        self._release_cached_blocks()

    def _garbage_collect(self) -> None:
        """DeviceCachingAllocator::garbage_collect_cached_blocks: above the threshold, free
        whole cached large segments older than the average age (in get_free_block calls)."""
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = {k: pool.gc_calls - b.gc_base for k, b in pool.blocks.items() if not b.is_split()}
        freed = True
        while reclaimed < target and freed and ages:
            average = sum(ages.values()) / len(ages)
            freed = False
            for key in [k for k in pool.keys if k in ages]:
                if ages[key] >= average:
                    block = pool.blocks[key]
                    reclaimed += block.size
                    del ages[key]
                    self._release_block(block)
                    freed = True

    # -- what is held ------------------------------------------------------------------------

    def segment_sizes(self) -> list[tuple[str, int]]:
        """(pool, bytes) per segment, as torch.cuda.memory_snapshot() lists them (an
        expandable segment counts once per contiguous mapped range)."""
        out = [("small" if small else "large", size) for _, (size, small) in sorted(self.segments.items())]
        return out + self._expandable_ranges()

    def cached_bytes(self) -> int:
        """Reserved but not allocated: the free blocks of all pools."""
        return self.reserved - self.allocated
