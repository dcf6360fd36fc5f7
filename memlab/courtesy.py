"""Courtesy: park every tensor of a device in host memory or on disk, and bring it back bit-exact.

Tensors are moved in place (the same Python objects are re-pointed at new storages), one storage at
a time, so views stay views and code that holds the tensors keeps working after :meth:`Courtesy.restore`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memlab._devices import DeviceLike, cuda_device_exists, parse_device, require_usable
from memlab._tensors import live_storages

__all__ = ["Courtesy"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class _View:
    """Where one tensor sat in a moved storage."""

    tensor: weakref.ref[torch.Tensor]
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _MovedStorage:
    """One storage taken off the device: its bytes (in ``host`` or ``path``) and every view of it."""

    device: torch.device
    nbytes: int
    views: list[_View]
    host: weakref.ref[torch.UntypedStorage] | None = None
    path: Path | None = None
    restored: torch.UntypedStorage | None = field(default=None, repr=False)


class Courtesy:
    """Give a device's memory back to others for a while, then take it back.

    ``yield_memory()`` moves every tensor on ``device`` that ``gc`` can reach (parameters, their
    ``.grad``, buffers, optimizer state, plain tensors, and the bases of views) off the device, in
    place: the tensors stay the same Python objects, each storage is copied once and every tensor
    on it is re-pointed at the copy with its own offset, sizes and strides, so views stay views.
    On CUDA it then calls ``torch.cuda.empty_cache()``.

    ``offload="cpu"`` keeps the bytes in host memory (the tensors live on the CPU meanwhile).
    ``offload=<directory>`` writes each storage to a file there (its raw bytes: no pickle, and read
    back straight into the new device buffer or a staging buffer) and leaves shape-only
    placeholders: the tensors keep their ``shape`` and ``dtype`` but sit on the CPU over one shared
    element per dtype (stride 0, NaN for floating types), so they free host memory too; reading
    them gives NaN or 0 and writing to them raises. ``Courtesy(device="cpu", offload=directory)``
    frees host memory and is the path testable without a GPU.

    ``restore()`` brings every moved storage back to the device it came from, bit-exact, and
    re-points the tensors at it. It does nothing without a yield; if it fails part-way (a missing
    file, an out-of-memory error) nothing is lost and calling it again finishes the job. A second
    ``yield_memory()`` before ``restore()`` only moves tensors that appeared on the device since.
    Tensors dropped by their users meanwhile are not restored; a tensor whose storage the user
    replaced meanwhile is left as the user made it.

    What it cannot move: memory held by C++ rather than by tensors ``gc`` sees (autograd graphs still
    alive and their saved tensors, cuDNN/cuBLAS workspaces, C++ extensions, the CUDA context). A
    storage that such a hidden tensor shares with visible ones is left in place, since moving it
    would free nothing and split the views; so are sparse, nested and quantized tensors and wrapper
    subclasses (a subclass's inner tensors move if ``gc`` sees them). ``skipped`` counts the tensors
    holding storages on the device that the last yield left in place. Use it between steps, not
    while an autograd graph is alive, and not while other threads use the tensors.
    """

    def __init__(self, device: DeviceLike = "cuda", offload: str | os.PathLike[str] = "cpu") -> None:
        """``device``: any form :func:`memlab._devices.parse_device` reads, a device this machine
        has (``ValueError`` for ``meta`` and for a CUDA device that does not exist here)."""
        self.device = _yieldable(parse_device(device))
        self.offload: str | Path = _parse_offload(offload)
        if self.offload == "cpu" and self.device.type == "cpu":
            raise ValueError(
                "Courtesy(device='cpu', offload='cpu') would move host memory to host memory; "
                "pass a directory as offload to free host memory"
            )
        self.skipped = 0
        self._moved: list[_MovedStorage] = []
        self._workdir: Path | None = None
        self._placeholders: dict[torch.dtype, torch.UntypedStorage] = {}
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
        up to 511 B more per storage, and its cache, which is emptied on CUDA). If it fails
        part-way, what was moved stays recorded: call it again to continue, or :meth:`restore`.
        """
        storages = self._device_storages()
        moved_now = 0
        while storages:
            _, (storage, tensors) = storages.popitem()
            moved_now += self._move_out(storage, tensors)
            del storage, tensors
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return moved_now

    def restore(self) -> int:
        """Bring every moved storage back to its device, bit-exact; return the bytes restored.

        Each storage is copied back once and all its live tensors are re-pointed at it with their
        original offsets, sizes and strides. Without a preceding yield it does nothing and returns
        0. On failure the storages not yet restored stay recorded; calling it again resumes.
        """
        restored = 0
        while self._moved:
            moved = self._moved[0]
            live = self._live_views(moved)
            if live and moved.restored is None:
                moved.restored = self._read_back(moved)
            for tensor, view in live:
                tensor.data = _view_of(moved.restored, view)
            if live:
                restored += moved.nbytes
            del live
            if moved.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    moved.path.unlink()
            self._moved.pop(0)
        if self._workdir is not None:
            with contextlib.suppress(OSError):
                self._workdir.rmdir()
            self._workdir = None
        return restored

    # -- yield ---------------------------------------------------------------------------------
    def _device_storages(self) -> dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]]:
        """Storages on the device that can move, keyed by ``id`` of the storage object, with the
        tensors to re-point at their copy; :attr:`skipped` counts the tensors left in place."""
        placeholders = {id(storage) for storage in self._placeholders.values()}
        groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
        left: dict[int, torch.Tensor] = {}
        for key, live in live_storages(self.device).items():
            if key in placeholders:
                continue
            movable = []
            for tensor in live.tensors:
                if _movable(tensor):
                    movable.append(tensor)
                else:
                    left[id(tensor)] = tensor
            if movable and _held_elsewhere(live.storage, len(movable)):
                left.update((id(tensor), tensor) for tensor in movable)
            elif movable:
                groups[key] = (live.storage, movable)
        self.skipped = len(left)
        return groups

    def _move_out(self, storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> int:
        """Copy ``storage`` out, record it, re-point ``tensors``; return its bytes."""
        views = [
            _View(weakref.ref(t), t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)
            for t in tensors
        ]
        moved = _MovedStorage(storage.device, storage.nbytes(), views)
        if self.offload == "cpu":
            host = torch.empty(moved.nbytes, dtype=torch.uint8, device="cpu")
            host.copy_(_bytes_of(storage))
            moved.host = weakref.ref(host.untyped_storage())
            self._moved.append(moved)
            for tensor, view in zip(tensors, views, strict=True):
                tensor.data = _view_of(host.untyped_storage(), view)
            return moved.nbytes
        moved.path = self._write(storage)
        self._moved.append(moved)
        for tensor, view in zip(tensors, views, strict=True):
            tensor.data = self._placeholder(view)
        return moved.nbytes

    def _write(self, storage: torch.UntypedStorage) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="memlab-courtesy-", dir=self.offload))
        path = self._workdir / f"storage-{self._serial:06d}.bin"
        self._serial += 1
        data = _bytes_of(storage)
        if data.device.type != "cpu":
            data = data.cpu()
        try:
            with open(path, "wb") as file:
                file.write(memoryview(data.numpy()))
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return path

    def _placeholder(self, view: _View) -> torch.Tensor:
        """A CPU tensor with the view's shape and dtype over one shared element (stride 0)."""
        storage = self._placeholders.get(view.dtype)
        if storage is None:
            # Built outside the dispatcher: a tracker sees no allocation for the placeholders.
            storage = torch.UntypedStorage(view.dtype.itemsize)
            element = torch.empty(0, dtype=view.dtype).set_(storage, 0, (1,), (1,))
            element.fill_(float("nan") if view.dtype.is_floating_point or view.dtype.is_complex else 0)
            self._placeholders[view.dtype] = storage
        return torch.empty(0, dtype=view.dtype).set_(storage, 0, view.size, (0,) * len(view.size))

    # -- restore -------------------------------------------------------------------------------
    def _live_views(self, moved: _MovedStorage) -> list[tuple[torch.Tensor, _View]]:
        """Tensors of ``moved`` that are alive and still sit where the yield (or a restore) put them."""
        ours = set()
        host = None if moved.host is None else moved.host()
        for storage in (host, moved.restored, *self._placeholders.values()):
            if storage is not None:
                ours.add(id(storage))
        live = []
        for view in moved.views:
            tensor = view.tensor()
            if tensor is not None and id(tensor.untyped_storage()) in ours:
                live.append((tensor, view))
        return live

    def _read_back(self, moved: _MovedStorage) -> torch.UntypedStorage:
        """A new storage on the original device holding the moved bytes."""
        if moved.path is None:
            host = None if moved.host is None else moved.host()
            if host is None:
                raise RuntimeError("the host copy of a moved storage is gone although tensors still use it")
            buffer = torch.empty(moved.nbytes, dtype=torch.uint8, device=moved.device)
            buffer.copy_(_bytes_of(host))
            return buffer.untyped_storage()
        staging = torch.empty(moved.nbytes, dtype=torch.uint8, device="cpu")
        with open(moved.path, "rb") as file:
            read = file.readinto(memoryview(staging.numpy()))
        if read != moved.nbytes:
            raise OSError(f"{moved.path} holds {read} bytes, expected {moved.nbytes}; the file was changed")
        if moved.device.type != "cpu":
            staging = staging.to(moved.device)
        return staging.untyped_storage()


