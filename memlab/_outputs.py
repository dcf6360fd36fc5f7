"""Where memlab writes for its users, checked before any work: a file it is asked to write
(``to_json``, ``dump_snapshot``, ``plot``, the command line's ``-o``/``--snapshot``/``--plot``,
``%mlrun -T``) and a stream it is asked to print to (``report(stream=...)``), so that a bad one is
a one-line error naming the argument, not a traceback after the run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["check_output_path", "check_path_type", "check_stream", "check_text_output"]


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
    ``name`` and the path (``--plot out/run.png: no such folder 'out'``). What it cannot see:
    a disk that fills up while the file is written.
    """
    check_path_type(path, name)
    text = os.fspath(path)
    if not text:
        raise ValueError(f"{name} is empty: name a file to write")
    if extensions is not None and os.path.splitext(text)[1].lower() not in extensions:
        raise ValueError(f"{name} {text}: write to a file ending in {', '.join(extensions)}")
    if os.path.isdir(text):
        raise ValueError(f"{name} {text}: is a folder; name a file to write in it")
    folder = os.path.dirname(text)
    if folder and not os.path.isdir(folder):
        raise ValueError(f"{name} {text}: no such folder {folder!r}")
    if os.path.exists(text):
        if not os.access(text, os.W_OK):
            raise ValueError(f"{name} {text}: this process may not write to that file")
    elif not os.access(folder or os.curdir, os.W_OK | os.X_OK):
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
