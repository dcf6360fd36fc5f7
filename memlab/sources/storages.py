"""How the tracker sees storages in an op: which outputs are new (:class:`OpCounting`, a mixin of
``TensorTracker``), and the weak reference that learns of a counted storage's release."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memlab._tensors import storages_of
from memlab.sources.composites import has_composite_kernel
from memlab.sources.resizes import resizable_arguments
from memlab.sources.workspaces import workspace_ops

__all__ = ["FRESH_ALIASES", "OpCounting", "OpKind", "StorageRef", "collect_storages", "unpack"]

# Ops whose output aliases an input in their schema, yet hand back a storage created just before
# the op outside the dispatcher (``torch.tensor([...])`` builds its data, then calls lift_fresh).
FRESH_ALIASES = {torch.ops.aten.lift_fresh.default}


class StorageRef(weakref.ref):
    """A weak reference to a counted storage that remembers how to release it."""

    __slots__ = ("allocator", "handle", "key", "nbytes")


class OpKind:
    """What an op's schema says about its outputs, computed once per op."""

    __slots__ = ("aliases", "composite", "fresh", "func", "grows", "resizes_storage", "workspace", "writes")

    def __init__(self, func: Any) -> None:
        self.func = func
        infos = [ret.alias_info for ret in func._schema.returns]
        self.aliases = any(info is not None for info in infos)
        self.writes = any(info is not None and info.is_write for info in infos)
        self.fresh = func in FRESH_ALIASES
        self.grows = resizable_arguments(func)  # arguments whose storages it may grow (resize_, out=)
        # resizes its first argument's storage in place and returns nothing (FSDP under torch.compile)
        self.resizes_storage = func._schema.name == "inductor::resize_storage_bytes_"
        # reaches a dispatch mode whole only where autograd is skipped (inference mode)
        self.composite = has_composite_kernel(func)
        self.workspace = func.overloadpacket in workspace_ops()  # may take a cuBLAS workspace


class OpCounting:
    """The half of :class:`~memlab.sources.tracker.TensorTracker` that counts an op's new storages
    (it reads the state the tracker's ``__init__`` sets: ``_lock``, ``_pending``, ``_live``,
    ``allocator``, ``workspaces``)."""

    def _count_op(
        self, kind: OpKind, func: Any, args: Any, kwargs: Any, out: Any, before: Any, refused: Any
    ) -> None:
        """Count the storages ``func(*args, **kwargs)`` made or grew (``out``; ``before``: the sizes
        of those it may grow), and the cuBLAS workspace it takes; with ``refused`` (a storage an
        inner tracker refused) only the outputs before that one, and no workspace."""
        with self._lock:  # threads run ops at once; the counting state is one
            if self._pending:
                self._drain()
            if kind.resizes_storage:
                self._count_resize(args[0].untyped_storage())
            # One walk of the outputs; the inputs are walked only for an output that is not counted
            # yet of an op whose schema says it aliases nothing (to find one it aliases all the same).
            if type(out) in _PLAIN and out.layout is torch.strided:  # the common case, inline
                outputs: Any = (out.untyped_storage(),)
            else:
                outputs = []
                collect_storages(out, outputs)
            inputs: set[int] | None = None
            live = self._live
            for storage in outputs:
                if storage is refused:
                    return
                ref = live.get(id(storage))
                if ref is not None:
                    if kind.writes and ref.nbytes != storage.nbytes():
                        self._resize(ref, storage)
                elif kind.fresh:
                    self._track(storage)
                elif kind.aliases:
                    if before and before.get(id(storage), storage.nbytes()) < storage.nbytes():
                        self._track(storage)  # a storage not counted, grown here: its new block is new
                else:
                    # Some ops alias an input without saying so in their schema (_unsafe_view):
                    # a storage that came in is never new.
                    if inputs is None:
                        inputs = _storage_ids(args, kwargs)
                    if id(storage) not in inputs:
                        self._track(storage)
            if refused is None and kind.workspace and self.allocator is not None:
                self.workspaces.after_op(func, args, kwargs, self._allocate_workspace)  # type: ignore[attr-defined]


#: Tensor types whose storage is the tensor's own (strided layout): a fake tensor's is its meta storage.
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


def _storage_ids(args: Any, kwargs: Any) -> set[int]:
    """``id`` of the storage of every tensor among an op's arguments (nested in lists and tuples)."""
    ids = set()
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if type(arg) in _PLAIN and arg.layout is torch.strided:
            ids.add(id(arg.untyped_storage()))
        elif isinstance(arg, (torch.Tensor, list, tuple)):
            found: list[torch.UntypedStorage] = []
            collect_storages(arg, found)
            ids.update(map(id, found))
    return ids


def collect_storages(obj: Any, into: list[torch.UntypedStorage]) -> None:
    """Append the storages of every tensor in ``obj`` (a tensor or nested lists/tuples of them)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor and obj.layout is torch.strided:  # the common case, inline
            into.append(obj.untyped_storage())
        else:
            into.extend(storages_of(obj))
    elif type(obj) is list or type(obj) is tuple:
        for item in obj:
            collect_storages(item, into)


def unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
