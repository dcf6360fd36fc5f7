"""What a memory source is: the one place that knows which device it measures and how.

Everything downstream (line profiler, reporter, estimators) reads numbers through this protocol and
sees the key set of ``torch.cuda.memory_stats()`` whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["MemorySource", "normalize_device"]


@runtime_checkable
class MemorySource(Protocol):
    """A device's memory statistics, with the keys and meaning of ``torch.cuda.memory_stats()``.

    ``memory_stats(device)`` returns the full snapshot (bytes for ``*_bytes.*`` keys, counts
    otherwise). ``sampler(keys, device)`` returns a cheap function for hot paths: each call returns
    the values of ``keys`` in order, where ``*.peak`` means the highest value since the previous
    call of that function. ``device=None`` means the source's default device.
    """

    def memory_stats(self, device: torch.device | str | int | None = None) -> dict[str, int]: ...

    def sampler(
        self, keys: Sequence[str], device: torch.device | str | int | None = None
    ) -> Callable[[], tuple[int, ...]]: ...


def normalize_device(device: torch.device | str | int | None) -> torch.device:
    """The ``torch.device`` a tracker keys statistics by.

    ``None`` is the default device (``torch.get_default_device()``, which honours a
    ``with torch.device(...)`` block); an ``int`` is that CUDA device; ``"cuda"`` is ``cuda:0``.
    """
    if device is None:
        device = torch.get_default_device()
    elif isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            "device must be a torch.device, a string such as 'cpu', 'meta' or 'cuda:0', "
            f"a CUDA index, or None; got {type(device).__name__} {device!r}"
        )
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"{device!r} is not a device; valid forms are 'cpu', 'meta', 'cuda', 'cuda:1', "
            "an int CUDA index, a torch.device, or None"
        ) from error
    if device.index is None and device.type not in ("cpu", "meta"):
        device = torch.device(device.type, 0)
    return device
