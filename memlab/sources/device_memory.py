"""A :class:`~memlab.sources.tracker.TensorTracker`'s modelled device memory: the blocks its storages hold.

:class:`TrackerDeviceMemory` is the tracker's half that turns what the dispatch saw into allocator
events: one allocator model per device (:class:`~memlab.sources.allocator.CachingAllocatorModel`,
or :class:`~memlab.sources.allocator.ExactAllocator` for exact bytes), a block for each counted
storage, resizes as a new block before the old one is freed, releases queued by the storages' weak
references and drained under the lock, the modelled GPU's cuBLAS workspaces, and the
:data:`OOM_OBSERVERS` told of an out-of-memory error before it leaves the op. It is a mixin of
``TensorTracker`` and reads the state the tracker's ``__init__`` sets (``allocator``, ``capacity``,
``history``, ``_allocators``, ``_resumed``, ``_resumed_workspaces``, ``_seen``, ``_live``,
``_pending``, ``_lock``, ``_gpu``, ``_workspaces``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memlab._gpus import GPU, resolve_gpu
from memlab._tensors import check_tensor
from memlab.history import categories
from memlab.history.recorder import capture_stack, make_history
from memlab.sources.allocator import CachingAllocatorModel, ExactAllocator
from memlab.sources.holds import refused_workspace
from memlab.sources.storages import StorageRef, collect_storages
from memlab.sources.workspaces import CublasWorkspaces

if TYPE_CHECKING:
    from memlab.sources.tracker import TensorTracker

__all__ = ["ALLOCATORS", "OOM_OBSERVERS", "TrackerDeviceMemory"]

#: The allocator model of each ``TensorTracker(allocator=...)`` choice.
ALLOCATORS: dict[str | None, Callable[..., Any]] = {
    "cuda": CachingAllocatorModel,
    None: ExactAllocator,
}
#: Called as ``observer(tracker, storage, nbytes, error)`` when a tracker's modelled allocator raises
#: ``torch.OutOfMemoryError`` for ``storage`` (``nbytes`` bytes; a new storage, or one grown by
#: ``resize_``; for a cuBLAS workspace, an empty storage on its device), before the error leaves
#: the op (:mod:`memlab.oom` captures the state of that moment). Nothing runs otherwise.
OOM_OBSERVERS: list[Callable[[TensorTracker, torch.UntypedStorage, int, torch.OutOfMemoryError], None]] = []


class TrackerDeviceMemory:
    """The device-memory half of :class:`~memlab.sources.tracker.TensorTracker` (see the module)."""

    def _new_allocator(self) -> Any:
        history = make_history(self.history, capture_stack)
        if history is not None:
            history.free_category = categories.category_code(categories.TEMPORARY)
        return ALLOCATORS[self.allocator](capacity=self.capacity, history=history)

    def _allocator_for(self, device: torch.device) -> Any:
        allocator = self._allocators.get(device)
        if allocator is None:
            if self._resumed_workspaces and self._resumed is not None and self.workspaces is not None:
                self.workspaces.present(device, self._resumed_workspaces)
            allocator, self._resumed = self._resumed or self._new_allocator(), None
            self._allocators[device] = allocator
        return allocator

    def _track(self, storage: torch.UntypedStorage, nbytes: int | None = None) -> None:
        """Count ``storage`` as allocated now (``nbytes``: its size, when it is not the storage's own)."""
        if nbytes is None:
            nbytes = storage.nbytes()
        allocator, handle = self._malloc(storage.device, nbytes, storage)
        ref = StorageRef(storage, self._pending.append)
        ref.allocator, ref.handle, ref.key, ref.nbytes = allocator, handle, id(storage), nbytes
        self._live[ref.key] = ref

    def _malloc(
        self, device: torch.device, nbytes: int, storage: torch.UntypedStorage | None
    ) -> tuple[Any, Any]:
        """``(allocator, handle)``: ``nbytes`` allocated on ``device``'s allocator (``handle`` is
        ``None`` for 0 bytes). An out-of-memory error is told to the observers, naming ``storage``
        (an empty storage on ``device`` for memory no storage holds), then raised."""
        allocator = self._allocator_for(device)
        if device not in self._seen:
            self._seen[device] = None
        try:
            return allocator, (allocator.malloc(nbytes) if nbytes else None)
        except torch.OutOfMemoryError as error:
            named = storage if storage is not None else torch.UntypedStorage(0, device=device)
            self._refused = weakref.ref(storage) if storage is not None else refused_workspace
            self._out_of_memory(named, nbytes, error)
            raise

    def _count_resize(self, storage: torch.UntypedStorage) -> None:
        """Count the resize of ``storage`` as the allocator sees it: a new block, the old one freed."""
        with self._lock:
            if self._pending:
                self._drain()
            ref = self._live.get(id(storage))
            if ref is not None:
                self._resize(ref, storage)
            elif storage.nbytes():
                self._track(storage)  # a storage not counted, given a new block here: that block is new

    @property
    def gpu(self) -> GPU | None:
        """The GPU modelled (``allocator="cuda"``; else ``None``), read at first use: on a machine
        with CUDA the GPU in use (which initializes CUDA), else :data:`memlab._gpus.DEFAULT_GPU`."""
        if self.allocator is None:
            return None
        if self._gpu is None:
            self._gpu = resolve_gpu(None)
        return self._gpu

    @property
    def workspaces(self) -> CublasWorkspaces | None:
        """The cuBLAS workspaces of :attr:`gpu` (``None`` with ``allocator=None``), made at first
        use: the environment's workspace settings are read then, as PyTorch reads them at a
        process's first matmul."""
        if self._workspaces is None and self.allocator is not None:
            self._workspaces = CublasWorkspaces(self.gpu)  # type: ignore[arg-type]
        return self._workspaces

    def _allocate_workspace(self, device: torch.device, nbytes: int, transient: bool = False) -> None:
        """Allocate a cuBLAS workspace of ``nbytes`` on ``device``'s allocator, for good (category
        ``workspace``), or with ``transient`` for one call (freed at once: torch 2.8's cuBLASLt);
        an out-of-memory error names an empty storage on ``device`` to the observers."""
        allocator, handle = self._malloc(device, nbytes, None)
        if handle is not None and allocator.history is not None:
            allocator.history.set_category(allocator._extent(handle)[0], categories.WORKSPACE)
        if transient and handle is not None:
            allocator.free(handle)

    def _resize(self, ref: StorageRef, storage: torch.UntypedStorage) -> None:
        # resize_bytes_cuda: to 0 bytes it frees the block; to any other size it allocates the new
        # block, copies, then frees the old one (both are held for a moment).
        nbytes = storage.nbytes()
        try:
            handle = ref.allocator.malloc(nbytes) if nbytes else None
        except torch.OutOfMemoryError as error:
            self._refused = weakref.ref(storage)
            self._out_of_memory(storage, nbytes, error)
            raise
        if ref.handle is not None:
            ref.allocator.free(ref.handle)
        ref.handle, ref.nbytes = handle, nbytes

    def _out_of_memory(
        self, storage: torch.UntypedStorage, nbytes: int, error: torch.OutOfMemoryError
    ) -> None:
        for observer in list(OOM_OBSERVERS):
            observer(self, storage, nbytes, error)

    def block_address(self, tensor: torch.Tensor) -> int | None:
        """The address of the modelled block that holds ``tensor``'s (first) storage, as
        :meth:`snapshot` lists it, or ``None`` where the tracker did not count that storage."""
        ref = self._block_ref(tensor)
        return None if ref is None else ref.allocator._extent(ref.handle)[0]

    def block_size(self, tensor: torch.Tensor) -> int | None:
        """The bytes of the modelled block that holds ``tensor``'s (first) storage, as
        ``allocated_bytes`` counts it, or ``None`` where the tracker did not count that storage."""
        ref = self._block_ref(tensor)
        return None if ref is None else ref.allocator.block_size(ref.handle)

    def _block_ref(self, tensor: torch.Tensor) -> Any:
        """The live reference to the modelled block of ``tensor``'s (first) storage, or ``None``."""
        check_tensor(tensor)
        if self._pending:
            self._drain()
        storages: list[torch.UntypedStorage] = []
        collect_storages(tensor, storages)
        ref = self._live.get(id(storages[0])) if storages else None
        if ref is None or ref.handle is None or ref() is not storages[0]:
            return None
        return ref

    def _drain(self) -> None:
        pending, live = self._pending, self._live
        with self._lock:
            while pending:
                ref = pending.popleft()
                if live.get(ref.key) is ref:
                    del live[ref.key]
                if ref.handle is not None:
                    ref.allocator.free(ref.handle)
                    ref.handle = None
