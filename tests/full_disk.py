"""A disk that fills up half-way through a write, for the tests of files memlab writes: while
installed, files opened by path for writing in one folder take ``room`` more bytes, the bytes that
fit land in the file, and then the write raises (``OSError(ENOSPC)`` as a full disk does, or
``KeyboardInterrupt`` as Ctrl-C arriving mid-write). Every writer memlab uses opens its file with
``open`` (pickle and text through memlab, PNG through Pillow, SVG and PDF through matplotlib, CSV
through pandas), so one patched ``open`` reaches them all."""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest

__all__ = ["NO_SPACE", "FullDisk"]

#: What ``write(2)`` raises on a full disk.
NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
_REAL_OPEN = builtins.open


class _FillingFile(io.FileIO):
    """A file on the full disk: its writes take room from ``disk`` until there is none."""

    disk: FullDisk

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        if len(data) <= self.disk.room:
            written = super().write(data)
            self.disk.room -= written
            return written
        if self.disk.room:
            super().write(data[: self.disk.room])
        self.disk.room = 0
        self.disk.failures.append((os.path.basename(str(self.name)), os.fstat(self.fileno()).st_size))
        raise self.disk.error


class FullDisk:
    """Writes to files in ``folder`` fail once ``room`` bytes are written (see the module).
    ``failures`` lists ``(file name, bytes it held)`` at each failed write: proof that a
    partial file existed before memlab cleaned up."""

    def __init__(self, folder: Path, room: int, error: BaseException = NO_SPACE) -> None:
        self.folder = os.path.realpath(folder)
        self.room = room
        self.error = error
        self.failures: list[tuple[str, int]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FullDisk:
        monkeypatch.setattr(builtins, "open", self.open)
        monkeypatch.setattr(io, "open", self.open)
        return self

    def open(
        self,
        file: Any,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
        closefd: bool = True,
        opener: Any = None,
    ) -> Any:
        writes = any(c in mode for c in "wax+")
        if not writes or not isinstance(file, (str, os.PathLike)):
            return _REAL_OPEN(file, mode, buffering, encoding, errors, newline, closefd, opener)
        if os.path.dirname(os.path.realpath(file)) != self.folder:
            return _REAL_OPEN(file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = _FillingFile(file, mode.replace("b", "").replace("t", ""), closefd, opener)
        raw.disk = self
        buffered = io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, io.text_encoding(encoding), errors, newline)
