"""One test call measured: its tensors' peak and leftover bytes, and the lines that allocated them.

On a machine where the measured device is a CUDA GPU, PyTorch's own allocator statistics
(``torch.cuda.memory_stats``) and history (``torch.cuda.memory._record_memory_history``); anywhere
else a :class:`memlab.TensorTracker` entered for the call, whose CUDA caching allocator model gives
the numbers a GPU would show. Both end in the same memory snapshot format, which one replay reads.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import linecache
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memlab._devices import cuda_device_exists, default_device, parse_device, with_index
from memlab.history.recorder import is_own_file
from memlab.history.series import Segments
from memlab.sources.tracker import TensorTracker
from memlab.sources.workspace_note import ModelledWorkspaces, tracker_workspaces

__all__ = ["Measurement", "Site", "measured"]

_Live = dict[int, tuple[int, tuple[str, int]]]  # block address -> (granted bytes, (file, line))


@dataclass
class Site:
    """A source line and the bytes (``nbytes``, as the allocator granted them) of the ``tensors``
    blocks allocated there that were alive at the moment asked about."""

    filename: str
    line: int
    nbytes: int = 0
    tensors: int = 0

    def where(self, root: str | None = None) -> str:
        """``file:line``, the file relative to ``root`` when it lies below it."""
        name = self.filename
        if root is not None and os.path.isabs(name):
            relative = os.path.relpath(name, root)
            if not relative.startswith(os.pardir):
                name = relative
        return f"{name}:{self.line}"

    def code(self) -> str:
        """The source text of the line, stripped (empty when the file cannot be read)."""
        return linecache.getline(self.filename, self.line).strip()


@dataclass
class Measurement:
    """What a test call did to the memory of ``device``, in bytes: the peaks of allocated and
    reserved bytes above their values when the call began, and the allocated bytes still held
    at its end (``leaked``, after ``gc.collect()`` when leaks are checked). ``snapshot``: the
    memory snapshot with the call's history (``None`` when none was recorded)."""

    device: str = "cpu"
    allocated_peak: int = 0
    reserved_peak: int = 0
    leaked: int = 0
    snapshot: dict[str, Any] | None = field(default=None, repr=False)
    #: The modelled cuBLAS workspaces the peaks include (a tracker's run that did a matmul; ``None``
    #: on a real GPU, whose allocator holds its own, or where none was modelled).
    workspaces: ModelledWorkspaces | None = None

    def peak(self, metric: str) -> int:
        """The peak of ``metric``: ``"allocated"`` or ``"reserved"``."""
        return self.allocated_peak if metric == "allocated" else self.reserved_peak

    def peak_sites(self, metric: str) -> list[Site]:
        """The lines whose blocks were alive when ``metric`` first reached its peak, most bytes first."""
        trace = self._trace()
        best, stop = -1, -1
        for i, allocated, reserved, _ in _replay(trace):
            value = allocated if metric == "allocated" else reserved
            if trace[i]["action"] == "alloc" and value > best:  # after the alloc, with its segment
                best, stop = value, i
        for i, _, _, live in _replay(trace):
            if i == stop:
                return _sites(live.values())
        return []

    def leak_sites(self) -> list[Site]:
        """The lines whose blocks, allocated during the call, were still alive at its end."""
        blocks: _Live = {}
        for _, _, _, blocks in _replay(self._trace()):  # noqa: B007 (the blocks after the last entry)
            pass
        return _sites(blocks.values())

    def _trace(self) -> list[dict[str, Any]]:
        if self.snapshot is None:
            return []
        traces = [trace for trace in self.snapshot.get("device_traces", []) if trace]
        return traces[-1] if traces else []


def _user_line(frames: list[dict[str, Any]]) -> tuple[str, int]:
    """The innermost frame outside torch and memlab: the line of the user's code that allocated."""
    for frame in frames:
        name = frame["filename"]
        if name.endswith(".py") and not is_own_file(name):
            return name, frame["line"]
    return "<unknown>", 0


def _replay(trace: list[dict[str, Any]]) -> Iterator[tuple[int, int, int, _Live]]:
    """``(entry index, allocated, reserved, live blocks)`` after each entry of ``trace``; live
    blocks map an address to ``(granted bytes, (file, line))``. The dict is the same object each time."""
    segments = Segments()
    live: _Live = {}
    allocated = reserved = 0
    for i, entry in enumerate(trace):
        action, addr = entry["action"], entry.get("addr", 0)
        if action in ("segment_alloc", "segment_map"):
            segments.add(addr, entry["size"])
            reserved += entry["size"]
        elif action == "alloc":
            granted = segments.allocate(addr, entry["size"])
            live[addr] = (granted, _user_line(entry.get("frames") or []))
            allocated += granted
        elif action == "free_completed" and addr in live:
            allocated -= live.pop(addr)[0]
            segments.release(addr)
        elif action in ("segment_free", "segment_unmap") and addr in segments.sizes:
            segments.remove(addr)
            reserved -= entry["size"]
        yield i, allocated, reserved, live


