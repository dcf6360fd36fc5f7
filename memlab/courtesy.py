"""Courtesy: park every tensor of a device in host memory or on disk, and bring it back bit-exact.

Tensors are moved in place (the same Python objects are re-pointed at new storages), one storage at
a time, so views stay views and code that holds the tensors keeps working after :meth:`Courtesy.restore`.
Parking is all or nothing; restoring brings back everything it can and names what it could not.
"""

from __future__ import annotations

import os
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from memlab import _offload
from memlab._devices import DeviceLike, cuda_device_exists, parse_device, require_usable
from memlab._movable import describe, movable_storages
from memlab._moved import MovedStorage, live_tensors_of, recorded, storage_ids
from memlab._parked import (
    ParkedTensorError,
    Parking,
    View,
    placeholder_storage_ids,
    repoint,
    tensors_on,
    unplaced_message,
)
from memlab._parked_guard import park

__all__ = ["Courtesy", "ParkedTensorError"]


class Courtesy:
    """Give a device's memory back to others for a while, then take it back.

    ``yield_memory()`` moves every tensor on ``device`` that ``gc`` can reach (parameters, their
    ``.grad``, buffers, optimizer state, plain tensors, and the bases of views) off the device, in
    place: the tensors stay the same Python objects, each storage is copied once and every tensor
    on it is re-pointed at the copy with its own offset, sizes and strides, so views stay views.
    On CUDA it then frees cuBLAS's workspaces (made again at the next matmul) and calls
    ``torch.cuda.empty_cache()``. Parking is all or nothing: if it fails
    part-way (a full disk, an out-of-memory error, Ctrl-C), every tensor it moved is back on its
    original storage and the files it wrote are removed before the error is raised.

    ``offload="cpu"`` keeps the bytes in host memory: the tensors are ordinary CPU tensors
    meanwhile, and what is done to them (writes, ``resize_``, ``unsqueeze_``, views taken of
    them) is carried back to the device. ``offload=<directory>`` writes each storage to a file
    there (its raw bytes: no pickle, read back straight into the new device buffer or a staging
    buffer), with a CRC-32 of the bytes as written, and leaves shape-only placeholders: the
    tensors keep their ``shape`` and ``dtype`` but sit on the CPU over one element (stride 0, NaN
    for floating types, 0 otherwise), so they free host memory too. Reading them gives NaN or 0.
    A parked ``torch.Tensor`` or ``nn.Parameter`` is a ``ParkedTensor`` / ``ParkedParameter``
    (subclasses: ``isinstance`` holds) until restored: every op that would write to it or change
    its shape, strides or storage in place (``add_``, ``copy_``, ``t[i] = x``, ``out=``,
    ``resize_``, ``set_``, ``unsqueeze_``, ``t_``, ``as_strided_``, an optimizer step, a backward
    pass accumulating into a parked ``.grad``), whatever its shape, raises
    :class:`ParkedTensorError` (a ``RuntimeError``) saying it is parked until ``restore()``, and
    changes nothing; views and aliases taken of it (``w[0]``, ``w.T``, ``w.detach()``, ``w.data``,
    ``w.view(...)``) are parked with it and read the restored data afterwards. What needs the
    data pointer raises too (``.numpy()``, ``data_ptr()``, ``copy.deepcopy``: the same error;
    ``torch.save``: PyTorch's ``RuntimeError``).
    ``Courtesy(device="cpu", offload=directory)`` frees host memory and is the path testable
    without a GPU.

    ``restore()`` brings every moved storage back to the device it came from, bit-exact, and
    re-points the tensors at it, with the views taken meanwhile (it finds them through ``gc``).
    It does nothing without a yield. A storage it cannot bring back (its file deleted,
    truncated or changed meanwhile, an out-of-memory error, a tensor made over its placeholder
    out of its sight, e.g. by ``as_subclass``, whose place it cannot work out) does not hold back
    the others: it restores all it can, then raises an error that names what is still parked and
    why; calling it again once the cause is fixed brings back the rest, and never loses more.
    Failing to delete a file it has read back (a read-only directory) is a warning. Ctrl-C in the
    main thread waits until a restore (or the undoing of a failed yield) is complete. A second
    ``yield_memory()`` before ``restore()`` only moves tensors that appeared on the device since.
    Tensors dropped by their users meanwhile are not restored; a tensor whose storage the user
    replaced meanwhile (``t.data = x``) is left as the user made it. Inference tensors (made
    under ``torch.inference_mode()``) stay inference tensors. Every dtype moves, sub-byte and
    ``float8`` / ``float4`` ones included, except quantized ones (see below).

    What it does not move, and counts in ``skipped`` (tensors holding storages on the device that
    the last yield left in place): memory shared with others, which moving would unshare and may
    not free: tensors over memory shared outside PyTorch (``torch.from_numpy``, a storage whose
    memory ``.numpy()`` ever handed to NumPy, ``frombuffer``, DLPack, memory maps) and host tensors
    in shared memory (``share_memory_()``, seen by other processes); a warning names them. Memory
    held by C++ rather than by tensors ``gc`` sees (autograd graphs still alive and their saved
    tensors, cuDNN/cuBLAS workspaces, C++ extensions, the CUDA context): a storage that such a
    hidden tensor shares with visible ones is left in place, since moving it would free nothing
    and split the views; so are sparse, nested and quantized tensors (a warning names the
    quantized ones) and wrapper subclasses (a subclass's inner tensors move if ``gc`` sees them).
    Use it between steps, not while an autograd graph is alive, and not while other threads use
    the tensors.
    """

    def __init__(self, device: DeviceLike = "cuda", offload: str | os.PathLike[str] = "cpu") -> None:
        """``device``: any form :func:`memlab._devices.parse_device` reads, a device this machine
        has (``ValueError`` for ``meta`` and for a CUDA device that does not exist here)."""
        self.device = _yieldable(parse_device(device))
        self.offload: str | Path = _offload.parse_offload(offload)
        if self.offload == "cpu" and self.device.type == "cpu":
            raise ValueError(
                "Courtesy(device='cpu', offload='cpu') would move host memory to host memory; "
                "pass a directory as offload to free host memory"
            )
        self.skipped = 0
        self._moved: list[MovedStorage] = []
        self._workdir: Path | None = None
        self._serial = 0

    def __repr__(self) -> str:
        device, offload = str(self.device), str(self.offload)
        return f"Courtesy(device={device!r}, offload={offload!r}, yielded_bytes={self.yielded_bytes})"

    @property
    def yielded_bytes(self) -> int:
        """Bytes of device storages currently moved off the device and not yet restored."""
        return sum(moved.nbytes for moved in self._moved)

    def __enter__(self) -> Courtesy:
        self.yield_memory()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.restore()

    def yield_memory(self) -> int:
        """Move every reachable tensor on the device off it; return the storage bytes moved now.

        Bytes are the exact ``nbytes`` of the moved storages (the device's allocator may have held
        up to 511 B more per storage, and its cache, which is emptied on CUDA); the device memory
        is released once every storage is parked. All or nothing: on any failure (``Ctrl-C``
        included) the tensors moved by this call are put back on their original storages, the
        files written for them are removed, and the error is raised; tensors moved by an earlier
        call stay moved.
        """
        storages = self._device_storages()
        first, had_workdir = len(self._moved), self._workdir is not None
        moved_now = 0
        try:
            while storages:
                _, (storage, tensors) = storages.popitem()
                moved_now += self._move_out(storage, tensors)
                del storage, tensors
            for moved in self._moved[first:]:
                moved.original = None  # parked: the device memory is released here
            if self.device.type == "cuda" and torch.cuda.is_initialized():
                # cuBLAS's workspaces (32 MiB per handle and stream on sm90) are allocated blocks no
                # tensor holds; PyTorch makes them again at the next matmul.
                torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
        except BaseException:
            with _offload.interrupts_held():
                self._roll_back(first, had_workdir)
            raise
        return moved_now

    def restore(self) -> int:
        """Bring every moved storage back to its device, bit-exact; return the bytes restored.

        Each storage is copied back once and every live tensor on it (those the yield moved and
        the views taken of them since) is re-pointed at it: a parked tensor and its views at their
        original offsets, sizes and strides, a tensor parked in host memory as it is now. Without
        a preceding yield it does nothing and returns 0. Storages that cannot be brought back stay
        recorded (their tensors stay placeholders) while every other one is restored; then it
        raises ``OSError`` (a file missing, truncated, changed or unreadable) or ``RuntimeError``
        (anything else, e.g. out of memory, or a tensor over a placeholder whose place it cannot
        work out) naming each of them, its tensors and the cause. Calling it again resumes. A file
        that cannot be deleted after it was read back is a warning naming it. Ctrl-C in the main
        thread is held until it returns.
        """
        with _offload.interrupts_held():
            return self._restore()

    def _restore(self) -> int:
        restored = 0
        failed: list[tuple[MovedStorage, str, Exception]] = []  # what, its tensors (named), why
        undeletable: list[str] = []
        found = tensors_on({key for moved in self._moved for key in storage_ids(moved)})
        for moved in list(self._moved):
            live = live_tensors_of(moved, found)
            error = self._bring_back(moved, live)
            if error is not None:  # this storage stays parked; the others come back
                failed.append((moved, describe([tensor for tensor, _ in live]), error))
            elif live:
                restored += moved.nbytes
            del live  # no user tensor may stay referenced by this frame (an error's traceback)
            if error is None:
                self._forget(moved, undeletable)
        del found
        if not self._moved:
            self._remove_workdir(undeletable)
        _offload.warn_undeletable(undeletable)
        if failed:
            raise _not_restored(failed)
        return restored

    def _bring_back(
        self, moved: MovedStorage, live: list[tuple[torch.Tensor, View | None]]
    ) -> Exception | None:
        """Re-point the ``live`` tensors of ``moved`` at a copy read back; the error that prevents
        it (raised by nothing: its traceback, which would hold the tensors, is dropped)."""
        unplaced = [tensor for tensor, view in live if view is None]
        if unplaced:
            return ParkedTensorError(unplaced_message(unplaced))
        if live and moved.restored is None:
            try:
                moved.restored = self._read_back(moved)
            except Exception as error:
                return error.with_traceback(None)
        for tensor, view in live:
            if moved.parking is not None:
                moved.parking.release(tensor)
            repoint(tensor, moved.restored, view)
        return None

    def _forget(self, moved: MovedStorage, undeletable: list[str]) -> None:
        """Drop ``moved`` (back, or rolled back): its file, its placeholders, its record."""
        _offload.remove_file(moved.path, undeletable)
        if moved.parking is not None:
            moved.parking.close()
        self._moved.remove(moved)

    def _roll_back(self, first: int, had_workdir: bool) -> None:
        """Undo a yield that failed: the tensors moved since ``self._moved[first]`` go back to their
        original storages (or, where one was already released, to a copy read back), and the files
        written for them are removed. No user code ran meanwhile: the tensors are those recorded."""
        undeletable: list[str] = []
        while len(self._moved) > first:
            moved = self._moved[-1]
            live = recorded(moved)
            if live:
                storage = moved.original if moved.original is not None else self._read_back(moved)
                for tensor, view in live:
                    if moved.parking is not None:
                        moved.parking.release(tensor)
                    repoint(tensor, storage, view)
            del live
            self._forget(moved, undeletable)
        if not had_workdir:
            self._remove_workdir(undeletable)
        _offload.warn_undeletable(undeletable)

    def _remove_workdir(self, undeletable: list[str]) -> None:
        if self._workdir is None:
            return
        try:
            self._workdir.rmdir()
        except FileNotFoundError:
            pass
        except OSError as error:
            if not undeletable:  # a folder left behind for its files needs no line of its own
                undeletable.append(f"{self._workdir} ({_offload.reason(error)})")
        self._workdir = None

    # -- yield ---------------------------------------------------------------------------------
    def _device_storages(self) -> dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]]:
        """Storages on the device that can move (:mod:`memlab._movable`), keyed by ``id`` of the
        storage object, with the tensors to re-point at their copy; :attr:`skipped` counts the
        tensors left in place, and a warning names those whose memory is shared, another the
        quantized ones."""
        found = movable_storages(self.device, placeholder_storage_ids())
        self.skipped = found.left
        if found.shared:
            count = len(found.shared)
            warnings.warn(
                f"Courtesy left {count} storage{'s' * (count != 1)} on {self.device} in "
                "place: their memory is shared, which moving them would break (and may free nothing): "
                + "; ".join(found.shared),
                stacklevel=3,
            )
        if found.quantized:
            count = len(found.quantized)
            warnings.warn(
                f"Courtesy left {count} quantized tensor{'s' * (count != 1)} on {self.device} in place "
                f"(it cannot re-point a quantized tensor at a copy): {describe(found.quantized)}",
                stacklevel=3,
            )
        return found.groups

    def _move_out(self, storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> int:
        """Copy ``storage`` out, record it, re-point ``tensors``; return its bytes. It is recorded
        before anything is written, so that a failure at any point can be rolled back."""
        views = [View.of(tensor) for tensor in tensors]
        moved = MovedStorage(storage.device, storage.nbytes(), views, original=storage)
        if self.offload == "cpu":
            host = torch.empty(moved.nbytes, dtype=torch.uint8, device="cpu")
            host.copy_(_bytes_of(storage))
            moved.host = weakref.ref(host.untyped_storage())
            self._moved.append(moved)
            for tensor, view in zip(tensors, views, strict=True):
                repoint(tensor, host.untyped_storage(), view)
            return moved.nbytes
        moved.path = self._next_path()
        moved.parking = Parking(moved.nbytes)
        self._moved.append(moved)
        host_bytes = storage if storage.device.type == "cpu" else _bytes_of(storage).cpu().untyped_storage()
        moved.checksum = _offload.write_bytes(moved.path, host_bytes)
        for tensor, view in zip(tensors, views, strict=True):
            park(moved.parking, tensor, view)
        return moved.nbytes

    def _next_path(self) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="memlab-courtesy-", dir=self.offload))
        path = self._workdir / f"storage-{self._serial:06d}.bin"
        self._serial += 1
        return path

    # -- restore -------------------------------------------------------------------------------
    def _read_back(self, moved: MovedStorage) -> torch.UntypedStorage:
        """A new storage on the original device holding the moved bytes (all the bytes of the host
        copy, which a ``resize_`` meanwhile may have grown)."""
        if moved.path is None:
            host = None if moved.host is None else moved.host()
            if host is None:
                raise RuntimeError("the host copy of a moved storage is gone although tensors still use it")
            buffer = torch.empty(host.nbytes(), dtype=torch.uint8, device=moved.device)
            buffer.copy_(_bytes_of(host))
            return buffer.untyped_storage()
        staging = _offload.read_bytes(moved.path, moved.nbytes, moved.checksum)
        return (
            staging if moved.device.type == "cpu" else _bytes_of(staging).to(moved.device).untyped_storage()
        )


