"""Placeholders for the tensors :class:`memlab.Courtesy` parks in files, and where each parked
tensor sits in the storage it came from.

A parked tensor keeps its Python object. Its data becomes a placeholder: a CPU tensor of its shape
and dtype over one element (stride 0) of a storage of its own parking and dtype, which reads NaN
for floating types and 0 otherwise and refuses a mutable data pointer (every kernel that writes
asks for one). A :class:`Parking` (one per parked storage) remembers where each of its tensors
sits (:class:`View`: offset, sizes, strides, dtype), which the placeholder cannot tell, and keeps a
``meta`` storage of the parked size in which :mod:`memlab._parked_guard` works out where a view
taken meanwhile sits.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from memlab._movable import describe
from memlab._tensors import live_tensors
from memlab.sources.constructors import unseen_storage

__all__ = [
    "ParkedTensorError",
    "Parking",
    "View",
    "parking_of",
    "parking_of_shadow",
    "placeholder_storage_ids",
    "repoint",
    "tensors_on",
    "unplaced_message",
]


class ParkedTensorError(RuntimeError):
    """An op tried to write to a tensor that :class:`memlab.Courtesy` parked, or to change its shape,
    strides or storage in place, or took a view of it that cannot be followed back."""


@dataclass
class View:
    """Where one tensor sits in a parked storage, and the class to give it back at restore."""

    tensor: weakref.ref[torch.Tensor]
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    cls: type | None = None  # set while the tensor is a ParkedTensor / ParkedParameter
    hook: Any = None  # the handle of a hook that refuses backward into a parked .grad

    @classmethod
    def of(cls, tensor: torch.Tensor, like: torch.Tensor | None = None) -> View:
        """``tensor`` at the offset, sizes, strides and dtype of ``like`` (default: its own)."""
        like = tensor if like is None else like
        return cls(
            weakref.ref(tensor), like.storage_offset(), tuple(like.size()), tuple(like.stride()), like.dtype
        )


_by_storage: dict[int, Parking] = {}  # id of a placeholder storage -> its parking
_by_meta: dict[int, Parking] = {}  # id of a parking's meta storage -> the parking


def placeholder_storage_ids() -> set[int]:
    """``id`` of every placeholder storage of every parking not yet closed (any Courtesy)."""
    return set(_by_storage)


def parking_of(tensor: torch.Tensor) -> Parking | None:
    """The parking whose placeholder ``tensor`` sits on, if any."""
    try:
        storage = tensor.untyped_storage()
    except Exception:  # sparse, nested, fake or otherwise storage-less
        return None
    return _by_storage.get(id(storage))


class Parking:
    """The placeholders of one storage parked in a file, and every tensor parked on it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.views: dict[int, View] = {}  # id of a parked tensor -> where it sits
        self._storages: dict[torch.dtype, torch.UntypedStorage] = {}
        self._meta: torch.UntypedStorage | None = None

    def remember(self, tensor: torch.Tensor, view: View) -> None:
        """Remember where ``tensor`` (on a placeholder of this parking) sits."""
        self.views[id(tensor)] = view

    def view_of(self, tensor: torch.Tensor) -> View | None:
        view = self.views.get(id(tensor))
        return view if view is not None and view.tensor() is tensor else None

    def release(self, tensor: torch.Tensor) -> None:
        """Forget ``tensor`` and give it back the class it had (before it is re-pointed elsewhere)."""
        view = self.views.pop(id(tensor), None)
        if view is None or view.tensor() is not tensor:
            return
        if view.cls is not None:
            tensor.__class__ = view.cls
        if view.hook is not None:
            view.hook.remove()

    def storage_ids(self) -> set[int]:
        return {id(storage) for storage in self._storages.values()}

    def close(self) -> None:
        """Stop recognising this parking's placeholders (its storage is back or rolled back), and
        give their class back to tensors the user moved elsewhere (``torch.Tensor.set_(t, ...)``)."""
        for view in list(self.views.values()):
            tensor = view.tensor()
            if tensor is not None:
                self.release(tensor)
        for storage in self._storages.values():
            _by_storage.pop(id(storage), None)
        if self._meta is not None:
            _by_meta.pop(id(self._meta), None)

    def placeholder(self, dtype: torch.dtype, size: tuple[int, ...], inference: bool) -> torch.Tensor:
        """A CPU tensor of ``size`` and ``dtype`` over this parking's read-only element (stride 0)."""
        storage = self._storages.get(dtype)
        if storage is None:
            # Unseen by the storage constructor's observers: a tracker counts no placeholder.
            storage = self._storages[dtype] = unseen_storage(dtype.itemsize)
            element = torch.empty(0, dtype=torch.uint8).set_(storage)
            element.copy_(torch.tensor(list(_element_bytes(dtype)), dtype=torch.uint8))
            # Every kernel that writes asks the storage for a mutable data pointer; this makes that
            # raise, also for writes that no guard sees (autograd's C++).
            torch._C._set_throw_on_mutable_data_ptr(element)
            _by_storage[id(storage)] = self
        with torch.inference_mode(inference):
            return torch.empty(0, dtype=dtype).set_(storage, 0, size, (0,) * len(size))

    def shadow(self, view: View) -> torch.Tensor:
        """A ``meta`` tensor at ``view``'s place in a ``meta`` storage of this parking's size."""
        if self._meta is None:
            self._meta = torch.empty(self.nbytes, dtype=torch.uint8, device="meta").untyped_storage()
            _by_meta[id(self._meta)] = self
        return torch.empty(0, dtype=view.dtype, device="meta").set_(
            self._meta, view.offset, view.size, view.stride
        )