def _sites(blocks: Any) -> list[Site]:
    sites: dict[tuple[str, int], Site] = {}
    for nbytes, where in blocks:
        site = sites.get(where)
        if site is None:
            site = sites[where] = Site(*where)
        site.nbytes += nbytes
        site.tensors += 1
    return sorted(sites.values(), key=lambda s: (-s.nbytes, s.filename, s.line))


def _gpu(device: str | None) -> torch.device | None:
    """The CUDA device that measures the call: ``device`` when it is a CUDA GPU present here, the
    current one for ``device=None`` on a machine with a GPU, else ``None`` (a tracker models it)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    parsed = parse_device(device)
    return parsed if cuda_device_exists(parsed) else None


@contextlib.contextmanager
def measured(
    device: str | None = None, history: bool = True, leaks: bool = False, into: Measurement | None = None
) -> Iterator[Measurement]:
    """Measure the block: the :class:`Measurement` yielded (``into``, or a new one) is filled when
    it ends, also when it raises.

    ``device`` (``None``, or a string :func:`memlab._devices.parse_device` reads): a CUDA GPU
    present here is measured by its own statistics: peaks are ``torch.cuda.max_memory_allocated``
    / ``max_memory_reserved`` minus the values when the block began (this resets CUDA's peak
    counters) and, with ``history``, PyTorch records its history for the block (clearing what it
    had recorded). Anything else is modelled by a :class:`memlab.TensorTracker` entered for the
    block: it counts the tensors made inside it (not those that existed before), on the device
    asked for, or with ``device=None`` or a CUDA device absent here, on the device where they
    peaked highest. ``leaks``: run ``gc.collect()`` before reading what is left.

    A tracker's peaks include the cuBLAS workspaces its modelled GPU allocates at the block's first
    matmul (``measurement.workspaces``; ``CUBLAS_WORKSPACE_CONFIG=:0:0`` turns them off). What it
    cannot see is what a tracker or ``torch.cuda.memory_stats`` cannot see: cuDNN workspaces
    (tracker), the CUDA context, memory allocated outside PyTorch's allocator.
    """
    __tracebackhide__ = True
    measurement = Measurement() if into is None else into
    gpu = _gpu(device)
    if gpu is not None:
        with _on_gpu(gpu, measurement, history, leaks):
            yield measurement
        return
    tracker = TensorTracker(history=history or None)
    try:
        with tracker:
            yield measurement
    finally:
        if leaks:
            gc.collect()
        _read_tracker(tracker, device, measurement, history)


def _read_tracker(
    tracker: TensorTracker, device: str | None, measurement: Measurement, history: bool
) -> None:
    wanted = None if device is None else with_index(parse_device(device))
    if wanted is not None and wanted.type != "cuda":
        chosen = wanted
    else:
        seen = tracker.devices or [default_device()]
        chosen = max(seen, key=lambda d: tracker.max_memory_allocated(d))
    stats = tracker.memory_stats(chosen)
    measurement.device = str(chosen)
    measurement.allocated_peak = stats["allocated_bytes.all.peak"]
    measurement.reserved_peak = stats["reserved_bytes.all.peak"]
    measurement.leaked = stats["allocated_bytes.all.current"]
    measurement.workspaces = tracker_workspaces(tracker, chosen)
    if history:
        measurement.snapshot = tracker.snapshot(chosen)


@contextlib.contextmanager
def _on_gpu(gpu: torch.device, measurement: Measurement, history: bool, leaks: bool) -> Iterator[None]:
    __tracebackhide__ = True
    start_allocated = torch.cuda.memory_allocated(gpu)
    start_reserved = torch.cuda.memory_reserved(gpu)
    torch.cuda.reset_peak_memory_stats(gpu)
    if history:
        record = torch.cuda.memory._record_memory_history
        clear = {"clear_history": True} if "clear_history" in inspect.signature(record).parameters else {}
        record(device=gpu, **clear)  # torch < 2.5 cannot clear: a trace may then start earlier
    try:
        yield
    finally:
        try:
            if leaks:
                gc.collect()
            stats = torch.cuda.memory_stats(gpu)
            measurement.device = str(gpu)
            measurement.allocated_peak = stats["allocated_bytes.all.peak"] - start_allocated
            measurement.reserved_peak = stats["reserved_bytes.all.peak"] - start_reserved
            measurement.leaked = max(stats["allocated_bytes.all.current"] - start_allocated, 0)
            if history:
                measurement.snapshot = torch.cuda.memory._snapshot(gpu)
        finally:
            if history:
                torch.cuda.memory._record_memory_history(enabled=None, device=gpu)
