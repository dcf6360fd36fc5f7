"""Nested trackers and a capacity: what an outer tracker counts waits for the inner one's verdict.

Trackers nest as dispatch modes: the innermost one is called first, runs the op through the ones
below it, and counts its outputs last. An outer tracker therefore counts an op's outputs before an
inner ``TensorTracker(capacity=...)`` can refuse them with ``torch.OutOfMemoryError``, and would
count a request that no GPU made (an allocation that failed allocates nothing). So a tracker that
can refuse holds the counting of the trackers below it, in its thread, while its op runs
(:func:`holding`): they hand their counting to it (:func:`held`) as a callable, and it settles
them (:func:`settle`) once it has counted: on refusal each counts the outputs made before the
refused one (a GPU allocates an op's outputs in order and frees them as the error unwinds) and no
cuBLAS workspace; otherwise they count everything, or hand it on to the next tracker that can
refuse further out, which has not decided yet.

Two nested trackers that both have a capacity decide one after the other: where the inner one
accepts a request that the outer one refuses, the inner one has counted it (an allocation freed at
once). Storages resized through ``UntypedStorage.resize_`` or made outside the dispatcher are
counted at once by every tracker.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["WORKSPACE", "deciding", "held", "holding", "refused_workspace", "settle"]

#: A tracker's counting of one op, given what was refused (``None``: nothing; else the storage
#: refused, or :data:`WORKSPACE` when the refusal was the op's cuBLAS workspace).
Counting = Callable[[Any], None]
#: What an op's counting is told when the tracker that refused it refused its cuBLAS workspace.
WORKSPACE = object()


class _Here(threading.local):
    """Per thread: ``frames``, one list of held countings per tracker deciding, outermost first."""

    def __init__(self) -> None:
        self.frames: list[list[Counting]] = []


_here = _Here()


@contextlib.contextmanager
def holding() -> Iterator[list[Counting]]:
    """While the op runs below a tracker that can refuse: the countings held for it (yielded)."""
    frames = _here.frames
    frame: list[Counting] = []
    frames.append(frame)
    try:
        yield frame
    finally:
        frames.pop()


def deciding() -> bool:
    """Whether a tracker of this thread is deciding (an op runs below one that can refuse): a
    tracker then hands its counting on with :func:`held`, else counts at once (no callable made)."""
    return bool(_here.frames)


def held(counting: Counting) -> bool:
    """Hand ``counting`` to the innermost tracker of this thread that is still deciding; ``False``
    where none is (then count now)."""
    frames = _here.frames
    if not frames:
        return False
    frames[-1].append(counting)
    return True


def settle(frame: list[Counting], refused: Any = None) -> None:
    """The held countings of ``frame`` once its tracker has decided: with ``refused`` (the storage
    refused) each runs now, knowing it; without, each is handed on to a tracker further out that
    is still deciding, or runs now."""
    for counting in frame:
        if refused is not None or not held(counting):
            counting(refused)


def refused_workspace() -> object:
    """What a tracker that refused an op's cuBLAS workspace keeps in place of a weak reference to
    the refused storage: it returns :data:`WORKSPACE`."""
    return WORKSPACE
