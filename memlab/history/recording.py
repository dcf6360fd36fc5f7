"""Record the memory snapshot of a run for the shells (``memlab run --snapshot``, ``%%mlrun
--snapshot``): PyTorch's own history on a CUDA GPU, a :class:`memlab.TensorTracker`'s without one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from memlab._devices import cuda_device_exists
from memlab.history.export import write_snapshot
from memlab.sources.cuda import CudaSource
from memlab.sources.tracker import TensorTracker

__all__ = ["OnError", "collect_unwritten", "snapshot_recorded", "snapshot_written"]


#: What a shell does with a file that could not be written: ``on_error(kind, error)``, ``kind``
#: ``"snapshot"`` or ``"plot"``.
OnError = Callable[[str, BaseException], None]


def collect_unwritten(
    unwritten: list[str], snapshot: str | os.PathLike[str] | None, plot: str | os.PathLike[str] | None
) -> OnError:
    """The ``on_error`` of the shells' ``--snapshot FILE`` and ``--plot FILE``: adds
    ``"--snapshot FILE: why"`` or ``"--plot FILE: why"`` to ``unwritten``, for the shell to say
    after it has shown the table."""

    def on_error(kind: str, error: BaseException) -> None:
        option, path = ("--snapshot", snapshot) if kind == "snapshot" else ("--plot", plot)
        unwritten.append(f"{option} {path}: {error}")

    return on_error


def _write(
    source: TensorTracker | CudaSource,
    path: str | os.PathLike[str] | None,
    plot: str | os.PathLike[str] | None,
    on_error: OnError | None,
) -> None:
    """Write the snapshot, then the plot; with ``on_error``, a failure of one (a full disk, a
    folder removed, a snapshot without trace entries to plot) is handed to it and the other is
    still written."""
    if path is None and plot is None:
        return
    snapshot = source.snapshot()
    if path is not None:
        try:
            write_snapshot(snapshot, path)
        except Exception as error:
            if on_error is None:
                raise
            on_error("snapshot", error)
    if plot is not None:
        from memlab.history.plot import plot_memory

        try:
            plot_memory(snapshot, plot)
        except Exception as error:
            if on_error is None:
                raise
            on_error("plot", error)


@contextlib.contextmanager
def snapshot_written(
    path: str | os.PathLike[str] | None,
    source: TensorTracker | CudaSource,
    plot: str | os.PathLike[str] | None = None,
    on_error: OnError | None = None,
) -> Iterator[None]:
    """Write the memory snapshot of ``source`` to ``path`` (pickle protocol 4; ``None``: no file)
    and its plot to ``plot`` (:func:`memlab.plot_memory`; ``None``: none) when the block ends,
    also when it raises. A file that cannot be written is handed to ``on_error`` (``"snapshot"``
    or ``"plot"``, the exception) when given, else its exception is raised.

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
                _write(source, path, plot, on_error)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None, device=source.device)
    else:
        try:
            yield
        finally:
            _write(source, path, plot, on_error)


@contextlib.contextmanager
def snapshot_recorded(
    path: str | os.PathLike[str] | None,
    device: torch.device,
    tracker: TensorTracker,
    plot: str | os.PathLike[str] | None = None,
    on_error: OnError | None = None,
) -> Iterator[None]:
    """Write the memory snapshot of the block to ``path`` and its plot to ``plot`` (either may be
    ``None``) when it ends, also when it raises: on ``device`` when it is a CUDA GPU present here
    (PyTorch's own, see :func:`snapshot_written`), else ``tracker``'s (``history`` on), which is
    entered for the block. ``on_error``: as for :func:`snapshot_written`."""
    if cuda_device_exists(device):
        with snapshot_written(path, CudaSource(device), plot, on_error):
            yield
    else:
        with tracker, snapshot_written(path, tracker, plot, on_error):
            yield
