"""A bounded log of an allocator's events (allocations, frees, segments, OOMs) with interned stacks.

:class:`History` keeps the trace that ``torch.cuda.memory._record_memory_history()`` keeps on a
GPU, in a few compact columns, so that a run of a million events takes tens of megabytes, not
gigabytes. :func:`capture_stack` is the cheap Python stack walker the tensor tracker records with.
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any

import torch

from memlab.history.categories import CATEGORIES, category_code

__all__ = [
    "ACTIONS",
    "Frame",
    "History",
    "Stack",
    "capture_stack",
    "is_own_file",
    "make_history",
]

#: The trace entry actions of ``torch.cuda.memory._snapshot()``, by their code in a :class:`History`.
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
)
ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, OOM = range(
    len(ACTIONS)
)

Frame = tuple[str, int, str]  # (filename, line, function name)
Stack = tuple[Frame, ...]  # innermost first

_OWN_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torch.__file__, os.path.dirname(os.path.abspath(__file__)))
)
# id(code object) -> whether its file is torch's or memlab's. Keyed by id: a code object's own
# hash is computed anew at each call from its bytecode, names and constants (microseconds, the most
# of a stack walk); the code objects are kept in _codes, so that no id is reused while it is a key.
_skipped: dict[int, bool] = {}
_codes: list[CodeType] = []


def is_own_file(filename: str) -> bool:
    """Whether ``filename`` is in torch's folder or memlab's: frames that stacks, reports and
    failure messages leave out, so that the user's own line is the innermost one shown."""
    return os.path.abspath(filename).startswith(_OWN_DIRS)


def is_own_code(code: CodeType) -> bool:
    """:func:`is_own_file` of ``code``'s file, remembered per code object (one dict lookup)."""
    skip = _skipped.get(id(code))
    if skip is None:
        skip = _skipped[id(code)] = is_own_file(code.co_filename)
        _codes.append(code)
    return skip


_frames: dict[Frame, Frame] = {}  # every distinct frame, stored once
# (id(code), f_lasti) -> its frame: the line of an instruction is found by scanning the code's
# line table from its start (microseconds in a long function); the code is kept by _codes.
_frames_at: dict[tuple[int, int], Frame] = {}
_stacks: dict[Stack, Stack] = {}  # every distinct stack, stored once


def capture_stack() -> Stack:
    """The Python stack of the caller, innermost first, as interned ``(filename, line, name)``
    tuples, without frames of torch's or memlab's own files.

    Equal stacks are the same tuple object, and equal frames the same tuple, so a history of a
    long run holds each distinct stack once. Cost: one dict lookup per frame and one per stack
    (:func:`is_own_code` inlined: a call per frame was a third of the walk).
    """
    frames: list[Frame] = []
    skipped, frames_at = _skipped, _frames_at
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        skip = skipped.get(id(code))
        if skip is None:
            skip = is_own_code(code)
        if not skip:
            at = (id(code), frame.f_lasti)
            found = frames_at.get(at)
            if found is None:
                key = (code.co_filename, frame.f_lineno, code.co_name)
                found = frames_at[at] = _frames.setdefault(key, key)
            frames.append(found)
        frame = frame.f_back
    stack = tuple(frames)
    return _stacks.setdefault(stack, stack)


def _no_stack() -> Stack:
    return ()


