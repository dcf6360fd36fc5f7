"""Storages made from Python reach the trackers: ``torch.UntypedStorage(n)`` bypasses the dispatcher.

``copy.deepcopy`` of a tensor copies its storage with ``UntypedStorage.__deepcopy__`` ->
``_StorageBase.clone`` -> ``type(self)(nbytes, device=...)`` (``torch/storage.py``), then points a
fresh 0-byte tensor at the copy with ``set_``: the one allocation is the storage's constructor,
C++ (``THPStorage_pynew`` in ``torch/csrc/Storage.cpp``) that allocates with the device's allocator
and calls no aten op, so no ``TorchDispatchMode`` sees it (its ``copy_`` and ``set_`` write into
a storage that already exists). The same constructor serves ``torch.UntypedStorage(n)``,
``storage.clone()``, ``TypedStorage(n)`` and ``UntypedStorage._new_shared(n)`` off the CPU; on the
CPU ``_new_shared`` calls ``_new_using_fd_cpu``/``_new_using_filename_cpu`` instead.

While at least one observer is registered here, ``torch.UntypedStorage.__new__`` and
``_new_shared`` are wrappers that call what they replaced and then tell the observers about the
storage made; the last observer gone, the class gets its own methods back. Storages that C++ wraps
for Python (``tensor.untyped_storage()``) do not pass through ``__new__``, so the hot path of a
tracker is untouched. Like :mod:`memlab.sources.resizes`, the wrappers are set on the class and
run in every thread: each observer decides whether the calling thread is one it measures.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["follow_new_storages", "unseen_storage"]

_lock = threading.Lock()
_observers: list[Callable[[torch.UntypedStorage], None]] = []
_replaced: dict[str, Any] = {}  # name -> what the class's own __dict__ held before (None: nothing)
_installed: dict[str, Any] = {}  # name -> our wrapper, while observers are registered
_inside = threading.local()  # this thread is inside a wrapper: one storage is told once


def follow_new_storages(observer: Callable[[torch.UntypedStorage], None]) -> Callable[[], None]:
    """Call ``observer(storage)`` after every ``torch.UntypedStorage`` made from Python (its
    constructor, hence ``clone()``, ``copy.deepcopy`` of a storage or a tensor, ``TypedStorage(n)``;
    and ``UntypedStorage._new_shared``), in the thread that made it, from now on; return the
    function that stops it (call it once). A constructor that raises tells nobody; an observer
    that raises (a modelled allocator's ``torch.OutOfMemoryError``) reaches the caller. Storages
    made in C++ (``torch.from_numpy``, ``torch.frombuffer``, ``UntypedStorage.from_file``) are not
    seen here.
    """
    with _lock:
        _observers.append(observer)
        if not _installed:
            cls = torch.UntypedStorage
            for name in ("__new__", "_new_shared"):
                _replaced[name] = cls.__dict__.get(name)
            _installed["__new__"] = staticmethod(_wrap_new(cls.__new__))
            _installed["_new_shared"] = classmethod(_wrap_shared(cls._new_shared.__func__))
            for name, wrapper in _installed.items():
                setattr(cls, name, wrapper)

    def stop() -> None:
        with _lock:
            _observers.remove(observer)
            if _observers or not _installed:
                return
            cls = torch.UntypedStorage
            for name, wrapper in _installed.items():
                if cls.__dict__.get(name) is not wrapper:
                    continue  # another tool wrapped ours since: ours stays inside, passing through
                if _replaced[name] is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, _replaced[name])
            _installed.clear()
            _replaced.clear()

    return stop


def unseen_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU ``torch.UntypedStorage`` of ``nbytes`` that no observer is told about: memlab's own
    host bookkeeping (:class:`memlab.Courtesy`'s placeholders), which no tracker counts."""
    before, _inside.active = getattr(_inside, "active", False), True
    try:
        return torch.UntypedStorage(nbytes)
    finally:
        _inside.active = before


def _tell(make: Callable[[], torch.UntypedStorage]) -> torch.UntypedStorage:
    """``make()``, then the observers about what it made (once, however deep the wrappers nest)."""
    if getattr(_inside, "active", False):
        return make()
    _inside.active = True
    try:
        storage = make()
    finally:
        _inside.active = False
    if isinstance(storage, torch.UntypedStorage):
        with _lock:
            observers = list(_observers)
        for observer in observers:
            observer(storage)
    return storage


def _wrap_new(new: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(new)
    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return _tell(lambda: new(cls, *args, **kwargs))

    return __new__


def _wrap_shared(new_shared: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(new_shared)
    def _new_shared(cls: type, *args: Any, **kwargs: Any) -> Any:
        return _tell(lambda: new_shared(cls, *args, **kwargs))

    return _new_shared
