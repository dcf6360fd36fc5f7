"""Progress of work that takes more than a moment (batch searches, big estimates, the trainers'
estimates): one status line on a terminal, rewritten in place, and a record per update on the
``memlab`` logger.

The line is written to ``sys.stderr`` (or a given stream) only where a person watches it: when the
stream is a terminal (``isatty()``), unless ``progress=False`` or the environment variable
``MEMLAB_PROGRESS=0`` says otherwise; ``progress=True`` or ``MEMLAB_PROGRESS=1`` show it on any
stream. An explicit ``progress`` argument wins over the variable. Log records are emitted whatever
the terminal does (level INFO for results, DEBUG for what is being tried); by default Python shows
neither, until the user configures logging (``logging.basicConfig(level=logging.INFO)``) or a
handler on ``logging.getLogger("memlab")``.
"""

from __future__ import annotations

import logging
import os
import sys
from types import TracebackType
from typing import TextIO

__all__ = ["ENVIRONMENT_VARIABLE", "LOGGER", "Progress", "progress_shown"]

#: The logger every progress record goes to.
LOGGER = logging.getLogger("memlab")
#: ``0`` hides the terminal line, ``1`` shows it on any stream; unset: shown on a terminal.
ENVIRONMENT_VARIABLE = "MEMLAB_PROGRESS"
_SETTINGS = {"0": False, "1": True}


def progress_shown(progress: bool | None, stream: TextIO) -> bool:
    """Whether the progress line is written to ``stream``: ``progress`` when it is ``True`` or
    ``False``; for ``None``, ``MEMLAB_PROGRESS`` (``0``: no, ``1``: yes) where it is set, else
    whether ``stream`` is a terminal. ``TypeError`` for a ``progress`` that is not a bool or
    ``None``, ``ValueError`` for a ``MEMLAB_PROGRESS`` other than ``0`` or ``1``."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(
            "progress must be True (show it), False (hide it) or None (on a terminal, unless "
            f"MEMLAB_PROGRESS=0), got {type(progress).__name__} {progress!r:.80}"
        )
    if progress is not None:
        return progress
    setting = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if setting:
        if setting not in _SETTINGS:
            raise ValueError(
                f"{ENVIRONMENT_VARIABLE} must be 0 (no progress line) or 1 (always one), got {setting!r:.80}"
            )
        return _SETTINGS[setting]
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """The progress of one piece of work named ``task`` (``"max_batch_size"``, ``"estimate"``).

    Each :meth:`update` replaces the terminal line with ``memlab <task>: <message>`` (a carriage
    return, the text, spaces over what is left of a longer previous line) and logs ``<task>:
    <message>`` on :data:`LOGGER`; :meth:`done` writes the last line and ends it with a newline.
    Leaving the ``with`` block ends a line still open (an error, or no :meth:`done`), so that the
    next output starts on a line of its own. ``progress`` and ``stream`` (default ``sys.stderr``,
    read when the object is made) decide whether the line is written (:func:`progress_shown`);
    the logger always gets the records. A stream that fails to write is left alone: progress
    never interrupts the work it reports.
    """

    def __init__(self, task: str, *, progress: bool | None = None, stream: TextIO | None = None) -> None:
        if not isinstance(task, str) or not task:
            raise TypeError(f"task must be a non-empty str naming the work, got {task!r:.80}")
        self.task = task
        self.stream = stream if stream is not None else sys.stderr
        #: Whether the terminal line is written.
        self.shown = progress_shown(progress, self.stream)
        self._width = 0  # length of the line on the terminal; 0: no line open

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._width:
            self._write("\n")
            self._width = 0

    def update(self, message: str, level: int = logging.INFO) -> None:
        """Show ``message`` as the work's current state; log it at ``level``."""
        LOGGER.log(level, "%s: %s", self.task, message)
        if self.shown:
            line = f"memlab {self.task}: {message}"
            self._write("\r" + line.ljust(self._width))
            self._width = max(len(line), 1)

    def done(self, message: str) -> None:
        """Show ``message`` as the work's outcome and end the line; log it at INFO."""
        self.update(message)
        if self.shown:
            self._write("\n")
        self._width = 0

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception:  # a closed or broken stream must not stop the work
            self.shown = False
