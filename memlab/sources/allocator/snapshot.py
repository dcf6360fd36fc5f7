"""The ``torch.cuda.memory._snapshot()`` dict of one of memlab's allocator models: its segments
and blocks now, and the trace of its :class:`~memlab.history.recorder.History`.

:mod:`memlab.history.export` writes these dicts as pickles that PyTorch's viewer reads.
"""

from __future__ import annotations

from typing import Any

from memlab.history.categories import UNKNOWN
from memlab.history.recorder import History, Stack

__all__ = ["allocator_snapshot"]


class _FrameDicts:
    """Interned stacks as PyTorch's lists of frame dicts, each distinct frame and stack built once
    (the pickle then stores each once too)."""

    def __init__(self) -> None:
        self._frames: dict[int, dict[str, Any]] = {}
        self._stacks: dict[int, list[dict[str, Any]]] = {}

    def __call__(self, stack: Stack) -> list[dict[str, Any]]:
        found = self._stacks.get(id(stack))
        if found is None:
            found = self._stacks[id(stack)] = [self._frame(frame) for frame in stack]
        return found

    def _frame(self, frame: tuple[str, int, str]) -> dict[str, Any]:
        found = self._frames.get(id(frame))
        if found is None:
            filename, line, name = frame
            found = self._frames[id(frame)] = {"filename": filename, "line": line, "name": name}
        return found


def allocator_snapshot(allocator: Any, device: int = 0) -> dict[str, Any]:
    """The ``torch.cuda.memory._snapshot()`` dict of a memlab allocator (``CachingAllocatorModel``
    or ``ExactAllocator``), as if it were CUDA device ``device`` (an index).

    ``segments``: the allocator's segments now, by (invented) address, each with ``device``,
    ``address``, ``total_size``, ``allocated_size``, ``active_size`` (equal: one stream),
    ``requested_size``, ``stream`` (0), ``segment_type`` (``"small"``/``"large"``),
    ``segment_pool_id`` (``(0, 0)``, the default pool), ``is_expandable``, ``frames`` (the stack
    that mapped it) and ``blocks``; each block ``address``, ``size`` (granted bytes),
    ``requested_size``, ``state`` (``"active_allocated"`` or ``"inactive"``), ``frames`` (where
    an active block was allocated) and ``category``. ``device_traces``: one list per device
    index up to ``device``, empty but the last, which holds the allocator's history (see
    :class:`~memlab.history.recorder.History`), oldest first; empty without a history.

    Sizes are bytes. Frames are empty where nothing recorded them (no history, an allocator
    driven directly, or a block allocated before the history began). ``TypeError``/``ValueError``
    naming ``device`` unless it is an index >= 0.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(
            f"device must be a CUDA device index (an int >= 0), got {type(device).__name__} {device!r}"
        )
    if device < 0:
        raise ValueError(f"device must be a CUDA device index (an int >= 0), got {device}")
    history: History | None = allocator.history
    frames = _FrameDicts()
    segments = []
    for segment in allocator.snapshot():
        blocks = []
        for block in segment["blocks"]:
            active = block["allocated"]
            stack, category = history.block_context(block["address"]) if history and active else ((), "")
            blocks.append(
                {
                    "address": block["address"],
                    "size": block["size"],
                    "requested_size": block["requested_size"],
                    "state": block["state"],
                    "frames": frames(stack),
                    "category": category or UNKNOWN,
                }
            )
        segment_stack = history.segment_contexts.get(segment["address"], ()) if history else ()
        segments.append(
            {
                "device": device,
                "address": segment["address"],
                "total_size": segment["total_size"],
                "allocated_size": segment["allocated_size"],
                "active_size": segment["allocated_size"],
                "requested_size": segment["requested_size"],
                "stream": 0,
                "segment_type": segment["segment_type"],
                "segment_pool_id": (0, 0),
                "is_expandable": segment["is_expandable"],
                "frames": frames(segment_stack),
                "blocks": blocks,
            }
        )
    trace = []
    for action, addr, size, stack, time_us, category in history.entries() if history else ():
        entry: dict[str, Any] = {"action": action}
        entry["device_free" if action == "oom" else "addr"] = addr
        entry.update(size=size, stream=0, time_us=time_us, frames=frames(stack))
        if action == "alloc":
            entry["category"] = category
        trace.append(entry)
    device_traces: list[list[dict[str, Any]]] = [[] for _ in range(device)]
    device_traces.append(trace)
    return {"segments": segments, "device_traces": device_traces}