def _movable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be re-pointed at a copy of its storage: dense, neither nested nor
    quantized, and not a wrapper subclass (whose inner tensors move on their own)."""
    if type(tensor) not in _PLAIN_TYPES and is_traceable_wrapper_subclass(tensor):
        return False
    return tensor.layout is torch.strided and not tensor.is_nested and not tensor.is_quantized


def _held_elsewhere(storage: torch.UntypedStorage, visible: int) -> bool:
    """Whether tensors ``gc`` cannot see also hold ``storage`` (beyond ``visible`` ones and our handle)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(storage._cdata) > visible + 1


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view_of(storage: torch.UntypedStorage, view: _View) -> torch.Tensor:
    return torch.empty(0, dtype=view.dtype, device=storage.device).set_(
        storage, view.offset, view.size, view.stride
    )


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


def _parse_offload(offload: Any) -> str | Path:
    if isinstance(offload, torch.device):
        offload = str(offload)
    if not isinstance(offload, (str, os.PathLike)):
        raise TypeError(
            f"offload must be 'cpu' or the path of a directory; got {type(offload).__name__} {offload!r}"
        )
    if offload in ("cpu", "cpu:0"):
        return "cpu"
    path = Path(offload)
    if path.is_dir():
        return path
    if isinstance(offload, str) and _is_device_string(offload):
        raise ValueError(
            f"offload={offload!r}: tensors can only be offloaded to 'cpu' or to files in a directory"
        )
    raise ValueError(f"offload={str(offload)!r} is neither 'cpu' nor an existing directory; create it first")


def _is_device_string(text: str) -> bool:
    try:
        parse_device(text)
    except ValueError:
        return False
    return True
