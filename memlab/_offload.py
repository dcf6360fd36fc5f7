"""Offload files for :class:`memlab.Courtesy`: raw bytes written once with their CRC-32, read back
and checked, deleted without failing, and Ctrl-C held back while tensors are being put back."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from memlab._devices import parse_device

__all__ = [
    "interrupts_held",
    "parse_offload",
    "read_bytes",
    "reason",
    "remove_file",
    "warn_undeletable",
    "write_bytes",
]


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C back until the block is done, then raise its ``KeyboardInterrupt``: a block that
    puts tensors back is never left half done. Only where Python's own SIGINT handler is installed
    and only in the main thread (the one that receives signals); elsewhere the block runs as is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:  # also in place of an error of the block: Ctrl-C asked to stop
            raise KeyboardInterrupt


def _buffer(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU ``storage`` as a writable buffer. Not through ``.numpy()``: PyTorch then
    marks the storage as shared with NumPy for good (``resizable()`` turns false)."""
    return memoryview((ctypes.c_ubyte * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


def write_bytes(path: Path, storage: torch.UntypedStorage) -> int:
    """Write the bytes of a CPU ``storage`` to a new file at ``path``; return their CRC-32
    (``zlib.crc32``, about 40 ms for 256 MiB, a sixteenth of the write to a local disk)."""
    data = _buffer(storage)
    with open(path, "xb") as file:
        file.write(data)
    return zlib.crc32(data)


def read_bytes(path: Path, nbytes: int, checksum: int | None = None) -> torch.UntypedStorage:
    """The ``nbytes`` bytes written to ``path``, in a new CPU storage; ``OSError`` when the file is
    missing or unreadable, holds another number of bytes (truncated or grown), or, given the
    ``checksum`` :func:`write_bytes` returned, bytes whose CRC-32 differs (changed in place)."""
    storage = torch.empty(nbytes, dtype=torch.uint8, device="cpu").untyped_storage()
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        read = file.readinto(_buffer(storage)) if size == nbytes else None
    if read != nbytes:
        raise OSError(f"the file holds {size} bytes, {nbytes} were written: it was truncated or changed")
    if checksum is not None and (found := zlib.crc32(_buffer(storage))) != checksum:
        raise OSError(
            f"its bytes changed after they were written (CRC-32 {found:#010x}, {checksum:#010x} was "
            "written): it was overwritten or corrupted"
        )
    return storage


def remove_file(path: Path | None, undeletable: list[str]) -> None:
    """Delete an offload file; one that cannot be deleted is added to ``undeletable``."""
    if path is None:
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        undeletable.append(f"{path} ({reason(error)})")


def warn_undeletable(undeletable: list[str]) -> None:
    """One warning naming the files (or folder) that could not be deleted; the data is safe."""
    if undeletable:
        warnings.warn(
            f"Courtesy could not delete {len(undeletable)} offload file{'s' * (len(undeletable) != 1)} "
            "after use (the tensors are fine); delete them yourself: " + ", ".join(undeletable),
            stacklevel=4,
        )


def reason(error: BaseException) -> str:
    """An error in a few words: ``No such file or directory``, not the path again."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def parse_offload(offload: Any) -> str | Path:
    """``"cpu"`` or the directory ``offload`` names; ``TypeError`` / ``ValueError`` saying what is valid."""
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
