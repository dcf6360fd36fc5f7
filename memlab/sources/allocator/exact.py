"""An allocator that counts exact bytes: no rounding, no caching, one segment per allocation."""

from __future__ import annotations

from typing import Any

from memlab.history.recorder import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    History,
)
from memlab.sources.allocator.blocks import (
    ONE_EXABYTE,
    AllocatorBase,
    Block,
    BlockPool,
    check_nbytes,
    snapshot_segments,
)
from memlab.sources.allocator.config import K_SMALL_SIZE
from memlab.sources.allocator.messages import huge_request

__all__ = ["ExactAllocator"]


class ExactAllocator(AllocatorBase):
    """Exact bytes: every allocation is its own segment of exactly the requested size.

    No rounding and no caching, so ``reserved_bytes == allocated_bytes == requested_bytes`` at all
    times; the pool of a request is ``small_pool`` up to 1 MiB, else ``large_pool``. Same
    interface and keys as :class:`CachingAllocatorModel`; with ``capacity`` a request that does
    not fit raises ``torch.OutOfMemoryError`` (``num_ooms``) at once (nothing is cached, so
    there is no retry). 0 bytes returns handle 0 and changes nothing.
    """

    def __init__(self, capacity: int | str | None = None, history: Any = None) -> None:
        super().__init__(capacity, history)
        self.table.counters["max_split_size"] = -1
        self._small = BlockPool(self.table, small=True)
        self._large = BlockPool(self.table, small=False)
        # what malloc and free change, each as (all, pool): allocation, allocated_bytes,
        # requested_bytes, segment, reserved_bytes
        self._pools = {
            pool.small: pool.hot + pool.segment + pool.reserved_bytes for pool in (self._small, self._large)
        }
        self._reserved_all = self.table.stats["reserved_bytes.all"]

    def malloc(self, nbytes: int) -> int:
        """Allocate exactly ``nbytes`` bytes as a new segment; return a handle for :meth:`free`."""
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        if nbytes >= ONE_EXABYTE:
            raise huge_request()
        if self.capacity is not None and self._reserved_all[0] + nbytes > self.capacity:
            raise self._oom(nbytes)
        small = nbytes <= K_SMALL_SIZE
        amounts = (1, 1, nbytes, nbytes, nbytes, nbytes, 1, 1, nbytes, nbytes)
        # stats.increase, inlined: this is the tracker's hot path with allocator=None, and a call per
        # statistic costs about 10% of the throughput in benchmarks/bench_allocator.py
        for stat, amount in zip(self._pools[small], amounts, strict=True):
            current = stat[0] + amount
            stat[0] = current
            stat[2] += amount
            if current > stat[1]:
                stat[1] = current
            if current > stat[4]:
                stat[4] = current
        self.table.counters["num_device_alloc"] += 1
        self.table.changes += 1
        handle = self._next_handle
        self._next_handle = handle + 1
        self._live[handle] = nbytes
        return handle

    def free(self, handle: int) -> None:
        """Release the segment of ``handle`` at once. ``free(0)`` does nothing; an unknown or
        already freed handle raises ``ValueError``."""
        nbytes = self._live.pop(handle, None)
        if nbytes is None:
            if handle == 0 and type(handle) is int:
                return
            raise self._bad_handle(handle)
        amounts = (1, 1, nbytes, nbytes, nbytes, nbytes, 1, 1, nbytes, nbytes)
        for stat, amount in zip(self._pools[nbytes <= K_SMALL_SIZE], amounts, strict=True):
            stat[0] -= amount
            stat[3] += amount
        self.table.counters["num_device_free"] += 1
        self.table.changes += 1

    def _extent(self, handle: int) -> tuple[int, int]:
        return handle, self._live[handle]  # the address of a block is its handle

    def block_size(self, handle: int) -> int:
        return self._live[handle]

    # With a history each allocation is a segment_alloc and an alloc, each free a free_requested,
    # a free_completed and a segment_free; the address is the handle, as in snapshot().

    def _recorded_malloc(self, nbytes: int) -> int:
        handle = ExactAllocator.malloc(self, nbytes)
        if handle:
            nbytes = self._live[handle]
            history: History = self.history  # type: ignore[assignment]
            stack = history.stack()
            history.record(SEGMENT_ALLOC, handle, nbytes, stack)
            history.record(ALLOC, handle, nbytes, stack)
        return handle

    def _recorded_free(self, handle: int) -> None:
        nbytes = self._live.get(handle) if type(handle) is int else None
        if nbytes is None:
            ExactAllocator.free(self, handle)  # frees nothing, or raises for a bad handle
            return
        history: History = self.history  # type: ignore[assignment]
        stack = history.stack()
        history.record(FREE_REQUESTED, handle, nbytes, stack)
        ExactAllocator.free(self, handle)
        history.record(FREE_COMPLETED, handle, nbytes, stack)
        history.record(SEGMENT_FREE, handle, nbytes, stack)

    def empty_cache(self) -> None:
        """Nothing is cached, so nothing happens (no counter changes)."""

    def snapshot(self) -> list[dict[str, Any]]:
        """One segment per live allocation, each holding one block of exactly the requested size,
        in the format of ``torch.cuda.memory_snapshot()`` (see
        :func:`~memlab.sources.allocator.blocks.snapshot_segments`)."""
        blocks = []
        for handle, nbytes in self._live.items():
            block = Block(handle, nbytes, self._small if nbytes <= K_SMALL_SIZE else self._large)
            block.allocated = True
            block.requested = nbytes
            blocks.append(block)
        return snapshot_segments(blocks)
