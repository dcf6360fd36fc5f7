"""What a memory source is: the one place that knows which device it measures and how.

Everything downstream (line profiler, reporter, estimators) reads numbers through this protocol and
sees the key set of ``torch.cuda.memory_stats()`` whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["MemorySource"]


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
