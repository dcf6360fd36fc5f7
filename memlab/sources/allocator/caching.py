"""A model of PyTorch's CUDA caching allocator (native backend) for machines without a GPU.

:class:`CachingAllocatorModel` replays ``malloc``/``free`` with the rules of
``c10/cuda/CUDACachingAllocator.cpp`` (rounding, small/large pools, best fit, splitting, merging,
segments, the retry path and the OOM error) and keeps the statistics ``torch.cuda.memory_stats()``
reports. This module holds the blocks (``malloc``/``free``: best fit, splitting, merging);
:mod:`.segments` the segments they are carved from (``cudaMalloc``, the retry path,
``empty_cache``).

What it cannot see: streams (one stream is modelled, so ``active`` always equals
``allocation``), CUDA events, CUDA graphs and private pools, kernel workspaces (cuBLAS, cuDNN),
the CUDA context, NCCL buffers, memory used by other processes or fragmentation they cause, and
the driver's own allocation granularity. Segment addresses are invented (segments are laid out in
allocation order), so when two free blocks of equal size tie in best fit, the choice between them
may differ from a GPU's.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from memlab._units import parse_size
from memlab.sources.allocator.blocks import (
    KEY_SHIFT,
    ONE_EXABYTE,
    AllocatorBase,
    Block,
    BlockPool,
    change_split,
    check_nbytes,
    snapshot_segments,
)
from memlab.sources.allocator.config import (
    K_MIN_BLOCK_SIZE,
    K_SMALL_SIZE,
    UNLIMITED,
    AllocatorConfig,
    parse_alloc_conf,
    round_size,
)
from memlab.sources.allocator.expandable import ExpandableSegments
from memlab.sources.allocator.messages import huge_request
from memlab.sources.allocator.segments import CachingSegments
from memlab.sources.allocator.stats import decrease, increase

__all__ = ["CachingAllocatorModel"]

_FIRST_ADDRESS = 0x7F0000000000  # where the first invented segment (or expandable range) starts


class CachingAllocatorModel(CachingSegments, AllocatorBase):
    """PyTorch's CUDA caching allocator (native backend, one device, one stream), replayed in Python.

    ``malloc(nbytes)`` returns an int handle (0 for 0 bytes, like PyTorch's null pointer) and
    ``free(handle)`` gives the block back; both update ``memory_stats()`` exactly as the C++
    allocator does. ``capacity`` (bytes, or a string like ``"16 GiB"``) is the device's total
    memory available to this process; ``None`` means unlimited. ``config`` is a
    ``PYTORCH_CUDA_ALLOC_CONF``-style string (see :func:`parse_alloc_conf`); ``None`` reads the
    environment. ``table`` is the live :class:`StatTable` (for cheap samplers).

    Memory is in bytes throughout. With ``capacity`` a new segment that does not fit triggers
    PyTorch's fallbacks in order: free enough oversize cached segments (only with
    ``max_split_size_mb``), then free every unsplit cached segment and count
    ``num_alloc_retries``, then raise ``torch.OutOfMemoryError`` with PyTorch's message and count
    ``num_ooms``. ``expandable_segments:True`` switches to the model in
    :mod:`memlab.sources.allocator.expandable`.

    Not modelled: streams and events (``active == allocation`` always), CUDA graphs and private
    pools, memory fractions and garbage collection (which needs one), free-memory callbacks,
    kernel workspaces, the CUDA context, other processes, and the driver's page granularity
    (``capacity`` is compared with reserved bytes exactly).
    """

    def __init__(
        self, capacity: int | str | None = None, config: str | None = None, history: Any = None
    ) -> None:
        super().__init__(capacity, history)
        self.config: AllocatorConfig = parse_alloc_conf(config)
        self.table.counters["max_split_size"] = self.config.reported_max_split_size
        self._max_split = self.config.max_split_size
        self._plain_rounding = not any(d > 1 for d in self.config.roundup_power2_divisions)
        self._small = BlockPool(self.table, small=True)
        self._large = BlockPool(self.table, small=False)
        self._oversize_allocations = self.table.stats["oversize_allocations"]
        self._oversize_segments = self.table.stats["oversize_segments"]
        self._next_addr = _FIRST_ADDRESS
        self._expandable: ExpandableSegments | None = None
        if self.config.expandable_segments:
            self._expandable = ExpandableSegments(
                self.table,
                self._small,
                self._large,
                self.config,
                self.capacity,
                base_address=_FIRST_ADDRESS,
                history=self.history,
            )

    def set_capacity(self, capacity: int | str | None) -> None:
        """Change the device's memory from now on (bytes, a size such as ``"16 GiB"``, or ``None``
        for unlimited): a state replayed under one capacity can then be measured under another.
        Segments already reserved stay, even above the new capacity."""
        self.capacity = None if capacity is None else parse_size(capacity, name="capacity")
        if self._expandable is not None:
            self._expandable._capacity = self.capacity

    # -- the hot path -------------------------------------------------------------------------
    # malloc and free update their statistics unrolled, with literal indices into the stat lists
    # (0 current, 1 peak, 2 allocated, 3 freed, 4 window peak; see memlab.sources.allocator.stats): a loop or
    # a helper call per statistic cost 20-30% of the throughput in benchmarks/bench_allocator.py.

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` bytes and return a handle for :meth:`free`.

        The request is rounded (:func:`round_size`), served from the best-fitting cached block of
        its pool or from a new segment, and split when the remainder is large enough. 0 bytes
        returns handle 0 and changes nothing (PyTorch returns a null pointer). With ``capacity``,
        a segment that does not fit first frees cached segments (``num_alloc_retries``) and then
        raises ``torch.OutOfMemoryError`` (``num_ooms``), leaving the model consistent.
        Raises ``TypeError``/``ValueError`` for a non-int or negative size.
        """
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        if nbytes >= ONE_EXABYTE:
            raise huge_request()
        if self._plain_rounding:
            size = (nbytes + 511) & -512 if nbytes > K_MIN_BLOCK_SIZE else K_MIN_BLOCK_SIZE
        else:
            size = round_size(nbytes, self.config)
        pool = self._small if size <= K_SMALL_SIZE else self._large
        max_split = self._max_split
        expandable = self._expandable
        if expandable is not None:
            block = expandable.get_free_block(pool, size)
            if block is None:
                block = self._alloc_block(pool, size)
            block = expandable.split(block, size)
        else:
            keys = pool.keys
            i = bisect_left(keys, size << KEY_SHIFT)
            block = None
            if i < len(keys):
                block = pool.blocks[i]
                if max_split != UNLIMITED and (
                    (size < max_split <= block.size)
                    or (size >= max_split and block.size >= size + self.config.max_non_split_rounding_size)
                ):
                    block = None
                else:
                    del keys[i]
                    del pool.blocks[i]
            if block is None:
                block = self._alloc_block(pool, size)

            remaining = block.size - size
            already_split = block.prev is not None or block.next is not None
            if (
                remaining >= K_MIN_BLOCK_SIZE
                if pool.small
                else (size < max_split and remaining > K_SMALL_SIZE)
            ):
                rest = block
                block = Block(rest.addr, size, pool)
                prev = rest.prev
                block.prev = prev
                if prev is not None:
                    prev.next = block
                block.next = rest
                rest.prev = block
                rest.addr = addr = rest.addr + size
                rest.size = remaining
                keys = pool.keys
                key = (remaining << KEY_SHIFT) | addr
                i = bisect_left(keys, key)
                keys.insert(i, key)
                pool.blocks.insert(i, rest)
                if already_split:  # an inactive split block shrinks by the allocated part
                    _, _, sb0, sb1 = pool.split
                    sb0[0] -= size
                    sb0[3] += size
                    sb1[0] -= size
                    sb1[3] += size
                else:  # a whole segment becomes split: its remainder is a new inactive split block
                    change_split(pool.split, 1, remaining)
            elif already_split:  # an inactive split block becomes active as a whole
                n0, n1, sb0, sb1 = pool.split
                bsize = block.size
                n0[0] -= 1
                n0[3] += 1
                n1[0] -= 1
                n1[3] += 1
                sb0[0] -= bsize
                sb0[3] += bsize
                sb1[0] -= bsize
                sb1[3] += bsize

        block.allocated = True
        block.requested = nbytes
        bsize = block.size
        a0, a1, b0, b1, r0, r1 = pool.hot
        current = a0[0] + 1
        a0[0] = current
        a0[2] += 1
        if current > a0[1]:
            a0[1] = current
        if current > a0[4]:
            a0[4] = current
        current = a1[0] + 1
        a1[0] = current
        a1[2] += 1
        if current > a1[1]:
            a1[1] = current
        if current > a1[4]:
            a1[4] = current
        current = b0[0] + bsize
        b0[0] = current
        b0[2] += bsize
        if current > b0[1]:
            b0[1] = current
        if current > b0[4]:
            b0[4] = current
        current = b1[0] + bsize
        b1[0] = current
        b1[2] += bsize
        if current > b1[1]:
            b1[1] = current
        if current > b1[4]:
            b1[4] = current
        current = r0[0] + nbytes
        r0[0] = current
        r0[2] += nbytes
        if current > r0[1]:
            r0[1] = current
        if current > r0[4]:
            r0[4] = current
        current = r1[0] + nbytes
        r1[0] = current
        r1[2] += nbytes
        if current > r1[1]:
            r1[1] = current
        if current > r1[4]:
            r1[4] = current
        if bsize >= max_split:
            increase(self._oversize_allocations, 1)
        handle = self._next_handle
        self._next_handle = handle + 1
        self._live[handle] = block
        self.table.changes += 1
        return handle

    def free(self, handle: int) -> None:
        """Return the block of ``handle`` to its pool, merging it with free neighbours.

        The memory stays reserved (cached) until :meth:`empty_cache` or the retry path of a
        failing :meth:`malloc`. ``free(0)`` does nothing (freeing a null pointer). Raises
        ``ValueError`` for an unknown or already freed handle, ``TypeError`` for a non-int.
        """
        block = self._live.pop(handle, None)
        if block is None:
            if handle == 0 and type(handle) is int:
                return
            raise self._bad_handle(handle)
        pool = block.pool
        bsize = block.size
        requested = block.requested
        a0, a1, b0, b1, r0, r1 = pool.hot
        a0[0] -= 1
        a0[3] += 1
        a1[0] -= 1
        a1[3] += 1
        b0[0] -= bsize
        b0[3] += bsize
        b1[0] -= bsize
        b1[3] += bsize
        r0[0] -= requested
        r0[3] += requested
        r1[0] -= requested
        r1[3] += requested
        if bsize >= self._max_split:
            decrease(self._oversize_allocations, 1)
        block.allocated = False
        if self._expandable is not None:
            self._expandable.give_back(block)
            self.table.changes += 1
            return
        merged_blocks = 0
        keys = pool.keys
        blocks = pool.blocks
        prev = block.prev
        if prev is not None and not prev.allocated:
            i = bisect_left(keys, (prev.size << KEY_SHIFT) | prev.addr)
            del keys[i]
            del blocks[i]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev = prev.prev
            if prev is not None:
                prev.next = block
            merged_blocks = 1
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            i = bisect_left(keys, (nxt.size << KEY_SHIFT) | nxt.addr)
            del keys[i]
            del blocks[i]
            block.size += nxt.size
            block.next = nxt = nxt.next
            if nxt is not None:
                nxt.prev = block
            merged_blocks += 1
        key = (block.size << KEY_SHIFT) | block.addr
        i = bisect_left(keys, key)
        keys.insert(i, key)
        blocks.insert(i, block)
        # free_block's net change of inactive split blocks: the merged neighbours stop counting,
        # the result counts if it is still only part of its segment.
        net_bytes = bsize - block.size
        if block.prev is not None or block.next is not None:
            merged_blocks -= 1
            net_bytes += block.size
        if net_bytes > 0:  # the common case: a block of a split segment became free
            n0, n1, sb0, sb1 = pool.split
            current = sb0[0] + net_bytes
            sb0[0] = current
            sb0[2] += net_bytes
            if current > sb0[1]:
                sb0[1] = current
            if current > sb0[4]:
                sb0[4] = current
            current = sb1[0] + net_bytes
            sb1[0] = current
            sb1[2] += net_bytes
            if current > sb1[1]:
                sb1[1] = current
            if current > sb1[4]:
                sb1[4] = current
            if merged_blocks == -1:  # no neighbour merged: one more inactive split block
                current = n0[0] + 1
                n0[0] = current
                n0[2] += 1
                if current > n0[1]:
                    n0[1] = current
                if current > n0[4]:
                    n0[4] = current
                current = n1[0] + 1
                n1[0] = current
                n1[2] += 1
                if current > n1[1]:
                    n1[1] = current
                if current > n1[4]:
                    n1[4] = current
            elif merged_blocks:
                change_split(pool.split, -merged_blocks, 0)
        elif merged_blocks or net_bytes:
            change_split(pool.split, -merged_blocks, net_bytes)
        self.table.changes += 1

    def _extent(self, handle: int) -> tuple[int, int]:
        block = self._live[handle]
        return block.addr, block.requested

    def block_size(self, handle: int) -> int:
        return self._live[handle].size

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments and their blocks, sorted by (invented) address, in the format of
        ``torch.cuda.memory_snapshot()`` (see :func:`~memlab.sources.allocator.blocks.snapshot_segments`).

        With ``expandable_segments`` each contiguous mapped range is reported as one segment.
        """
        blocks = [*self._live.values(), *self._small.blocks, *self._large.blocks]
        if self._expandable is None:
            return snapshot_segments(blocks)
        return snapshot_segments(blocks + self._expandable.unmapped_blocks(), expandable=True)
