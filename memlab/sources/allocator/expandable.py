"""``expandable_segments:True``: one growing segment per pool instead of one ``cudaMalloc`` per segment.

Follows ``CUDACachingAllocator.cpp`` (Note [Expandable Segments]) for one stream: each pool owns a
large virtual address range; physical pages (2 MiB for the small pool, 20 MiB for the large pool)
are mapped at the lowest address where a request fits, counted in ``reserved_bytes`` and
``num_device_alloc`` (one per mapping call), and unmapped page by page on ``empty_cache()`` or the
retry path (``num_device_free`` per unmapped range). Blocks split whenever the remainder is at
least 512 B, in both pools. As in PyTorch, mappings do not count as ``segment``/``oversize_segments``
and expandable blocks are left out of ``inactive_split``.

Simplifications, all invisible unless noted: the address range is unbounded, so a second
expandable segment is never needed (PyTorch reserves 1⅛ × the device memory and starts another
segment only when that range is too fragmented); with ``max_split_size_mb`` the retry path skips
``release_available_cached_blocks`` (PyTorch asserts there, since expandable blocks cannot be
``cudaFree``'d).
"""

from __future__ import annotations

from bisect import bisect_left

from memlab.history.recorder import SEGMENT_MAP, SEGMENT_UNMAP, History
from memlab.sources.allocator.blocks import KEY_SHIFT, Block, BlockPool, change_pair
from memlab.sources.allocator.config import K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, AllocatorConfig
from memlab.sources.allocator.stats import StatTable

__all__ = ["ExpandableSegments"]

_ADDRESS_SPACE = 1 << 50  # bytes of virtual address space per expandable segment (1 PiB)


class _Segment:
    """One pool's expandable segment: its address range and its unmapped blocks by address."""

    __slots__ = ("base", "end", "page", "unmapped", "unmapped_addrs")

    def __init__(self, base: int, page: int) -> None:
        self.base = base
        self.page = page
        self.end = base + _ADDRESS_SPACE // page * page
        self.unmapped_addrs: list[int] = []
        self.unmapped: list[Block] = []

    def add_unmapped(self, block: Block) -> None:
        i = bisect_left(self.unmapped_addrs, block.addr)
        self.unmapped_addrs.insert(i, block.addr)
        self.unmapped.insert(i, block)

    def remove_unmapped(self, block: Block) -> None:
        i = bisect_left(self.unmapped_addrs, block.addr)
        del self.unmapped_addrs[i]
        del self.unmapped[i]


def _allocatable(block: Block | None) -> bool:
    return block is not None and not block.allocated


