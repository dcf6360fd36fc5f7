"""``@memlab.profile`` functions called in DataLoader worker processes: counted, not profiled.

A DataLoader with ``num_workers > 0`` runs ``Dataset.__getitem__`` (and what it calls) in worker
processes. Their records cannot reach the main process's table: a forked worker ends with
``os._exit`` (no exit report at all), a spawned one would print its own table at its exit, in the
middle of the main process's output, unlabelled. So a profiled function runs unprofiled in a
worker, at full speed, and the worker counts its calls in a small file of its own under a folder
named after its parent's PID (the process that made the DataLoader, which prints the table); the
parent reads the folder when it reports and prints one line per function:
``12 calls of make ran in 2 DataLoader worker processes and were not collected``.
The same code serves fork and spawn workers (both are told apart by
``torch.utils.data.get_worker_info()``, and their parent is the main process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

__all__ = ["WorkerCalls", "calls_folder", "in_dataloader_worker", "worker_calls_lines"]


def in_dataloader_worker() -> bool:
    """Whether this process is a DataLoader worker (``torch.utils.data.get_worker_info()`` is set
    there, in fork and spawn workers alike, before the dataset is first called)."""
    from torch.utils.data import get_worker_info  # torch imports it with torch itself

    return get_worker_info() is not None


def calls_folder(pid: int) -> str:
    """The folder where the workers of process ``pid`` count their calls (per user, per parent)."""
    return os.path.join(tempfile.gettempdir(), f"memlab-{os.getuid()}-worker-calls-{pid}")


class WorkerCalls:
    """The calls of profiled functions in this worker process, by function name, each written
    through to this worker's file (one 8-byte ``pwrite`` per call: a crash loses nothing)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._files: dict[str, int] = {}
        self._failed = False

    def count(self, name: str) -> None:
        """Count one call of ``name`` here. A file that cannot be written counts nothing (the
        parent then says nothing of it) and never fails the worker."""
        calls = self._counts[name] = self._counts.get(name, 0) + 1
        if self._failed:
            return
        try:
            descriptor = self._files.get(name)
            if descriptor is None:
                folder = calls_folder(os.getppid())
                os.makedirs(folder, mode=0o700, exist_ok=True)
                path = os.path.join(folder, f"{os.getpid()}.{len(self._files)}")
                descriptor = self._files[name] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.write(descriptor, f"{0:>20}\n{name}\n".encode())
            os.pwrite(descriptor, f"{calls:>20}".encode(), 0)
        except OSError:
            self._failed = True


def worker_calls_lines(pid: int | None = None, *, remove: bool = True) -> list[str]:
    """One line per function whose calls ran in DataLoader workers of process ``pid`` (default:
    this one) and were not collected, e.g. ``12 calls of make ran in 2 DataLoader worker
    processes and were not collected``; ``[]`` when none did. With ``remove``, the counts are
    forgotten once read (each group is said once)."""
    folder = calls_folder(os.getpid() if pid is None else pid)
    totals: dict[str, list[Any]] = {}
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(folder)):
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(folder, entry), encoding="utf-8") as file,
            ):
                calls, name = int(file.readline()), file.readline().rstrip("\n")
                total = totals.setdefault(name, [0, set()])
                total[0] += calls
                total[1].add(entry.split(".")[0])
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    return [
        f"{calls} call{'s' if calls != 1 else ''} of {name} ran in {len(workers)} DataLoader worker "
        f"process{'es' if len(workers) != 1 else ''} and {'were' if calls != 1 else 'was'} not collected"
        for name, (calls, workers) in totals.items()
        if calls
    ]
