"""Reading a :class:`~memlab.sources.tracker.TensorTracker`'s statistics, as ``torch.cuda`` reads a GPU's.

:class:`TrackerStatistics` is the tracker's half with the ``torch.cuda``-style readers
(``memory_stats``, ``memory_allocated``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
``empty_cache``, ...). It is a mixin of ``TensorTracker``: it reads the tracker's allocators
(``_allocator_for``, ``_seen``, ``_allocators``) after draining its pending releases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memlab._devices import resolve_device

__all__ = ["TrackerStatistics"]


class TrackerStatistics:
    """The statistics half of :class:`~memlab.sources.tracker.TensorTracker` (see the module)."""

    def _stats_allocator(self, device: torch.device | str | int | None) -> Any:
        if self._pending:
            self._drain()
        if device is None and len(self._seen) == 1:
            device = next(iter(self._seen))
        return self._allocator_for(resolve_device(device))

    def memory_stats(self, device: torch.device | str | int | None = None) -> dict[str, int]:
        """Allocator statistics of ``device`` with the keys of ``torch.cuda.memory_stats()``.

        Bytes for ``*_bytes.*`` keys, counts otherwise, as the modelled allocator would report
        them for the storages created since the tracker was entered (and those it adopted).
        ``device=None`` is the one device the tracker has seen storages on, or, when it has seen
        none or several, the default device (``torch.get_default_device()``); a device never
        used reads all zeros. The other methods read ``device=None`` the same way.
        """
        return self._stats_allocator(device).memory_stats()

    def sampler(
        self, keys: Sequence[str], device: torch.device | str | int | None = None
    ) -> Callable[[], tuple[int, ...]]:
        """A fast reader of ``keys`` for the line profiler (see ``MemorySource``).

        Each call returns the current values of ``keys``; a ``*.peak`` key reads the highest value
        since the previous call of the same sampler, leaving the user-visible peak untouched.
        """
        return self._stats_allocator(device).table.sampler(keys, self._pending, self._drain)

    def memory_allocated(self, device: torch.device | str | int | None = None) -> int:
        """Bytes currently allocated to tensors on ``device`` (``allocated_bytes.all.current``)."""
        return self.memory_stats(device)["allocated_bytes.all.current"]

    def max_memory_allocated(self, device: torch.device | str | int | None = None) -> int:
        """Peak allocated bytes on ``device`` since entry or the last peak reset."""
        return self.memory_stats(device)["allocated_bytes.all.peak"]

    def memory_reserved(self, device: torch.device | str | int | None = None) -> int:
        """Bytes the modelled allocator holds from the device (``reserved_bytes.all.current``)."""
        return self.memory_stats(device)["reserved_bytes.all.current"]

    def max_memory_reserved(self, device: torch.device | str | int | None = None) -> int:
        """Peak reserved bytes on ``device`` since entry or the last peak reset."""
        return self.memory_stats(device)["reserved_bytes.all.peak"]

    def reset_peak_memory_stats(self, device: torch.device | str | int | None = None) -> None:
        """Set every ``*.peak`` of ``device`` to its current value."""
        self._stats_allocator(device).reset_peak_memory_stats()

    def reset_accumulated_memory_stats(self, device: torch.device | str | int | None = None) -> None:
        """Zero the ``*.allocated`` / ``*.freed`` totals and event counters of ``device``."""
        self._stats_allocator(device).reset_accumulated_memory_stats()

    def empty_cache(self, device: torch.device | str | int | None = None) -> None:
        """Release the modelled cached blocks of ``device``, as ``torch.cuda.empty_cache()`` would."""
        self._stats_allocator(device).empty_cache()

    @property
    def devices(self) -> list[torch.device]:
        """The devices on which the tracker has seen storages (or was asked about), in order."""
        return list(self._allocators)
