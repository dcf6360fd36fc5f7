"""The record :class:`memlab.Courtesy` keeps of a storage it took off the device: where its bytes are
(host memory or a file) and which tensors sit on it while it is away, to be put back."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memlab._parked import Parking, View

__all__ = ["MovedStorage", "live_tensors_of", "recorded", "storage_ids"]


@dataclass(eq=False)
class MovedStorage:
    """One storage taken off the device: its bytes (in ``host``, or in ``path`` with its
    ``checksum`` and the ``parking`` of its placeholders) and the tensors the yield moved.

    ``original`` holds the storage itself while the yield that moved it runs, so that a yield
    failing part-way can put every tensor back where it was without reading anything back."""

    device: torch.device
    nbytes: int
    views: list[View]
    host: weakref.ref[torch.UntypedStorage] | None = None
    path: Path | None = None
    checksum: int | None = None
    parking: Parking | None = None
    restored: torch.UntypedStorage | None = field(default=None, repr=False)
    original: torch.UntypedStorage | None = field(default=None, repr=False)


def storage_ids(moved: MovedStorage) -> set[int]:
    """``id`` of the storages the tensors of ``moved`` sit on while it is away."""
    if moved.parking is not None:
        return moved.parking.storage_ids()
    host = None if moved.host is None else moved.host()
    return set() if host is None else {id(host)}


def live_tensors_of(
    moved: MovedStorage, found: dict[int, list[torch.Tensor]]
) -> list[tuple[torch.Tensor, View | None]]:
    """The live tensors on the storages of ``moved`` (those recorded, which ``gc`` may not see if
    only C++ holds them, and those ``found`` there), each with where it goes back: a parked tensor
    where it was (``None`` where that is unknown), one in host memory as it is now."""
    tensors = {id(tensor): tensor for tensor, _ in recorded(moved)}
    for key in storage_ids(moved):
        for tensor in found.get(key, ()):
            tensors.setdefault(id(tensor), tensor)
    if moved.parking is None:
        return [(tensor, View.of(tensor)) for tensor in tensors.values()]
    return [(tensor, moved.parking.view_of(tensor)) for tensor in tensors.values()]


def recorded(moved: MovedStorage) -> list[tuple[torch.Tensor, View]]:
    """The tensors the yield moved (recorded before anything was written, so also one that an
    interrupted yield re-pointed but had not yet followed) and the views followed since, that are
    alive and still where the yield or the guard put them."""
    views = [*moved.views, *(moved.parking.views.values() if moved.parking is not None else ())]
    keys = storage_ids(moved)
    live: dict[int, tuple[torch.Tensor, View]] = {}
    for view in views:
        tensor = view.tensor()
        if tensor is not None and id(tensor) not in live and id(tensor.untyped_storage()) in keys:
            live[id(tensor)] = (tensor, view)
    return list(live.values())