def parking_of_shadow(shadow: torch.Tensor) -> Parking | None:
    """The parking in whose ``meta`` storage ``shadow`` sits, if any."""
    return _by_meta.get(id(shadow.untyped_storage()))


def repoint(tensor: torch.Tensor, storage: torch.UntypedStorage, view: View) -> None:
    """Re-point ``tensor`` at ``view``'s place in ``storage``; an inference tensor stays one."""
    with torch.inference_mode(tensor.is_inference()):
        data = torch.empty(0, dtype=view.dtype, device=storage.device)
        data.set_(storage, view.offset, view.size, view.stride)
    tensor.data = data


def _element_bytes(dtype: torch.dtype) -> bytes:
    """The bytes of one NaN of ``dtype`` (floating and complex types that have one), else zeros."""
    if dtype.is_floating_point or dtype.is_complex:
        try:
            nan = torch.full((1,), math.nan).to(dtype)
            return bytes(nan.view(torch.uint8).tolist())
        except (RuntimeError, NotImplementedError):  # float4_e2m1fn_x2: no conversion, no NaN
            pass
    return bytes(dtype.itemsize)


def tensors_on(keys: set[int]) -> dict[int, list[torch.Tensor]]:
    """Every live tensor (``gc``) on a storage whose ``id`` is in ``keys``, by that ``id``."""
    found: dict[int, list[torch.Tensor]] = {}
    if not keys:
        return found
    for tensor in live_tensors():
        try:
            key = id(tensor.untyped_storage())
        except Exception:  # sparse, nested, fake, lazy: not ours
            continue
        if key in keys:
            found.setdefault(key, []).append(tensor)
    return found


def unplaced_message(tensors: list[torch.Tensor]) -> str:
    """Why ``tensors``, over a placeholder but made without a torch function, cannot go back."""
    one = len(tensors) == 1
    return (
        f"{describe(tensors)} over its placeholder {'was' if one else 'were'} made out of Courtesy's "
        f"sight (not by a torch function: as_subclass, C++), so where {'it' if one else 'they'} should "
        f"go is unknown; delete {'it' if one else 'them'} and call restore() again"
    )
