"""PyTorch memory snapshots from memlab's trackers and allocator models: the dict of
``torch.cuda.memory._snapshot()`` (built by :func:`memlab.sources.allocator.snapshot.allocator_snapshot`,
re-exported here) and its pickle, which ``python -m torch.cuda._memory_viz`` and
pytorch.org/memory_viz read unchanged.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from memlab._outputs import check_output_path, check_path_type, replacing_file
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
    another type; both before anything is written. The file is written whole or not at all: an
    ``OSError`` while writing (a full disk) leaves the previous file at ``path`` as it was.
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
    ``ValueError`` naming it); an error while writing (a full disk) is the ``OSError`` itself, and
    leaves ``path`` as it was (:func:`memlab._outputs.replacing_file`: written whole or not at all)."""
    check_output_path(path, "path")
    with replacing_file(path, "wb") as file:
        pickle.dump(snapshot, file, protocol=PICKLE_PROTOCOL)


class _GlobalRefused(pickle.UnpicklingError):
    """A pickle asked for a Python object by name (``module.name``); raised before it is imported."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualified_name = f"{module}.{name}"


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles only what pickle builds without naming a Python object: dicts, lists, tuples,
    sets, strings, bytes, numbers, booleans and ``None``. Every global (a class, a function such as
    ``os.system`` that a ``__reduce__`` would call) is refused before it is imported, so nothing in
    the file runs; no persistent ids (the default ``persistent_load`` refuses them)."""

    def find_class(self, module: str, name: str) -> Any:
        raise _GlobalRefused(module, name)


def read_snapshot(path: str | os.PathLike[str], name: str = "path") -> dict[str, Any]:
    """The ``torch.cuda.memory._snapshot()`` dict pickled at ``path`` (``memlab run --snapshot``,
    :func:`dump_snapshot` or PyTorch's own ``torch.cuda.memory._dump_snapshot``).

    Safe for pickles from anyone: a snapshot holds only dicts, lists, tuples, strings, numbers,
    booleans and ``None``, and only those are read; a pickle that names any Python object (a class,
    or a function its ``__reduce__`` would call, such as ``os.system``) is refused before that
    object is imported, so nothing in the file runs. Raises ``TypeError`` for a ``path`` that is
    not a ``str`` or ``os.PathLike``, ``FileNotFoundError`` when there is no such file and
    ``ValueError`` when it is a folder, names a Python object (the message names it) or holds no
    memory snapshot; messages name ``name`` and the path.
    """
    check_path_type(path, name)
    try:
        with open(path, "rb") as file:
            data = _PlainDataUnpickler(file).load()
    except FileNotFoundError:
        raise FileNotFoundError(f"no such snapshot: {os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{name} {os.fspath(path)!r} is a folder, not a snapshot pickle") from None
    except _GlobalRefused as refused:
        raise ValueError(
            f"{name} {os.fspath(path)!r} is refused: the pickle names the Python object "
            f"{refused.qualified_name}, which memlab does not load (nothing in the file was run; a "
            "memory snapshot holds only dicts, lists, strings and numbers)"
        ) from None
    except Exception:  # anything unpickling can raise: the file is not a pickle we can read
        data = None
    if not isinstance(data, dict) or not {"segments", "device_traces"} <= data.keys():
        raise ValueError(
            f"{name} {os.fspath(path)!r} is not a memory snapshot pickle (write one with memlab run "
            "--snapshot FILE, memlab.dump_snapshot or torch.cuda.memory._dump_snapshot)"
        )
    return data
