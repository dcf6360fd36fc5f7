"""A run's memory after each allocator event, replayed from its memory snapshot: what the plot
draws and what ``TensorTracker.by_category(at="peak")`` reads. Plain Python, no matplotlib.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memlab.sources.allocator.config import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size

__all__ = ["Allocation", "MemorySeries", "Segments", "memory_series"]


class Allocation(NamedTuple):
    """One block of a replayed trace: allocated after event ``start`` (an index into
    :class:`MemorySeries`' lists), freed by event ``end`` (``None``: still live when the trace
    ends), with its granted and requested bytes, category and stack (the trace entry's list of
    frame dicts, ``filename``/``line``/``name``, innermost first; empty where none was recorded).
    It is live after the events ``start`` to ``end - 1``."""

    start: int
    end: int | None
    granted: int
    requested: int
    category: str
    frames: list[dict[str, Any]]


@dataclass
class MemorySeries:
    """A run's memory after each allocator event (an ``alloc``, a ``free_completed``, or a
    ``segment_free``/``segment_unmap`` on its own, e.g. by ``empty_cache()``), in bytes.

    ``allocated[i]`` and ``reserved[i]`` are ``allocated_bytes.all.current`` and
    ``reserved_bytes.all.current`` after event ``i``; ``by_category[name][i]`` the allocated bytes
    of blocks of that category (their sum is ``allocated[i]``). ``peak`` is the first event at
    which ``allocated`` is highest and ``peak_frame`` the innermost frame of the allocation
    there, as ``(filename, line, name)`` (``None`` when none was recorded). ``allocations``:
    every block the trace allocated, in order (filled only when asked, by
    ``memory_series(..., allocations=True)``).
    """

    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    by_category: dict[str, list[int]] = field(default_factory=dict)
    peak: int = 0
    peak_frame: tuple[str, int, str] | None = None
    allocations: list[Allocation] = field(default_factory=list)


class Segments:
    """The segments of a replayed trace and the live blocks in each, to find the bytes a block
    was granted: the free range it was carved from, unless the allocator split that range."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted segment addresses
        self.sizes: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}  # segment address -> sorted live block addresses

    def add(self, addr: int, size: int) -> None:
        bisect.insort(self.starts, addr)
        self.sizes[addr] = size
        self.blocks[addr] = []

    def remove(self, addr: int) -> None:
        self.starts.remove(addr)
        del self.sizes[addr], self.blocks[addr]

    def _segment(self, addr: int) -> int | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.starts[i] + self.sizes[self.starts[i]]:
            return None
        return self.starts[i]

    def allocate(self, addr: int, requested: int) -> int:
        """Record a block at ``addr`` and return the bytes it was granted (as the caching
        allocator grants them: the rounded request, or the whole free range when the remainder
        is too small to split off; the request itself outside any known segment)."""
        segment = self._segment(addr)
        if segment is None:
            return requested
        blocks = self.blocks[segment]
        i = bisect.bisect_right(blocks, addr)
        end = blocks[i] if i < len(blocks) else segment + self.sizes[segment]
        blocks.insert(i, addr)
        free = end - addr
        rounded = round_size(requested)
        remainder = free - rounded
        if remainder <= 0:
            return free
        split = remainder >= K_MIN_BLOCK_SIZE if rounded <= K_SMALL_SIZE else remainder > K_SMALL_SIZE
        return rounded if split else free

    def release(self, addr: int) -> None:
        segment = self._segment(addr)
        if segment is not None and addr in self.blocks[segment]:
            self.blocks[segment].remove(addr)


def _trace(snapshot: dict[str, Any], device: int | None) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces", [])
    if device is None:
        recorded = [i for i, trace in enumerate(traces) if trace]
        if len(recorded) > 1:
            raise ValueError(f"the snapshot has traces for devices {recorded}: pass device= one of them")
        device = recorded[0] if recorded else len(traces) - 1
    if not 0 <= device < len(traces) or not traces[device]:
        raise ValueError(
            f"the snapshot has no trace entries for device {device}: record them with "
            "memlab.TensorTracker(history=True) (or torch.cuda.memory._record_memory_history() "
            f"on a GPU); devices with entries: {[i for i, t in enumerate(traces) if t] or 'none'}"
        )
    return traces[device]


def memory_series(
    snapshot: dict[str, Any], device: int | None = None, *, allocations: bool = False
) -> MemorySeries:
    """Replay the trace of ``device`` (an index into ``snapshot["device_traces"]``; ``None``: the
    one device with entries) of a ``torch.cuda.memory._snapshot()``-format dict.

    Trace entries carry requested bytes; the bytes each block was granted are found from the
    segments' layout with the caching allocator's default rules (512 B rounding, splits of the
    small pool from 512 B on and of the large pool above 1 MiB). Not modelled: a configured
    ``roundup_power2_divisions`` or ``max_split_size_mb`` and expandable segments, where a
    block's granted bytes may then differ. A trace that a ring buffer cut short starts from
    zero at its first entry: what was live before is not in it, and frees of blocks and
    segments it does not know change nothing (a block allocated in such a segment counts its
    requested bytes). With ``allocations``, :attr:`MemorySeries.allocations` lists every block
    the trace allocated (what :mod:`memlab.history.page` stacks and tabulates).
    """
    segments = Segments()
    live: dict[int, tuple[int, str, int]] = {}  # block address -> (granted bytes, category, index)
    blocks: list[list[Any]] = []  # with allocations: [start, end, granted, requested, category, frames]
    series = MemorySeries()
    totals: dict[str, int] = {}
    allocated = reserved = 0
    peak_entry: dict[str, Any] | None = None
    for entry in _trace(snapshot, device):
        action, addr = entry["action"], entry.get("addr", 0)
        if action in ("segment_alloc", "segment_map"):
            segments.add(addr, entry["size"])
            reserved += entry["size"]
            continue
        if action == "alloc":
            category = entry.get("category") or "unknown"
            granted = segments.allocate(addr, entry["size"])
            live[addr] = (granted, category, len(blocks))
            if allocations:
                blocks.append(
                    [len(series.allocated), None, granted, entry["size"], category, entry.get("frames") or []]
                )
            allocated += granted
            totals[category] = totals.get(category, 0) + granted
        elif action == "free_completed":
            if addr in live:  # not when a ring buffer dropped its allocation
                granted, category, index = live.pop(addr)
                if allocations:
                    blocks[index][1] = len(series.allocated)
                segments.release(addr)
                allocated -= granted
                totals[category] -= granted
        elif action in ("segment_free", "segment_unmap"):
            if addr in segments.sizes:
                segments.remove(addr)
                reserved -= entry["size"]
        else:
            continue
        for name in totals.keys() - series.by_category.keys():
            series.by_category[name] = [0] * len(series.allocated)
        for name, values in series.by_category.items():
            values.append(totals[name])
        if action == "alloc" and (peak_entry is None or allocated > series.allocated[series.peak]):
            series.peak, peak_entry = len(series.allocated), entry
        series.allocated.append(allocated)
        series.reserved.append(reserved)
    if peak_entry is not None and peak_entry.get("frames"):
        frame = peak_entry["frames"][0]
        series.peak_frame = (frame["filename"], frame["line"], frame["name"])
    series.allocations = [Allocation._make(block) for block in blocks]
    return series