def _not_restored(failed: list[tuple[MovedStorage, str, Exception]]) -> Exception:
    """The error :meth:`Courtesy.restore` raises for storages it could not bring back."""
    lines = []
    for moved, tensors, error in failed:
        where = str(moved.path) if moved.path is not None else "host copy"
        lines.append(f"{where} ({moved.nbytes} B, {tensors}): {_offload.reason(error)}")
    count = len(failed)
    text = (
        f"Courtesy.restore() could not bring back {count} storage{'s' * (count != 1)}; "
        f"{'their' if count != 1 else 'its'} tensors stay parked (placeholders that read NaN or 0) "
        "and everything else is restored. Fix the cause (put the file back, free memory) and call "
        "restore() again: " + "; ".join(lines)
    )
    kind = OSError if all(isinstance(error, OSError) for _, _, error in failed) else RuntimeError
    raised = kind(text)
    raised.__cause__ = failed[0][2]
    return raised


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _yieldable(device: torch.device) -> torch.device:
    """``device`` if it holds memory this machine could yield, else ``ValueError`` saying what is valid."""
    if device.type == "meta":
        raise ValueError(f"device 'meta' holds no memory to yield; valid here: {_valid_here()}")
    if device.type == "cuda" and not cuda_device_exists(device):
        raise ValueError(
            f"Courtesy(device={str(device)!r}): this machine has no such CUDA device, so there is "
            f"nothing to yield; valid here: {_valid_here()}"
        )
    return require_usable(device)


def _valid_here() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = {0: "", 1: "'cuda', "}.get(count, f"'cuda:0' to 'cuda:{count - 1}', ")
    return f"{gpus}'cpu' with a directory as offload"
