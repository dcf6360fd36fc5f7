"""Storage resizes reach the trackers: ``UntypedStorage.resize_`` bypasses PyTorch's dispatcher.

FSDP2 frees a gathered parameter with ``untyped_storage().resize_(0)`` and brings it back with
``resize_(nbytes)`` (FSDP1 through ``TypedStorage._resize_``, which calls the same method). That
method is C++ (``THPStorage_resize_`` in ``torch/csrc/StorageMethods.cpp``) that goes straight to
``at::native::resize_bytes_cuda`` (or ``resize_bytes_nocuda`` on other devices) without an aten op,
so no ``TorchDispatchMode`` ever sees it. The one place Python can see it is the method itself:
while at least one observer is registered here, ``torch.UntypedStorage.resize_`` is a wrapper that
calls the method it replaced and then tells the observers; the last observer gone, the class gets
its own method back. PyTorch's ``MemTracker`` wraps the same method the same way, but takes the
method to call when it is made and puts it back when it exits: made while a tracker is active, or
entered before the tracker, it stacks with ours; made before and entered inside, it calls PyTorch's
method directly and our observers see nothing. The wrapper is set on the class, where every
storage's method is looked up (the storages to watch are not known in advance), so it runs in
every thread: each observer decides whether the calling thread is one it measures.

What the allocator does on such a resize (``resize_bytes_cuda``): to 0 bytes, it frees the block;
to any other size (smaller, larger, or the same) it allocates a new block, copies, then frees the
old one, so both are held for a moment. Ops that resize a tensor in place (``resize_``, ``out=``
arguments) only ever grow a storage, through the same function, and they do go through the
dispatcher: :func:`resizable_arguments` names the arguments whose storages they may grow.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["follow_resizes", "resizable_arguments", "sizes_before"]

_lock = threading.Lock()
_observers: list[Callable[[torch.UntypedStorage], None]] = []
_installed: Any = None  # the wrapper on torch.UntypedStorage, while observers are registered
_replaced: Any = None  # what the class's own __dict__ held under "resize_" before (None: nothing)
_inside = threading.local()  # this thread is inside a wrapper: one resize is told once


def follow_resizes(observer: Callable[[torch.UntypedStorage], None]) -> Callable[[], None]:
    """Call ``observer(storage)`` after every ``torch.UntypedStorage.resize_`` that succeeds, in the
    thread that called it, from now on; return the function that stops it (call it once).

    ``storage.nbytes()`` is then the new size. A resize that raises tells nobody. An observer that
    raises stops the resize's other observers and reaches the caller (a modelled allocator's
    ``torch.OutOfMemoryError`` must). Resizes made by C++ code without this Python method (the
    ``inductor::resize_storage_bytes_`` op, which the dispatcher shows) are not seen here.
    """
    global _installed, _replaced
    with _lock:
        _observers.append(observer)
        if _installed is None:
            _replaced = torch.UntypedStorage.__dict__.get("resize_")
            _installed = _wrap(torch.UntypedStorage.resize_)
            torch.UntypedStorage.resize_ = _installed  # type: ignore[method-assign]

    def stop() -> None:
        global _installed, _replaced
        with _lock:
            _observers.remove(observer)
            if _observers or _installed is None:
                return
            # Another tool may have wrapped ours since (and will put ours back when it leaves): ours
            # then stays inside its wrapper, passing every call through while nobody observes.
            if torch.UntypedStorage.__dict__.get("resize_") is _installed:
                if _replaced is None:
                    del torch.UntypedStorage.resize_
                else:
                    torch.UntypedStorage.resize_ = _replaced  # type: ignore[method-assign]
            _installed = _replaced = None

    return stop


def _wrap(resize: Callable[[torch.UntypedStorage, int], Any]) -> Callable[[torch.UntypedStorage, int], Any]:
    @functools.wraps(resize)
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        if getattr(_inside, "active", False):
            # A wrapper of ours reached again through another tool's wrapper (put over an earlier
            # one of ours): the outermost call tells the observers, once.
            return resize(storage, size)
        _inside.active = True
        try:
            result = resize(storage, size)
        finally:
            _inside.active = False
        with _lock:
            observers = list(_observers)
        for observer in observers:
            observer(storage)
        return result

    return resize_


def resizable_arguments(func: Any) -> tuple[int | str, ...]:
    """The arguments of the aten op ``func`` whose storages the op may grow, as positions (in
    ``args``) and names (in ``kwargs``, where ``__torch_dispatch__`` receives keyword-only
    arguments): the ``out=`` arguments of every op, and the tensors written by the ``resize``
    family (``resize_``, ``resize_as_``, ``_resize_output_``, …). Empty for the others."""
    schema = func._schema
    resizes = "resize" in schema.name
    found: list[int | str] = []
    for position, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        if argument.kwarg_only:
            found.append(argument.name)
        elif resizes:
            found.append(position)
    return tuple(found)


def sizes_before(
    arguments: tuple[int | str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    collect: Callable[[Any, list[torch.UntypedStorage]], None],
) -> dict[int, int]:
    """``{id(storage): nbytes}`` of the storages that ``arguments`` (see
    :func:`resizable_arguments`) hold now, before the op runs; ``collect(obj, into)`` appends the
    storages of a tensor or of lists of them."""
    storages: list[torch.UntypedStorage] = []
    for argument in arguments:
        if isinstance(argument, int):
            value = args[argument] if argument < len(args) else None
        else:
            value = kwargs.get(argument) if kwargs else None
        collect(value, storages)
    return {id(storage): storage.nbytes() for storage in storages}
