"""What a step records while an estimate runs it, readable once the estimate is over.

An estimate puts back every list, dict, attribute and closure variable the step reaches when it
ends (:mod:`memlab.estimate.isolation`), so a step that appends what it saw to a list of the test's
leaves nothing there. It does not save the state of C objects other than NumPy arrays and random
generators: a ``queue.SimpleQueue`` keeps what was put in it. Tests that look inside an estimated
step record through a :class:`Record`, which wraps one.
"""

from __future__ import annotations

import queue
from typing import Any


class Record:
    """``append(value)`` and ``record[key] = value`` while the step runs; :meth:`list` and
    :meth:`dict` afterwards, in the order recorded (across every run of the step)."""

    __slots__ = ("_queue", "_read")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read: list[Any] = []

    def append(self, value: Any) -> None:
        self._queue.put(value)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._queue.put((key, value))

    def list(self) -> list[Any]:
        while not self._queue.empty():
            self._read.append(self._queue.get_nowait())
        return list(self._read)

    def dict(self) -> dict[Any, Any]:
        return dict(self.list())
