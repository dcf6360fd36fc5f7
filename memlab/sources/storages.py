"""How the tracker sees storages in an op: which outputs are new, and the weak reference that
learns of a counted storage's release."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memlab._tensors import storages_of
from memlab.sources.composites import has_composite_kernel
from memlab.sources.resizes import resizable_arguments

__all__ = ["FRESH_ALIASES", "OpKind", "StorageRef", "collect_storages", "unpack"]

# Ops whose output aliases an input in their schema, yet hand back a storage created just before
# the op outside the dispatcher (``torch.tensor([...])`` builds its data, then calls lift_fresh).
FRESH_ALIASES = {torch.ops.aten.lift_fresh.default}


class StorageRef(weakref.ref):
    """A weak reference to a counted storage that remembers how to release it."""

    __slots__ = ("allocator", "handle", "key", "nbytes")


class OpKind:
    """What an op's schema says about its outputs, computed once per op."""

    __slots__ = ("aliases", "composite", "fresh", "grows", "resizes_storage", "writes")

    def __init__(self, func: Any) -> None:
        infos = [ret.alias_info for ret in func._schema.returns]
        self.aliases = any(info is not None for info in infos)
        self.writes = any(info is not None and info.is_write for info in infos)
        self.fresh = func in FRESH_ALIASES
        self.grows = resizable_arguments(func)  # arguments whose storages it may grow (resize_, out=)
        # resizes its first argument's storage in place and returns nothing (FSDP under torch.compile)
        self.resizes_storage = func._schema.name == "inductor::resize_storage_bytes_"
        # reaches a dispatch mode whole only where autograd is skipped (inference mode)
        self.composite = has_composite_kernel(func)


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
