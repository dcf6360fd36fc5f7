"""Building blocks shared by memlab's allocator models: blocks, pools, handles, input checks and
the one builder of ``torch.cuda.memory_snapshot()`` segment dicts.

Internal to :mod:`memlab.sources.allocator`, whose ``__init__`` re-exports the public API.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import groupby
from typing import Any

import torch

from memlab._units import parse_size
from memlab.history.recorder import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    History,
    make_history,
)
from memlab.sources.allocator.messages import oom_message
from memlab.sources.allocator.snapshot import allocator_snapshot
from memlab.sources.allocator.stats import StatTable, decrease, increase

__all__ = [
    "KEY_SHIFT",
    "ONE_EXABYTE",
    "AllocatorBase",
    "Block",
    "BlockPool",
    "change_pair",
    "change_split",
    "check_nbytes",
    "snapshot_segments",
]

ONE_EXABYTE = 1_152_921_504_606_846_976
KEY_SHIFT = 64  # a free block's sort key is (size << 64) | address: best fit, then lowest address


def check_nbytes(nbytes: Any) -> int:
    """``nbytes`` as an int number of bytes: ``TypeError`` unless int-like (bools are not),
    ``ValueError`` if negative."""
    if isinstance(nbytes, bool):
        raise TypeError(f"nbytes must be an int number of bytes, got bool {nbytes!r}")
    try:
        value = operator.index(nbytes)
    except TypeError:
        raise TypeError(
            f"nbytes must be an int number of bytes, got {type(nbytes).__name__} {nbytes!r}"
        ) from None
    if value < 0:
        raise ValueError(f"nbytes must be >= 0, got {value}")
    return value


class AllocatorBase:
    """Handles, input checks and the statistics interface shared by both allocators."""

    table: StatTable

    def __init__(self, capacity: int | str | None, history: Any = None) -> None:
        self.capacity: int | None = None if capacity is None else parse_size(capacity, name="capacity")
        self.table = StatTable(aliases={"active": "allocation", "active_bytes": "allocated_bytes"})
        self._live: dict[int, Any] = {}
        self._next_handle = 1
        #: The :class:`~memlab.history.recorder.History` of this allocator's events, or ``None``.
        self.history: History | None = make_history(history)
        if self.history is not None:
            # Recording wraps malloc/free per instance, so an allocator without history runs the
            # class's methods with no extra branch (benchmarks/bench_allocator.py).
            self.malloc = self._recorded_malloc  # type: ignore[method-assign]
            self.free = self._recorded_free  # type: ignore[method-assign]

    def _extent(self, handle: int) -> tuple[int, int]:
        """The address and requested bytes of a live handle's block."""
        raise NotImplementedError

    def block_size(self, handle: int) -> int:
        """The bytes of a live handle's block, as ``allocated_bytes`` counts them."""
        raise NotImplementedError

    def _recorded_malloc(self, nbytes: int) -> int:
        handle = type(self).malloc(self, nbytes)
        if handle:
            addr, requested = self._extent(handle)
            self.history.record(ALLOC, addr, requested)  # type: ignore[union-attr]
        return handle

    def _recorded_free(self, handle: int) -> None:
        if type(handle) is not int or handle not in self._live:
            type(self).free(self, handle)  # frees nothing, or raises for a bad handle
            return
        history: History = self.history  # type: ignore[assignment]
        addr, requested = self._extent(handle)
        stack = history.stack()
        history.record(FREE_REQUESTED, addr, requested, stack)
        type(self).free(self, handle)
        history.record(FREE_COMPLETED, addr, requested, stack)

    def _record_segment(self, alloc: bool, addr: int, size: int) -> None:
        """Record a segment mapped (``alloc``) or released, if this allocator keeps a history."""
        if self.history is not None:
            self.history.record(SEGMENT_ALLOC if alloc else SEGMENT_FREE, addr, size)

    def _bad_handle(self, handle: Any) -> Exception:
        if isinstance(handle, bool) or not isinstance(handle, int):
            return TypeError(
                f"handle must be an int returned by malloc, got {type(handle).__name__} {handle!r}"
            )
        if 0 < handle < self._next_handle:
            return ValueError(f"handle {handle} was already freed (double free)")
        return ValueError(f"unknown handle {handle}: it was not returned by this allocator's malloc")

    def memory_stats(self) -> OrderedDict[str, int]:
        """The statistics of ``torch.cuda.memory_stats()``, same keys, sorted, for the modelled device.

        ``*_bytes.*`` values are bytes, the others counts; ``current``/``peak`` are levels and
        ``allocated``/``freed`` running totals since construction or the last reset.
        """
        return self.table.as_dict()

    def history_snapshot(self, device: int = 0) -> dict[str, Any]:
        """The dict of ``torch.cuda.memory._snapshot()`` for this allocator as CUDA device ``device``:
        ``segments`` (what ``snapshot()`` lists, with PyTorch's extra keys and the frames that
        allocated each block) and ``device_traces`` (this allocator's :attr:`history`, empty
        without one). See :func:`memlab.sources.allocator.snapshot.allocator_snapshot`.
        ``snapshot()`` keeps returning only the segments, as ``torch.cuda.memory_snapshot()``
        does."""
        return allocator_snapshot(self, device)

    def reset_peak_memory_stats(self) -> None:
        """Set every ``peak`` to its ``current`` value, like ``torch.cuda.reset_peak_memory_stats()``."""
        self.table.reset_peaks()

    def reset_accumulated_memory_stats(self) -> None:
        """Zero the ``allocated``/``freed`` totals and event counters, like
        ``torch.cuda.reset_accumulated_memory_stats()``."""
        self.table.reset_accumulated()
        self.table.changes += 1

    def _oom(self, tried: int) -> torch.OutOfMemoryError:
        self.table.counters["num_ooms"] += 1
        self.table.changes += 1
        stats = self.table.stats
        allocated = stats["allocated_bytes.all"][0]
        reserved = stats["reserved_bytes.all"][0]
        capacity = self.capacity if self.capacity is not None else 0
        if self.history is not None:
            self.history.record(OOM, capacity - reserved, tried)
        return torch.OutOfMemoryError(oom_message(tried, capacity, capacity - reserved, allocated, reserved))


