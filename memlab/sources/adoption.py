"""Counting what existed before a :class:`~memlab.sources.tracker.TensorTracker` began: adopting
the storages ``gc`` or given objects reach, and resuming from an allocator in a given state.

:class:`TrackerAdoption` is a mixin of ``TensorTracker``: it reads and writes the tracker's
counting state (``_live``, ``_pending``, ``_lock``, ``_seen``, allocators) through its
``_track``/``_allocator_for`` and keeps no state of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from memlab._devices import resolve_device
from memlab._tensors import call_roots, live_storages
from memlab.history import categories
from memlab.history.recorder import is_own_code
from memlab.sources.storages import StorageRef

__all__ = ["TrackerAdoption"]


class TrackerAdoption:
    """The adopting half of :class:`~memlab.sources.tracker.TensorTracker` (see the module)."""

    def adopt_from_call(self, frame: FrameType) -> None:
        """:meth:`adopt` the tensors that the call ``frame`` starts can reach without walking
        ``gc``: those its arguments hold (category ``input``), then those held by its function's
        globals and by the local variables of the frames that called it (a tensor made between
        two profiled calls and kept in a global, a model in the training loop's locals). The line
        profiler calls it at each outermost profiled call, from its trace function, where an
        exception would stop the user's program: what cannot be read is skipped."""
        with contextlib.suppress(Exception):
            self.adopt(roots=frame.f_locals.values(), category=categories.INPUT)
        with contextlib.suppress(Exception):
            self.adopt(roots=call_roots(frame, is_own_code))

    def adopt(
        self,
        device: torch.device | str | int | None = None,
        roots: Iterable[object] | None = None,
        category: str | None = None,
    ) -> tuple[int, int]:
        """Count the storages that ``gc`` can reach (or, given ``roots``, that those objects hold:
        see :func:`memlab._tensors.tensors_within`) and the tracker does not know yet as allocated
        now, and their release when it happens, as if the tracker had seen them created.

        On a GPU, memory that existed before profiling (the model, optimizer state, the batch)
        is in the allocator's numbers; adoption puts it into the modelled ones. ``device``
        (default: every device) limits it to one device. Storages are allocated in the model in
        the order ``gc`` lists their tensors, which may fill the cache differently from the
        order they were created in (reserved bytes can then differ from a run tracked from the
        start; allocated and active bytes do not, except where a cached block is handed out
        whole). Returns ``(storages, bytes)`` adopted by this call; bytes as the modelled
        allocator counts them (``allocated_bytes.all``: with the CUDA model, rounded to blocks).

        With ``history`` on, ``category`` (one of :data:`memlab.history.categories.CATEGORIES`)
        is given to the adopted blocks (the line profiler adopts a call's arguments as ``input``);
        another value is a ``ValueError`` before anything is adopted, with or without history.

        Adoption cannot see autograd's saved tensors of a graph alive at that moment, tensors
        held only by C++ code, or memory allocated outside PyTorch's storages. Walking ``gc``
        costs time in proportion to the objects alive (tens of milliseconds with a few hundred
        thousand); walking ``roots`` costs almost nothing.
        """
        if category is not None:
            categories.category_code(category)  # checked before anything is adopted
        if roots is not None and (isinstance(roots, (str, bytes)) or not isinstance(roots, Iterable)):
            raise TypeError(
                f"roots must be None (what gc can reach) or an iterable of objects holding tensors, got "
                f"{type(roots).__name__} {roots!r:.80}"
            )
        if self._pending:
            self._drain()
        wanted = None if device is None else resolve_device(device)
        storages = [
            entry.storage for key, entry in live_storages(wanted, roots).items() if key not in self._live
        ]
        with self._lock:
            before = {d: a.table.stats["allocated_bytes.all"][0] for d, a in self._allocators.items()}
            for storage in storages:
                if id(storage) not in self._live:  # another thread may have counted it meanwhile
                    self._track(storage)
                if category is not None:
                    self._set_category(storage, category)
            adopted = sum(
                a.table.stats["allocated_bytes.all"][0] - before.get(d, 0)
                for d, a in self._allocators.items()
            )
        if storages and self._categorising:
            self._categorise_known()  # an added model's adopted parameters are parameters from now on
        if storages or not self.adoptions:  # the first call is kept: "nothing existed before"
            self.adoptions.append((len(storages), adopted))
        return len(storages), adopted

    def resume(
        self, allocator: Any, blocks: Iterable[tuple[torch.UntypedStorage, int]] = (), workspaces: int = 0
    ) -> None:
        """Count on the first device from ``allocator`` as it is (an allocator model with cached
        segments and allocated blocks: a process's state replayed from its history, say) instead
        of a new, empty allocator of the tracker's settings: the allocator's own ``capacity``,
        configuration and history apply, and its statistics go on from where they are.

        Each ``(storage, handle)`` of ``blocks`` is counted as the storage that occupies
        ``allocator``'s allocated block ``handle``: nothing is allocated for it, and the block is
        freed when the storage is. The allocator's other allocated blocks stay allocated (memory
        that no storage the tracker sees holds). Call it before the tracker counts anything;
        ``ValueError`` otherwise, or when the storages are on several devices, or one is
        counted twice. ``workspaces``: how many of the other blocks are cuBLAS workspaces, which the
        first ops that need one on that device use instead of allocating their own
        (:meth:`~memlab.sources.workspaces.CublasWorkspaces.present`)."""
        if self._allocators or self._live:
            raise ValueError("resume: the tracker has counted storages already; resume it before it counts")
        self._resumed = allocator
        self._resumed_workspaces = workspaces
        self._limited = self._limited or getattr(allocator, "capacity", None) is not None
        for storage, handle in blocks:
            if self._allocator_for(storage.device) is not allocator:
                raise ValueError(f"resume: every storage must be on one device; {storage.device} is another")
            if id(storage) in self._live:
                raise ValueError(f"resume: a storage of {storage.nbytes()} bytes was given twice")
            if storage.device not in self._seen:
                self._seen[storage.device] = None
            ref = StorageRef(storage, self._pending.append)
            ref.allocator, ref.handle, ref.key, ref.nbytes = allocator, handle, id(storage), storage.nbytes()
            self._live[ref.key] = ref
