"""A run's memory after each allocator event, replayed from its memory snapshot: what the plot
draws and what ``TensorTracker.by_category(at="peak")`` reads. Plain Python, no matplotlib.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memlab.sources.allocator.config import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size

__all__ = ["Allocation", "MemorySeries", "Segments", "memory_series", "peak_by_category"]


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


_SIZED = ("alloc", "segment_alloc", "segment_map")  # entries whose size the replay always reads


class _Replay:
    """The running state of a replayed trace: segments, live blocks, allocated and reserved bytes
    and allocated bytes per category, which :meth:`apply` moves one trace entry on. The one replay
    that :func:`memory_series` and :func:`peak_by_category` share, so both give the same numbers."""

    def __init__(self) -> None:
        self.segments = Segments()
        self.live: dict[int, tuple[int, str, int]] = {}  # block address -> (granted, category, number)
        self.totals: dict[str, int] = {}
        self.allocated = 0
        self.reserved = 0

    def apply(self, action: str, addr: int, size: int, category: str | None, number: int) -> int | None:
        """Replay one entry (``number``: an ``alloc``'s, given back by the ``free_completed`` of its
        block). ``None`` for an entry that is no event of the series (segments mapped, frees
        requested, OOMs); else for an ``alloc`` -1, for a ``free_completed`` the number of the block's
        ``alloc`` (-1 when a ring buffer dropped it), and -1 for the rest."""
        if action in ("segment_alloc", "segment_map"):
            self.segments.add(addr, size)
            self.reserved += size
            return None
        if action == "alloc":
            category = category or "unknown"
            granted = self.segments.allocate(addr, size)
            self.live[addr] = (granted, category, number)
            self.allocated += granted
            self.totals[category] = self.totals.get(category, 0) + granted
            return -1
        if action == "free_completed":
            found = self.live.pop(addr, None)
            if found is None:  # a ring buffer dropped its allocation
                return -1
            granted, category, number = found
            self.segments.release(addr)
            self.allocated -= granted
            self.totals[category] -= granted
            return number
        if action in ("segment_free", "segment_unmap"):
            if addr in self.segments.sizes:
                self.segments.remove(addr)
                self.reserved -= size
            return -1
        return None


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
    replay = _Replay()
    blocks: list[list[Any]] = []  # with allocations: [start, end, granted, requested, category, frames]
    series = MemorySeries()
    totals = replay.totals
    peak_entry: dict[str, Any] | None = None
    for entry in _trace(snapshot, device):
        action, addr = entry["action"], entry.get("addr", 0)
        size = entry["size"] if action in _SIZED else entry.get("size", 0)
        number = replay.apply(action, addr, size, entry.get("category"), len(blocks))
        if number is None:
            continue
        if action == "alloc":
            if allocations:
                granted, category, _ = replay.live[addr]
                blocks.append(
                    [len(series.allocated), None, granted, size, category, entry.get("frames") or []]
                )
        elif number >= 0 and allocations:
            blocks[number][1] = len(series.allocated)
        for name in totals.keys() - series.by_category.keys():
            series.by_category[name] = [0] * len(series.allocated)
        for name, values in series.by_category.items():
            values.append(totals[name])
        if action == "alloc" and (peak_entry is None or replay.allocated > series.allocated[series.peak]):
            series.peak, peak_entry = len(series.allocated), entry
        series.allocated.append(replay.allocated)
        series.reserved.append(replay.reserved)
    if peak_entry is not None and peak_entry.get("frames"):
        frame = peak_entry["frames"][0]
        series.peak_frame = (frame["filename"], frame["line"], frame["name"])
    series.allocations = [Allocation._make(block) for block in blocks]
    return series


def peak_by_category(entries: Iterable[tuple[str, int, int, str]]) -> dict[str, int]:
    """The allocated bytes per category at the peak of a trace given as ``(action, address,
    size, category)`` entries, oldest first (a :class:`~memlab.history.recorder.History`'s,
    without building its snapshot): ``memory_series(snapshot).by_category`` at its ``peak``,
    replayed the same way, for the categories that had a block by then (an empty dict for a
    trace without an ``alloc``)."""
    replay = _Replay()
    totals = replay.totals
    peak: dict[str, int] = {}
    highest = -1
    for action, addr, size, category in entries:
        if replay.apply(action, addr, size, category, 0) is not None and action == "alloc":
            if replay.allocated > highest:
                highest, peak = replay.allocated, dict(totals)
    return peak