def _expandable_size(block: Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class ExpandableSegments:
    """The expandable-segment half of a ``CachingAllocatorModel`` (see the module docstring).

    It shares the model's statistics ``table`` (``reserved_bytes``, ``num_device_alloc`` and
    ``num_device_free`` change as pages are mapped and unmapped), its two pools of free blocks,
    its ``config`` (``max_split_size``) and ``capacity`` (bytes, ``None`` for unlimited). Address
    ranges are laid out from ``base_address`` on. The model keeps the allocated blocks and the
    retry path; this object finds, maps, splits, merges and unmaps blocks, and records each
    mapping and unmapping in ``history`` (``segment_map``/``segment_unmap``, as PyTorch does).
    """

    def __init__(
        self,
        table: StatTable,
        small: BlockPool,
        large: BlockPool,
        config: AllocatorConfig,
        capacity: int | None,
        base_address: int,
        history: History | None = None,
    ) -> None:
        self.segments: dict[BlockPool, _Segment] = {}
        self._counters = table.counters
        self._reserved_all = table.stats["reserved_bytes.all"]
        self._pools = (large, small)  # the order in which release() unmaps
        self._config = config
        self._capacity = capacity
        self._next_base = base_address
        self._bases: dict[BlockPool, int] = {}  # a pool's address range, reused when it is recreated
        self._history = history

    # -- malloc ------------------------------------------------------------------------------------

    def split(self, block: Block, size: int) -> Block:
        """The first ``size`` rounded bytes of ``block``, the rest cached as a free block when at
        least 512 B remain (in both pools). Neither is marked allocated nor counted."""
        pool = block.pool
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK_SIZE:
            rest = block
            block = Block(rest.addr, size, pool)
            rest.link_before(block)
            rest.addr += size
            rest.size = remaining
            pool.insert(rest)
        return block

    def get_free_block(self, pool: BlockPool, size: int) -> Block | None:
        """The best fitting cached block for ``size`` rounded bytes, taken out of ``pool``; ``None``
        when no block fits or only an oversize one would (``max_split_size``)."""
        keys = pool.keys
        blocks = pool.blocks
        i = bisect_left(keys, size << KEY_SHIFT)
        if i == len(keys):
            return None
        # best fit counts a block at the end of the mapped range as able to grow into unmapped space
        while i + 1 < len(keys) and _expandable_size(blocks[i + 1]) < _expandable_size(blocks[i]):
            i += 1
        block = blocks[i]
        config = self._config
        max_split = config.max_split_size
        if (size < max_split <= block.size) or (
            size >= max_split and block.size >= size + config.max_non_split_rounding_size
        ):
            return None
        del keys[i]
        del blocks[i]
        return block

    def _segment(self, pool: BlockPool) -> _Segment:
        segment = self.segments.get(pool)
        if segment is None:
            base = self._bases.get(pool)
            if base is None:
                base = self._bases[pool] = self._next_base
                self._next_base += _ADDRESS_SPACE
            segment = _Segment(base, K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER)
            whole = Block(segment.base, segment.end - segment.base, pool)
            whole.mapped = False
            segment.add_unmapped(whole)
            self.segments[pool] = segment
        return segment

    def try_allocate(self, pool: BlockPool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address where ``size`` rounded
        bytes fit and return that free block, taken out of ``pool``; ``None`` when the pages would
        exceed ``capacity``."""
        segment = self._segment(pool)
        candidate = self._find_expandable_block(segment, size)
        if not candidate.mapped and not self._map_block(pool, segment, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(pool, segment, following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, segment: _Segment, size: int) -> Block:
        for block in segment.unmapped:
            candidate = block.prev if _allocatable(block.prev) else block
            assert candidate is not None
            room = 0
            walker: Block | None = candidate
            while room < size and _allocatable(walker):
                assert walker is not None
                room += walker.size
                walker = walker.next
            if room >= size:
                return candidate
        raise AssertionError("an unbounded expandable segment always has room")  # pragma: no cover

    def _map_block(self, pool: BlockPool, segment: _Segment, to_map: Block, size: int) -> bool:
        page = segment.page
        mapped = -(-size // page) * page
        capacity = self._capacity
        if capacity is not None and self._reserved_all[0] + mapped > capacity:
            return False
        segment.remove_unmapped(to_map)
        mapped_at = to_map.addr
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.addr + mapped, to_map.size - mapped, pool)
            rest.mapped = False
            to_map.link_after(rest)
            to_map.size = mapped
            segment.add_unmapped(rest)
        self._merge_free_neighbours(to_map)
        pool.insert(to_map)
        change_pair(pool.reserved_bytes, mapped)
        self._counters["num_device_alloc"] += 1
        if self._history is not None:
            self._history.record(SEGMENT_MAP, mapped_at, mapped)
        return True

    # -- free -----------------------------------------------------------------------------------------

    def give_back(self, block: Block) -> None:
        """``free_block`` for an expandable block: merge with free mapped neighbours, cache it."""
        self._merge_free_neighbours(block)
        block.pool.insert(block)

    @staticmethod
    def _merge_free_neighbours(block: Block) -> None:
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                block.pool.remove(neighbour)
                block.absorb(neighbour)

    # -- giving memory back -----------------------------------------------------------------------------

    def release(self) -> None:
        """``release_blocks`` for expandable segments: unmap every whole free page (large pool
        first); a segment left with no mapped page is dropped."""
        for pool in self._pools:
            segment = self.segments.get(pool)
            if segment is None:
                continue
            for block in list(pool.blocks):
                self._unmap_block(pool, segment, block)
            if len(segment.unmapped) == 1 and segment.unmapped[0].size == segment.end - segment.base:
                del self.segments[pool]

    def _unmap_block(self, pool: BlockPool, segment: _Segment, block: Block) -> None:
        page = segment.page
        first = -(-(block.addr - segment.base) // page)
        last = (block.addr + block.size - segment.base) // page
        if first >= last:
            return
        start = segment.base + first * page
        stop = segment.base + last * page
        pool.remove(block)
        if start > block.addr:
            before = Block(block.addr, start - block.addr, pool)
            block.link_before(before)
            pool.insert(before)
        end = block.addr + block.size
        if end > stop:
            after = Block(stop, end - stop, pool)
            block.link_after(after)
            pool.insert(after)
        block.addr = start
        block.size = stop - start
        block.mapped = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                segment.remove_unmapped(neighbour)
                block.absorb(neighbour)
        segment.add_unmapped(block)
        change_pair(pool.reserved_bytes, -(stop - start))
        self._counters["num_device_free"] += 1
        if self._history is not None:
            self._history.record(SEGMENT_UNMAP, start, stop - start)

    # -- inspection ---------------------------------------------------------------------------------------

    def unmapped_blocks(self) -> list[Block]:
        """The unmapped address ranges of every expandable segment, as blocks with ``mapped`` False
        (what :func:`~memlab.sources.allocator.blocks.snapshot_segments` needs besides the model's
        allocated and cached blocks)."""
        return [block for segment in self.segments.values() for block in segment.unmapped]
