"""New threads follow the trackers: a dispatch mode belongs to the thread that entered it.

``TorchDispatchMode`` stacks are per thread, so a tracker entered in one thread sees nothing of the
tensors another thread makes. While at least one callback is registered here, every thread started
through :mod:`threading` runs the callbacks first, before its own code: ``threading.setprofile``
gives new threads a profile function, which removes itself at its first event (handing the thread
the profile function it would have had) and calls them there, in the new thread. Nothing is
installed while no callback is registered. Threads that were already running cannot be reached
(Python offers no way to run code in another running thread): :func:`unreachable_threads` names
them, so that a table can say whose ops it misses.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Container
from types import FrameType
from typing import Any

__all__ = ["follow_new_threads", "unreachable_threads"]

_lock = threading.Lock()
_callbacks: list[Callable[[], None]] = []
_installed: Any = None  # the profile function handed to new threads, while callbacks are registered
_previous: Any = None  # what threading handed new threads before


def follow_new_threads(enter: Callable[[], None]) -> Callable[[], None]:
    """Call ``enter()`` at the start of every thread started through :mod:`threading` from now on,
    in that thread, before its first line; return the function that stops it (call it once).

    Callbacks run in registration order. One that raises is skipped: it must not stop the thread.
    """
    global _installed, _previous
    with _lock:
        _callbacks.append(enter)
        if _installed is None:
            _previous = threading.getprofile()
            _installed = _start_hook(_previous)
            threading.setprofile(_installed)

    def stop() -> None:
        global _installed, _previous
        with _lock:
            _callbacks.remove(enter)
            if _callbacks or _installed is None:
                return
            if threading.getprofile() is _installed:  # another tool may have replaced it since
                threading.setprofile(_previous)
            _installed = _previous = None

    return stop


def _start_hook(previous: Any) -> Callable[[FrameType, str, Any], Any]:
    def enter_new_thread(frame: FrameType, event: str, arg: Any) -> Any:
        sys.setprofile(previous)
        with _lock:
            callbacks = list(_callbacks)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a thread must start whatever a tracker does
                continue
        return None if previous is None else previous(frame, event, arg)

    return enter_new_thread


def unreachable_threads(followed: Container[threading.Thread]) -> dict[int, str]:
    """The threads running now that code starting to follow new threads cannot reach, by ident:
    name. Left out: the calling thread, the main thread (it runs the program rather than helping
    it), threads in ``followed``, and daemon threads (service threads such as Jupyter's, which
    would be named on every table)."""
    current, main = threading.current_thread(), threading.main_thread()
    return {
        thread.ident: thread.name
        for thread in threading.enumerate()
        if thread is not current
        and thread is not main
        and not thread.daemon
        and thread.ident is not None
        and thread not in followed
    }
