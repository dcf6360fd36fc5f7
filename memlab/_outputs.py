"""Where memlab writes for its users: a file it is asked to write (``to_json``, ``dump_snapshot``,
``plot``, the command line's ``-o``/``--snapshot``/``--plot``, ``%mlrun -T``) and a stream it is
asked to print to (``report(stream=...)``), checked before any work so that a bad one is a
one-line error naming the argument, not a traceback after the run; and every such file written
whole or not at all (:func:`replacing_path`), so that a full disk or Ctrl-C never leaves a
truncated file in place of the previous one."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from typing import IO, Any

__all__ = [
    "check_output_path",
    "check_path_type",
    "check_stream",
    "check_text_output",
    "replacing_file",
    "replacing_path",
    "write_text",
]


def check_path_type(path: Any, name: str = "path") -> None:
    """``TypeError`` naming ``name`` unless ``path`` is a ``str`` or ``os.PathLike`` (an ``int``
    would be opened as a file descriptor, ``bytes`` are not shown as written)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a file path (a str or os.PathLike), got {type(path).__name__} {path!r:.80}"
        )


def check_output_path(
    path: Any, name: str = "path", extensions: Sequence[str] | None = None
) -> str | os.PathLike[str]:
    """``path`` if a file can be written there now: a ``str`` or ``os.PathLike`` (not a file
    descriptor) ending in one of ``extensions`` (any ending when ``None``), not a folder, in a
    folder that exists and that this process may write in (or an existing file it may write).

    Raises ``TypeError`` for another type and ``ValueError`` otherwise; the message starts with
    ``name`` and the path (``--plot out/run.png: no such folder 'out'``). The folder must let
    this process create files even when the file exists: :func:`replacing_path` writes the new
    file beside the old one. What it cannot see: a disk that fills up while the file is written.
    """
    check_path_type(path, name)
    text = os.fspath(path)
    if not text:
        raise ValueError(f"{name} is empty: name a file to write")
    if os.path.isdir(text):
        raise ValueError(f"{name} {text}: is a folder; name a file to write in it")
    if extensions is not None and os.path.splitext(text)[1].lower() not in extensions:
        raise ValueError(f"{name} {text}: write to a file ending in {', '.join(extensions)}")
    folder = os.path.dirname(text)
    if folder and not os.path.isdir(folder):
        raise ValueError(f"{name} {text}: no such folder {folder!r}")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise ValueError(f"{name} {text}: this process may not write to that file")
    target = _target(text)
    if target is not None:  # a regular file (or none yet): written beside it, then renamed onto it
        folder = os.path.dirname(target)
        if not os.access(folder or os.curdir, os.W_OK | os.X_OK):
            raise ValueError(f"{name} {text}: this process may not create files in {folder or os.curdir!r}")
    return path


def check_text_output(path_or_buf: Any, name: str = "path_or_buf") -> None:
    """Check where text is to be written: ``None`` (returned as a string), an object with a
    ``write`` method, or a path :func:`check_output_path` accepts; ``TypeError``/``ValueError``
    naming ``name`` otherwise."""
    if path_or_buf is None or callable(getattr(path_or_buf, "write", None)):
        return
    if isinstance(path_or_buf, bytes) or not isinstance(path_or_buf, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be None, a file path (a str or os.PathLike) or an object with a write() method, "
            f"got {type(path_or_buf).__name__} {path_or_buf!r}"
        )
    check_output_path(path_or_buf, name)


def check_stream(stream: Any, name: str = "stream") -> None:
    """Check a text stream argument: ``None`` (``sys.stdout`` or ``sys.stderr`` at the time) or an
    object with a ``write`` method; ``TypeError`` naming ``name`` otherwise."""
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(
            f"{name} must be None or a text stream with a write() method (sys.stdout, an open file, "
            f"io.StringIO()), got {type(stream).__name__} {stream!r:.80}"
        )


# -- writing whole files --------------------------------------------------------------------------
def _target(path: str) -> str | None:
    """The file that writing ``path`` replaces: ``path``, or the file a symbolic link at ``path``
    points to (``open(path, "w")`` writes through the link, and so does memlab); ``None`` when
    that is not a regular file (``/dev/null``, a named pipe), which is written in place."""
    target = os.path.realpath(path) if os.path.islink(path) else path
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    return target if stat.S_ISREG(mode) else None


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells (``/proc/self/status``),
    else by setting it and setting it back."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _sync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (where the system can open a folder to sync it)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def replacing_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary path in the folder of ``path`` for the block to write the whole file to; when the
    block ends, the file is synced to disk and renamed onto ``path`` (``os.replace``, atomic on one
    file system). When the block raises (a full disk, ``KeyboardInterrupt``, any error), the
    temporary file is deleted and ``path`` is left as it was: the previous file byte for byte, or
    no file. Nothing partial, empty or temporary is left behind.

    The temporary file is ``.<name>.<random>.tmp`` beside ``path`` (so a writer that picks the
    format from the extension must be told the format). The new file gets the mode of the file it
    replaces, or ``0o666`` less the umask for a new one, as ``open(path, "w")`` would give. A
    symbolic link at ``path`` is written through (the file it points to is replaced); a path that
    is not a regular file (``/dev/null``, a named pipe) is yielded as it is and written in place.
    A power cut leaves the old file or the new one, each whole. What it cannot keep: the owner
    and the hard links of a replaced file (the new file is this process's); and a Ctrl-C inside
    ``mkstemp`` itself, between creating the temporary file and returning its name, would leave
    that empty file behind (a few instructions).
    """
    target = _target(os.fspath(path))
    if target is None:
        yield os.fspath(path)
        return
    folder, name = os.path.split(target)
    temporary = None
    try:
        descriptor, temporary = tempfile.mkstemp(dir=folder or os.curdir, prefix=f".{name}.", suffix=".tmp")
        os.close(descriptor)
        yield temporary
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    _sync_folder(folder or os.curdir)


@contextlib.contextmanager
def replacing_file(
    path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8", newline: str | None = None
) -> Iterator[IO[Any]]:
    """The file at ``path`` opened for writing with ``mode`` (``"w"`` text, ``"wb"`` bytes), written
    whole or not at all (see :func:`replacing_path`): what the block writes replaces ``path`` when
    the block ends, and nothing replaces it when the block raises."""
    with (
        replacing_path(path) as temporary,
        open(temporary, mode, encoding=None if "b" in mode else encoding, newline=newline) as file,
    ):
        yield file


def write_text(path: str | os.PathLike[str], text: str, newline: str | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path``, whole or not at all (see :func:`replacing_path`)."""
    with replacing_file(path, "w", newline=newline) as file:
        file.write(text)
