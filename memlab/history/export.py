"""PyTorch memory snapshots from memlab's allocator models: the dict of ``torch.cuda.memory._snapshot()``
and its pickle, which ``python -m torch.cuda._memory_viz`` and pytorch.org/memory_viz read unchanged.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from memlab._outputs import check_output_path, check_path_type
from memlab.history.categories import UNKNOWN
from memlab.history.recorder import History, Stack

__all__ = ["PICKLE_PROTOCOL", "allocator_snapshot", "dump_snapshot", "read_snapshot", "write_snapshot"]

#: The highest pickle protocol PyTorch's web viewer (pytorch.org/memory_viz) can read.
PICKLE_PROTOCOL = 4


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


def dump_snapshot(path: str | os.PathLike[str], tracker: Any = None) -> None:
    """Write the memory snapshot of ``tracker`` (a ``TensorTracker``; ``None``: the active one) to
    ``path`` as a pickle that ``python -m torch.cuda._memory_viz`` and pytorch.org/memory_viz read.

    The snapshot is ``tracker.snapshot()`` (the one device it has seen). A ``CachingAllocatorModel``
    or ``ExactAllocator`` is accepted too. Pickle protocol 4, the highest the web viewer reads.
    Raises ``ValueError`` when ``tracker`` is ``None`` and no tracker is active or ``path`` cannot
    be written (a folder, a missing folder), ``TypeError`` for a ``path`` or ``tracker`` of
    another type; both before anything is written.
    """
    from memlab.sources.allocator.blocks import AllocatorBase
    from memlab.sources.tracker import TensorTracker

    check_output_path(path, "path")
    if tracker is not None and not isinstance(tracker, (TensorTracker, AllocatorBase)):
        raise TypeError(
            "tracker must be a memlab.TensorTracker, a CachingAllocatorModel or ExactAllocator, or None "
            f"(the active tracker), got {type(tracker).__name__} {tracker!r:.80}"
        )
    if tracker is None:
        from memlab.sources.tracker import active_tracker

        tracker = active_tracker()
        if tracker is None:
            raise ValueError(
                "no TensorTracker is active: pass tracker=, or call inside `with TensorTracker(...)`"
            )
    write_snapshot(
        allocator_snapshot(tracker) if isinstance(tracker, AllocatorBase) else tracker.snapshot(), path
    )


def write_snapshot(snapshot: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``snapshot`` (a ``torch.cuda.memory._snapshot()`` dict, memlab's or PyTorch's own) to
    ``path`` as a pickle with protocol :data:`PICKLE_PROTOCOL`, which the web viewer reads.
    ``path`` is checked first (:func:`memlab._outputs.check_output_path`: ``TypeError`` or
    ``ValueError`` naming it); an error while writing (a full disk) is the ``OSError`` itself."""
    check_output_path(path, "path")
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)


def read_snapshot(path: str | os.PathLike[str], name: str = "path") -> dict[str, Any]:
    """The ``torch.cuda.memory._snapshot()`` dict pickled at ``path`` (``memlab run --snapshot``,
    :func:`dump_snapshot` or PyTorch's own ``torch.cuda.memory._dump_snapshot``).

    Only open pickles you trust: unpickling can run code. Raises ``TypeError`` for a ``path`` that
    is not a ``str`` or ``os.PathLike``, ``FileNotFoundError`` when there is no such file and
    ``ValueError`` when it is a folder or holds no memory snapshot; messages name ``name``.
    """
    check_path_type(path, name)
    try:
        with open(path, "rb") as file:
            data = pickle.load(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such snapshot: {os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{name} {os.fspath(path)!r} is a folder, not a snapshot pickle") from None
    except Exception:  # anything unpickling can raise: the file is not a pickle we can read
        data = None
    if not isinstance(data, dict) or not {"segments", "device_traces"} <= data.keys():
        raise ValueError(
            f"{name} {os.fspath(path)!r} is not a memory snapshot pickle (write one with memlab run "
            "--snapshot FILE, memlab.dump_snapshot or torch.cuda.memory._dump_snapshot)"
        )
    return data