class Block:
    """A contiguous range of a segment: allocated to a handle, or free and cached in its pool.

    The blocks of a segment form a doubly linked chain in address order. The caching model's
    malloc/free relink blocks inline (they are the hot path); everything else uses the methods.
    """

    __slots__ = ("addr", "allocated", "mapped", "next", "pool", "prev", "requested", "size")

    def __init__(self, addr: int, size: int, pool: BlockPool) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.mapped = True  # False only for unmapped address space of an expandable segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.pool = pool

    def link_before(self, new: Block) -> None:
        """Put ``new`` into the chain right before this block."""
        new.prev = prev = self.prev
        if prev is not None:
            prev.next = new
        new.next = self
        self.prev = new

    def link_after(self, new: Block) -> None:
        """Put ``new`` into the chain right after this block."""
        new.next = nxt = self.next
        if nxt is not None:
            nxt.prev = new
        new.prev = self
        self.next = new

    def absorb(self, neighbour: Block) -> None:
        """Grow over ``neighbour`` (this block's ``prev`` or ``next``), taking it out of the chain."""
        if neighbour is self.prev:
            self.addr = neighbour.addr
            self.prev = prev = neighbour.prev
            if prev is not None:
                prev.next = self
        else:
            self.next = nxt = neighbour.next
            if nxt is not None:
                nxt.prev = self
        self.size += neighbour.size


