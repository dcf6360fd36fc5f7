"""CudaSource: the real GPU's own allocator statistics, read through ``torch.cuda``.

A thin layer: it only reads what PyTorch's CUDA caching allocator reports. Nothing here runs, and
CUDA is not initialised, until a method is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memlab._devices import cuda_device_exists, resolve_device
from memlab.sources.stats import STAT_KEYS

__all__ = ["CudaSource", "cuda_device_exists"]  # cuda_device_exists: see memlab._devices


class CudaSource:
    """Statistics of a real CUDA device, exactly as ``torch.cuda.memory_stats()`` reports them.

    ``device`` (default: the current CUDA device) is what ``device=None`` means in the methods.
    The numbers include everything the caching allocator handed out, also memory that no tensor
    tracker can see (cuBLAS workspaces allocated through the allocator); they exclude the CUDA
    context and memory allocated outside PyTorch's allocator (NCCL buffers, other libraries).

    CUDA offers no way to read the peak of an interval other than resetting the peak counters:
    :meth:`sampler` calls ``torch.cuda.reset_peak_memory_stats`` on each call, so after line
    profiling on a GPU ``torch.cuda.max_memory_allocated()`` reports the peak since the last
    profiled line, not since the user's own last reset.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = None if device is None else resolve_device(device)

    def _device(self, device: torch.device | str | int | None) -> torch.device | int | None:
        return self.device if device is None else device

    def memory_stats(self, device: torch.device | str | int | None = None) -> dict[str, int]:
        """``torch.cuda.memory_stats(device)``: bytes for ``*_bytes.*`` keys, counts otherwise."""
        return dict(torch.cuda.memory_stats(self._device(device)))

    def memory_allocated(self, device: torch.device | str | int | None = None) -> int:
        """Bytes allocated to tensors now (``torch.cuda.memory_allocated``)."""
        return int(torch.cuda.memory_allocated(self._device(device)))

    def snapshot(self, device: torch.device | str | int | None = None) -> dict[str, Any]:
        """PyTorch's own memory snapshot of ``device`` (``torch.cuda.memory._snapshot()``), the
        format of :meth:`memlab.TensorTracker.snapshot`, so one code path reads both.

        ``segments`` hold the blocks now; ``device_traces`` and the blocks' ``frames`` are filled
        only while PyTorch records its history, which whoever starts recording switches on with
        ``torch.cuda.memory._record_memory_history()`` (this method never does).
        """
        return torch.cuda.memory._snapshot(self._device(device))

    def sampler(
        self, keys: Sequence[str], device: torch.device | str | int | None = None
    ) -> Callable[[], tuple[int, ...]]:
        """Read ``keys`` on each call; ``*.peak`` keys are peaks since the previous call (this
        resets CUDA's peak counters, see the class docstring)."""
        unknown = [key for key in keys if key not in STAT_KEYS]
        if unknown:
            raise ValueError(f"unknown statistic {unknown[0]!r}; valid keys are: {', '.join(STAT_KEYS)}")
        target = self._device(device)
        keys = tuple(keys)
        # Resetting the peaks before anything touched CUDA fails ("Invalid device argument": the
        # caching allocator is made at CUDA's lazy initialisation), e.g. under
        # ``torch.set_default_device("cuda")`` before the first tensor.
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(target)

        def sample() -> tuple[int, ...]:
            stats = torch.cuda.memory_stats(target)
            torch.cuda.reset_peak_memory_stats(target)
            return tuple(stats.get(key, 0) for key in keys)

        return sample
