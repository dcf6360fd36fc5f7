"""Record the memory snapshot of a run for the shells (``memlab run --snapshot``, ``%%mlrun
--snapshot``): PyTorch's own history on a CUDA GPU, a :class:`memlab.TensorTracker`'s without one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from memlab._devices import cuda_device_exists
from memlab.history.export import write_snapshot
from memlab.sources.cuda import CudaSource
from memlab.sources.tracker import TensorTracker

__all__ = ["snapshot_recorded", "snapshot_written"]


def _write(snapshot: dict, path: str | os.PathLike[str] | None, plot: str | os.PathLike[str] | None) -> None:
    if path is not None:
        write_snapshot(snapshot, path)
    if plot is not None:
        from memlab.history.plot import plot_memory

        plot_memory(snapshot, plot)


@contextlib.contextmanager
def snapshot_written(
    path: str | os.PathLike[str] | None,
    source: TensorTracker | CudaSource,
    plot: str | os.PathLike[str] | None = None,
) -> Iterator[None]:
    """Write the memory snapshot of ``source`` to ``path`` (pickle protocol 4; ``None``: no file)
    and its plot to ``plot`` (:func:`memlab.plot_memory`; ``None``: none) when the block ends,
    also when it raises.

    A :class:`~memlab.sources.cuda.CudaSource`: PyTorch records its own history of the source's
    device (``torch.cuda.memory._record_memory_history``) while the block runs, and the snapshot
    is ``torch.cuda.memory._snapshot()``; recording stops after it is taken. A
    :class:`~memlab.TensorTracker` (entered by the caller, with ``history`` on): its
    :meth:`~memlab.TensorTracker.snapshot` of the one device it has seen.
    """
    if isinstance(source, CudaSource):
        torch.cuda.memory._record_memory_history(device=source.device)
        try:
            yield
        finally:
            try:
                _write(source.snapshot(), path, plot)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None, device=source.device)
    else:
        try:
            yield
        finally:
            _write(source.snapshot(), path, plot)


@contextlib.contextmanager
def snapshot_recorded(
    path: str | os.PathLike[str] | None,
    device: torch.device,
    tracker: TensorTracker,
    plot: str | os.PathLike[str] | None = None,
) -> Iterator[None]:
    """Write the memory snapshot of the block to ``path`` and its plot to ``plot`` (either may be
    ``None``) when it ends, also when it raises: on ``device`` when it is a CUDA GPU present here
    (PyTorch's own, see :func:`snapshot_written`), else ``tracker``'s (``history`` on), which is
    entered for the block."""
    if cuda_device_exists(device):
        with snapshot_written(path, CudaSource(device), plot):
            yield
    else:
        with tracker, snapshot_written(path, tracker, plot):
            yield
