"""The saved state of one of the user's objects, and putting it back: the pieces of an estimate's
journal (:mod:`memlab.estimate.isolation`).

Each ``restore_*`` function puts back what was saved only where it differs (compared by identity),
through the base type's own methods (``dict.__setitem__``, ``list.__setitem__``), so that a
subclass's overrides (a ``ModelOutput`` that sets attributes as items change) do not run again.
"""

from __future__ import annotations

import collections
import functools
import random
import sys
import types
from typing import Any

import torch

__all__ = [
    "MISSING",
    "RandomStates",
    "TensorData",
    "attributes",
    "cell_value",
    "has_slot",
    "restore_cell",
    "restore_deque",
    "restore_dict",
    "restore_list",
    "restore_set",
    "restore_slot",
    "restore_tensor",
    "slots",
    "version",
]

#: What an empty cell, an unset slot or a missing global holds in a journal.
MISSING = object()


class RandomStates:
    """The states of torch's, Python's and NumPy's global random number generators, put back by
    :meth:`restore` (a step may seed them or draw from them)."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


def restore_dict(obj: dict[Any, Any], saved: list[tuple[Any, Any]], namespace: bool) -> None:
    current = list(dict.items(obj))
    if len(current) == len(saved) and all(
        k is k0 and v is v0 for (k, v), (k0, v0) in zip(current, saved, strict=True)
    ):
        return
    kind: Any = collections.OrderedDict if isinstance(obj, collections.OrderedDict) else dict
    if namespace:  # a module's globals: never empty, even for a moment
        keys = {key for key, _ in saved}
        for key, _ in current:
            if key not in keys:
                kind.__delitem__(obj, key)
        for key, value in saved:
            if dict.get(obj, key, MISSING) is not value:
                kind.__setitem__(obj, key, value)
        return
    kind.clear(obj)
    for key, value in saved:
        kind.__setitem__(obj, key, value)


def restore_list(obj: list[Any], saved: list[Any]) -> None:
    if len(obj) != len(saved) or any(a is not b for a, b in zip(obj, saved, strict=True)):
        list.__setitem__(obj, slice(None), saved)


def restore_set(obj: set[Any], saved: set[Any]) -> None:
    if not set.__eq__(obj, saved):
        set.clear(obj)
        set.update(obj, saved)


def restore_deque(obj: collections.deque[Any], saved: list[Any]) -> None:
    if len(obj) != len(saved) or any(a is not b for a, b in zip(obj, saved, strict=True)):
        obj.clear()
        obj.extend(saved)


def restore_cell(cell: types.CellType, value: Any) -> None:
    if cell_value(cell) is value:
        return
    if value is MISSING:
        del cell.cell_contents
    else:
        cell.cell_contents = value


def restore_slot(slot: Any, obj: Any, value: Any) -> None:
    current = slot.__get__(obj) if has_slot(slot, obj) else MISSING
    if current is value:
        return
    if value is MISSING:
        slot.__delete__(obj)
    else:
        slot.__set__(obj, value)


class TensorData:
    """What a tensor's Python object holds (storage, shape, strides, offset, dtype), which
    ``tensor.data = other`` replaces without an op (an EMA written ``ema.data = ...``), kept by an
    alias of the same storage."""

    def __init__(self, tensor: torch.Tensor) -> None:
        plain = type(tensor) in (torch.Tensor, torch.nn.Parameter) and not tensor.is_nested
        self.alias = tensor.detach() if plain else None
        self.layout = _layout(tensor) if plain else None

    def restore(self, tensor: torch.Tensor) -> None:
        if self.alias is not None and _layout(tensor) != self.layout:
            with torch.no_grad():
                tensor.data = self.alias


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    storage = tensor.untyped_storage()._cdata if type(tensor) in (torch.Tensor, torch.nn.Parameter) else None
    return (storage, tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device)


def restore_tensor(
    tensor: torch.Tensor, data: TensorData, grad: torch.Tensor | None, requires_grad: bool
) -> None:
    data.restore(tensor)
    if tensor.requires_grad != requires_grad:
        tensor.requires_grad_(requires_grad)
    if tensor.grad is not grad:
        tensor.grad = grad


def attributes(obj: Any) -> dict[str, Any] | None:
    try:
        attributes = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return attributes if type(attributes) is dict else None


@functools.cache
def _slot_descriptors(cls: type) -> tuple[Any, ...]:
    found = []
    for klass in cls.__mro__:
        names = klass.__dict__.get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            descriptor = klass.__dict__.get(name)
            if isinstance(descriptor, types.MemberDescriptorType):
                found.append(descriptor)
    return tuple(found)


def slots(cls: type) -> tuple[Any, ...]:
    try:
        return _slot_descriptors(cls)
    except TypeError:  # an unhashable class
        return ()


def has_slot(slot: Any, obj: Any) -> bool:
    try:
        slot.__get__(obj)
    except AttributeError:
        return False
    return True


def cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return MISSING


def version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has none
        return None
