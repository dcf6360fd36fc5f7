"""PyTorch memory snapshots from memlab's trackers and allocator models: the dict of
``torch.cuda.memory._snapshot()`` (built by :func:`memlab.sources.allocator.snapshot.allocator_snapshot`,
re-exported here) and its pickle, which ``python -m torch.cuda._memory_viz`` and
pytorch.org/memory_viz read unchanged.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from memlab._outputs import check_output_path, check_path_type
from memlab.sources.allocator.snapshot import allocator_snapshot

__all__ = ["PICKLE_PROTOCOL", "allocator_snapshot", "dump_snapshot", "read_snapshot", "write_snapshot"]

#: The highest pickle protocol PyTorch's web viewer (pytorch.org/memory_viz) can read.
PICKLE_PROTOCOL = 4


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
