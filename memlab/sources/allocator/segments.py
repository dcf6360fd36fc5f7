"""The segments of :class:`~memlab.sources.allocator.caching.CachingAllocatorModel`: device memory
reserved (``cudaMalloc``) and given back.

:class:`CachingSegments` is the model's half that deals in whole segments, as
``CUDACachingAllocator.cpp`` does around its block pools: a new segment sized by
:func:`~memlab.sources.allocator.config.allocation_size` (or mapped pages of an expandable segment),
PyTorch's fallbacks when the device cannot hold it (free enough oversize cached segments with
``max_split_size_mb``, then every unsplit cached segment, counting ``num_alloc_retries``, then
``torch.OutOfMemoryError``), and the release of cached segments (``empty_cache()``). It is a mixin
of ``CachingAllocatorModel`` and reads the state the model's ``__init__`` sets (``table``,
``capacity``, ``_small``, ``_large``, ``_max_split``, ``_next_addr``, ``_oversize_segments``,
``_expandable``). Sizes are bytes.
"""

from __future__ import annotations

from bisect import bisect_left

from memlab.sources.allocator.blocks import KEY_SHIFT, Block, BlockPool, change_pair
from memlab.sources.allocator.config import UNLIMITED, allocation_size
from memlab.sources.allocator.stats import decrease, increase

__all__ = ["CachingSegments"]


class CachingSegments:
    """The segment half of :class:`~memlab.sources.allocator.caching.CachingAllocatorModel` (see
    the module)."""

    def _cuda_malloc(self, pool: BlockPool, alloc_size: int) -> Block | None:
        """A new segment of ``alloc_size`` bytes, or ``None`` if the device cannot hold it."""
        if self.capacity is not None and pool.reserved_bytes[0][0] + alloc_size > self.capacity:
            return None
        addr = self._next_addr
        self._next_addr = addr + alloc_size
        change_pair(pool.segment, 1)
        change_pair(pool.reserved_bytes, alloc_size)
        if alloc_size >= self._max_split:
            increase(self._oversize_segments, 1)
        self.table.counters["num_device_alloc"] += 1
        self._record_segment(True, addr, alloc_size)
        return Block(addr, alloc_size, pool)

    def _new_block(self, pool: BlockPool, size: int) -> Block | None:
        """A free block of new device memory for ``size`` rounded bytes (a segment, or mapped pages
        of an expandable segment), or ``None`` if the device cannot hold it."""
        if self._expandable is not None:
            return self._expandable.try_allocate(pool, size)
        return self._cuda_malloc(pool, allocation_size(size))

    def _alloc_block(self, pool: BlockPool, size: int) -> Block:
        """``alloc_block`` with PyTorch's fallbacks: free enough oversize cached blocks, then all
        unsplit cached segments (a retry), then raise ``torch.OutOfMemoryError``."""
        block = self._new_block(pool, size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._new_block(pool, size)
        if block is None:
            self._release_cached_blocks()
            self.table.counters["num_alloc_retries"] += 1
            block = self._new_block(pool, size)
        if block is None:
            raise self._oom(allocation_size(size))
        return block

    def _release_block(self, block: Block) -> None:
        pool = block.pool
        pool.remove(block)
        change_pair(pool.segment, -1)
        change_pair(pool.reserved_bytes, -block.size)
        if block.size >= self._max_split:
            decrease(self._oversize_segments, 1)
        self.table.counters["num_device_free"] += 1
        self._record_segment(False, block.addr, block.size)

    def _release_available_cached_blocks(self, pool: BlockPool, size: int) -> bool:
        """Free the smallest oversize cached segment that covers the request, or several of the
        largest ones until enough is freed (only with ``max_split_size_mb``; never for expandable
        segments, whose blocks cannot be freed one by one)."""
        max_split = self._max_split
        if max_split == UNLIMITED or self._expandable is not None:
            return False
        target = max(size, max_split)
        keys = pool.keys
        i = bisect_left(keys, target << KEY_SHIFT)
        if i < len(keys):
            block = pool.blocks[i]
            if block.prev is not None or block.next is not None:
                return False
            self._release_block(block)
            return True
        released = 0
        i -= 1
        while i >= 0 and released < target:
            block = pool.blocks[i]
            if block.size < max_split or block.prev is not None or block.next is not None:
                break
            released += block.size
            self._release_block(block)
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """Free every cached segment that is entirely free (large pool first, then small)."""
        self.table.counters["num_sync_all_streams"] += 1
        if self._expandable is not None:
            self._expandable.release()
            return
        for pool in (self._large, self._small):
            for block in [b for b in pool.blocks if b.prev is None and b.next is None]:
                self._release_block(block)

    def empty_cache(self) -> None:
        """Give every fully free cached segment back to the device, like ``torch.cuda.empty_cache()``.

        Segments with any allocated block stay, including their free parts (``inactive_split``).
        Counts one ``num_sync_all_streams`` and one ``num_device_free`` per released segment.
        """
        self._release_cached_blocks()
        self.table.changes += 1
