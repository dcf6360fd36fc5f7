"""Watches put around profiled calls, registered by a higher layer than the code that runs them.

The line profiler (layer 4) enters every watch in :data:`CALL_WATCHES` around each profiled call
and each ``with lp:`` block, without knowing what they do; ``memlab/__init__.py`` registers the OOM
watch (:func:`memlab.explain_oom`, layer 6) here, so that the profiler never imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["CALL_WATCHES", "CallWatch", "WatchedCall"]

#: ``watch(func, args, kwargs)`` returns a context manager entered around one call of ``func``
#: with ``args``/``kwargs`` (``func`` is ``None`` for a block such as ``with lp:``). Its
#: ``__exit__`` sees the exception leaving the call and must not swallow it.
CallWatch = Callable[[Any, tuple[Any, ...], dict[str, Any]], AbstractContextManager[Any]]

#: The watches entered around every profiled call, outermost first.
CALL_WATCHES: list[CallWatch] = []


class WatchedCall:
    """Every watch of :data:`CALL_WATCHES` entered around one call (``func=None``: a block), in
    order, and left in reverse order with the exception that ends the call, as nested ``with``
    statements would be: a watch that fails to enter leaves the ones already entered with its
    error."""

    __slots__ = ("_call", "_stack")

    def __init__(
        self, func: Any = None, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> None:
        self._call = (func, args, {} if kwargs is None else kwargs)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> WatchedCall:
        with contextlib.ExitStack() as stack:
            for watch in CALL_WATCHES:
                stack.enter_context(watch(*self._call))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)