class BlockPool:
    """Free cached blocks of one pool, sorted by (size, address), and the pool's statistics."""

    __slots__ = (
        "allocated_bytes",
        "allocation",
        "blocks",
        "hot",
        "inactive_split",
        "inactive_split_bytes",
        "keys",
        "name",
        "requested_bytes",
        "reserved_bytes",
        "segment",
        "small",
        "split",
    )

    def __init__(self, table: StatTable, small: bool) -> None:
        self.small = small
        self.name = "small_pool" if small else "large_pool"
        self.keys: list[int] = []
        self.blocks: list[Block] = []
        stats = table.stats
        for stat in (
            "allocation",
            "allocated_bytes",
            "requested_bytes",
            "segment",
            "reserved_bytes",
            "inactive_split",
            "inactive_split_bytes",
        ):
            setattr(self, stat, (stats[f"{stat}.all"], stats[f"{stat}.{self.name}"]))
        # the lists malloc/free touch on every call, unpacked in one go
        self.hot = self.allocation + self.allocated_bytes + self.requested_bytes
        self.split = self.inactive_split + self.inactive_split_bytes

    def insert(self, block: Block) -> None:
        """Cache a free block (kept sorted for best fit)."""
        key = (block.size << KEY_SHIFT) | block.addr
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        """Take a cached free block out of the pool."""
        i = bisect_left(self.keys, (block.size << KEY_SHIFT) | block.addr)
        del self.keys[i]
        del self.blocks[i]


def change_pair(stats: tuple[list[int], list[int]], amount: int) -> None:
    """Apply a net change to a pair of (all, pool) statistics, as an increase or a decrease."""
    if amount > 0:
        increase(stats[0], amount)
        increase(stats[1], amount)
    elif amount < 0:
        decrease(stats[0], -amount)
        decrease(stats[1], -amount)


def change_split(split: tuple[list[int], ...], blocks: int, nbytes: int) -> None:
    """Apply free_block's net changes to ``inactive_split`` and ``inactive_split_bytes`` (all, pool)."""
    change_pair((split[0], split[1]), blocks)
    change_pair((split[2], split[3]), nbytes)


def snapshot_segments(blocks: Iterable[Block], expandable: bool = False) -> list[dict[str, Any]]:
    """The segments of ``torch.cuda.memory_snapshot()`` for a model's blocks, sorted by address.

    ``blocks`` must hold every block of every segment: allocated, cached and (for expandable
    segments) unmapped. Each chain of linked blocks is one segment; with ``expandable`` each
    contiguous mapped run of a chain is reported as one segment, as PyTorch does. Each segment:
    ``address``, ``total_size``, ``allocated_size``, ``requested_size``, ``segment_type``
    (``"small"``/``"large"``), ``is_expandable`` and ``blocks``; each block: ``address``, ``size``
    (granted bytes), ``requested_size`` (0 for a free block), ``allocated`` (bool) and ``state``
    (``"active_allocated"`` or ``"inactive"``). Sizes are bytes.
    """
    segments = []
    for head in sorted((b for b in blocks if b.prev is None), key=operator.attrgetter("addr")):
        for mapped, run in groupby(_chain(head), key=operator.attrgetter("mapped")):
            if mapped:
                segments.append(_segment_info(list(run), expandable))
    return segments


def _chain(head: Block) -> Iterator[Block]:
    block: Block | None = head
    while block is not None:
        yield block
        block = block.next


def _segment_info(blocks: list[Block], expandable: bool) -> dict[str, Any]:
    allocated = [b for b in blocks if b.allocated]
    return {
        "address": blocks[0].addr,
        "total_size": sum(b.size for b in blocks),
        "allocated_size": sum(b.size for b in allocated),
        "requested_size": sum(b.requested for b in allocated),
        "segment_type": "small" if blocks[0].pool.small else "large",
        "is_expandable": expandable,
        "blocks": [_block_info(b) for b in blocks],
    }


def _block_info(block: Block) -> dict[str, Any]:
    return {
        "address": block.addr,
        "size": block.size,
        "requested_size": block.requested if block.allocated else 0,
        "allocated": block.allocated,
        "state": "active_allocated" if block.allocated else "inactive",
    }
