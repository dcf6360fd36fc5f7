"""Which of a device's storages :class:`memlab.Courtesy` can move off it, and which stay.

A storage moves when ``gc`` sees every tensor that holds it, they can all be re-pointed at a copy
(dense, neither nested nor quantized, no wrapper subclass), its memory is PyTorch's own and not
shared with other processes, and it hands out its data pointer. Everything else stays in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memlab._tensors import live_storages

__all__ = ["MovableStorages", "describe", "movable_storages"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class MovableStorages:
    """A device's storages sorted for a yield.

    ``groups``: the storages that can move, keyed by ``id`` of the storage object, each with the
    tensors to re-point at its copy. ``left``: how many tensors holding storages on the device
    stay in place. ``shared``: one description (tensors, bytes, what shares it) per storage left
    in place because its memory is shared. ``quantized``: the quantized tensors left in place.
    """

    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = field(default_factory=dict)
    left: int = 0
    shared: list[str] = field(default_factory=list)
    quantized: list[torch.Tensor] = field(default_factory=list)


def movable_storages(device: torch.device, skip: set[int]) -> MovableStorages:
    """The storages on ``device`` that ``gc`` can reach, sorted into those that can move and those
    that stay (see the module); storages whose ``id`` is in ``skip`` (placeholders) are neither."""
    found = MovableStorages()
    left: dict[int, torch.Tensor] = {}
    for key, live in live_storages(device).items():
        if key in skip:
            continue
        tensors = []
        for tensor in live.tensors:
            if movable(tensor):
                tensors.append(tensor)
            else:
                left[id(tensor)] = tensor
                if tensor.is_quantized:
                    found.quantized.append(tensor)
        shared = sharing(live.storage) if tensors else None
        if shared is not None:
            left.update((id(tensor), tensor) for tensor in tensors)
            found.shared.append(f"{describe(tensors)} ({live.storage.nbytes()} B, {shared})")
        elif tensors and (held_elsewhere(live.storage, len(tensors)) or not readable(live.storage)):
            left.update((id(tensor), tensor) for tensor in tensors)
        elif tensors:
            found.groups[key] = (live.storage, tensors)
    found.left = len(left)
    return found


def describe(tensors: list[torch.Tensor]) -> str:
    """``float32 [64, 32]`` for one tensor, a list for several."""
    names = [f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}" for t in tensors]
    if len(names) == 1:
        return f"tensor {names[0]}"
    return f"tensors {', '.join(names)}" if names else "no live tensor"


def sharing(storage: torch.UntypedStorage) -> str | None:
    """What ``storage`` shares its memory with, when moving it would break that sharing; else ``None``."""
    if storage.device.type == "cpu" and storage.is_shared():
        return "in shared memory (share_memory_()): other processes see it"
    if not storage.resizable():
        # PyTorch marks a storage so when it wraps memory it does not own, and for good once
        # .numpy() has handed the storage's memory to NumPy.
        return "memory shared outside PyTorch (torch.from_numpy, .numpy(), frombuffer, DLPack, a memory map)"
    return None


def movable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be re-pointed at a copy of its storage: dense, neither nested nor
    quantized, and not a wrapper subclass (whose inner tensors move on their own)."""
    if type(tensor) not in _PLAIN_TYPES and is_traceable_wrapper_subclass(tensor):
        return False
    return tensor.layout is torch.strided and not tensor.is_nested and not tensor.is_quantized


def held_elsewhere(storage: torch.UntypedStorage, visible: int) -> bool:
    """Whether tensors ``gc`` cannot see also hold ``storage`` (beyond ``visible`` ones and our handle)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(storage._cdata) > visible + 1


def readable(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` hands out its data pointer (another Courtesy's placeholders and fake
    tensors' storages refuse: they hold nothing to move)."""
    try:
        storage.data_ptr()
    except RuntimeError:
        return False
    return True