class History:
    """The last ``max_entries`` events of one allocator (all of them with ``max_entries=None``).

    Each entry is an action of :data:`ACTIONS`, an address, a size in bytes, the Python stack
    at that moment (``stack()``; empty when the allocator is driven directly), a time in
    microseconds since the epoch and a category (one of
    :data:`~memlab.history.categories.CATEGORIES`; ``unknown`` until :meth:`set_category`).
    Addresses and sizes are the allocator model's: ``alloc``/``free_*`` carry the block's
    address and the requested bytes, ``segment_*`` the segment's address and total bytes, and
    ``oom`` the free device bytes (in the address column, PyTorch's ``device_free``) and the
    bytes it tried to map. Stream is always 0 (one stream is modelled).

    Entries live in parallel typed arrays (a ring buffer once full), so one entry costs about
    34 bytes plus its stack, which is shared with every other entry of the same stack.
    The stack and category of each live block and segment are kept apart, as PyTorch keeps a
    block's allocation context, so a snapshot knows them after the ring buffer dropped the entry.
    """

    def __init__(self, max_entries: int | None = None, stack: Callable[[], Stack] | None = None) -> None:
        if max_entries is not None and (isinstance(max_entries, bool) or not isinstance(max_entries, int)):
            raise TypeError(f"max_entries must be an int or None, got {type(max_entries).__name__}")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be > 0 (or None for no limit), got {max_entries}")
        self.max_entries = max_entries
        self.stack: Callable[[], Stack] = stack if stack is not None else _no_stack
        #: The category code an ``alloc`` entry gets when its block is freed still ``unknown``
        #: (0 keeps it ``unknown``; the tensor tracker sets ``temporary``).
        self.free_category = 0
        self._actions = array("B")
        self._addrs = array("q")
        self._sizes = array("q")
        self._times = array("q")
        self._category_codes = array("B")
        self._stacks: list[Stack] = []
        self._start = 0  # index of the oldest entry once the ring buffer is full
        self.recorded = 0  #: entries recorded in all, including those the ring buffer dropped
        #: ``address -> (stack, category code, number of its alloc entry)`` of each live block;
        #: ``segment_contexts`` the stacks of live segments
        self.block_contexts: dict[int, tuple[Stack, int, int]] = {}
        self.segment_contexts: dict[int, Stack] = {}

    def __len__(self) -> int:
        return len(self._actions)

    def record(self, action: int, addr: int, size: int, stack: Stack | None = None) -> None:
        """Append one entry (``action`` an index into :data:`ACTIONS`), dropping the oldest when full.

        ``stack`` defaults to ``self.stack()``; events of one call (a free's two entries) pass the
        stack they captured once."""
        if stack is None:
            stack = self.stack()
        now = time.time_ns() // 1000
        number = self.recorded
        self.recorded += 1
        if action == ALLOC:
            self.block_contexts[addr] = (stack, 0, number)
        elif action == FREE_COMPLETED:
            context = self.block_contexts.pop(addr, None)
            if context is not None and context[1] == 0 and self.free_category:
                self._set_entry_category(context[2], self.free_category)
        elif action == SEGMENT_ALLOC or action == SEGMENT_MAP:
            self.segment_contexts[addr] = stack
        elif action == SEGMENT_FREE:
            self.segment_contexts.pop(addr, None)
        if self.max_entries is None or len(self._actions) < self.max_entries:
            self._actions.append(action)
            self._addrs.append(addr)
            self._sizes.append(size)
            self._times.append(now)
            self._category_codes.append(0)
            self._stacks.append(stack)
            return
        i = self._start
        self._actions[i] = action
        self._addrs[i] = addr
        self._sizes[i] = size
        self._times[i] = now
        self._category_codes[i] = 0
        self._stacks[i] = stack
        self._start = (i + 1) % self.max_entries

    def _set_entry_category(self, number: int, code: int) -> None:
        """Set the category code of entry ``number`` (counted from the first entry ever
        recorded), unless the ring buffer dropped it."""
        if number >= self.recorded - len(self._actions):
            self._category_codes[number if self.max_entries is None else number % self.max_entries] = code

    def set_category(self, addr: int, category: str) -> None:
        """Give the live block at ``addr`` ``category`` (one of
        :data:`~memlab.history.categories.CATEGORIES`), in its context and in its ``alloc``
        entry, as PyTorch's viewer reads categories from the entries. A block that has a
        category keeps it; an address with no live block is ignored."""
        context = self.block_contexts.get(addr)
        if context is None or context[1] != 0:
            return
        code = category_code(category)
        self.block_contexts[addr] = (context[0], code, context[2])
        self._set_entry_category(context[2], code)

    def entries(self) -> Iterator[tuple[str, int, int, Stack, int, str]]:
        """The kept entries, oldest first, as ``(action, address, size, stack, time_us, category)``."""
        n = len(self._actions)
        names = CATEGORIES
        for j in range(n):
            i = (self._start + j) % n
            yield (
                ACTIONS[self._actions[i]],
                self._addrs[i],
                self._sizes[i],
                self._stacks[i],
                self._times[i],
                names[self._category_codes[i]],
            )

    def block_context(self, addr: int) -> tuple[Stack, str]:
        """The stack and category of the live block at ``addr`` (empty and unknown if not recorded)."""
        stack, code, _ = self.block_contexts.get(addr, ((), 0, 0))
        return stack, CATEGORIES[code]

    def nbytes(self) -> int:
        """Bytes this history holds: its columns, the list of stack references, and each distinct
        stack and frame it refers to (counted once). Filenames and names are not counted (they are
        the interpreter's code objects' own strings)."""
        columns = sum(
            a.buffer_info()[1] * a.itemsize
            for a in (self._actions, self._addrs, self._sizes, self._times, self._category_codes)
        )
        stacks = {id(s): s for s in self._stacks}
        frames = {id(f): f for s in stacks.values() for f in s}
        return (
            columns
            + sys.getsizeof(self._stacks)
            + sum(sys.getsizeof(s) for s in stacks.values())
            + sum(sys.getsizeof(f) + sys.getsizeof(f[1]) for f in frames.values())
        )


def make_history(history: Any, stack: Callable[[], Stack] | None = None) -> History | None:
    """The :class:`History` an allocator's ``history`` argument asks for: ``None``/``False`` none,
    ``True`` unbounded, an int ``max_entries`` a ring buffer of that many entries, or a
    :class:`History` as it is. ``stack`` is the stack walker of a new history."""
    if history is None or history is False:
        return None
    if isinstance(history, History):
        return history
    if history is True:
        return History(None, stack)
    if isinstance(history, int):
        if history <= 0:
            raise ValueError(f"history must be None, False, True or an int max_entries > 0, got {history}")
        return History(history, stack)
    raise TypeError(
        "history must be None, False, True or an int max_entries > 0, "
        f"got {type(history).__name__} {history!r}"
    )
