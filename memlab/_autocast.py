"""Who is told when a ``torch.autocast`` region is entered or left, and what it asked for.

PyTorch without CUDA turns ``torch.autocast("cuda")`` off when the object is made
(``torch/amp/autocast_mode.py``: ``autocast.__init__`` sets ``_enabled = False`` after warning "CUDA
is not available"), so the object no longer says whether ``enabled=True`` was asked. While at least
one :class:`AutocastWatch` is registered (:func:`watch`), ``autocast.__init__``, ``__enter__`` and
``__exit__`` are wrapped: each new object's requested ``enabled`` is recorded, and every watch is told
of each entry and exit, after PyTorch's own code ran. :class:`DisabledCudaRegions` is the watch a
tracker of a real CPU run keeps, to say that such regions ran without autocast.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AutocastWatch", "DisabledCudaRegions", "requested", "unwatch", "watch"]

# PyTorch's warning when it disables a CUDA autocast region for lack of CUDA (autocast.__init__), a
# regular expression matched at the message's start: torch 2.9 and later, then torch 2.8's wording.
_NO_CUDA_WARNING = (
    r"CUDA is not available or torch_xla is imported\. Disabling autocast\."
    r"|User provided device_type of 'cuda', but CUDA is not available\. Disabling"
)


class AutocastWatch:
    """Told of every ``torch.autocast`` region entered or left while registered (in any thread),
    after PyTorch's ``__enter__`` / ``__exit__`` ran. Watches are told newest first, so an inner
    context (``CudaKernels`` inside a tracker) can change the state before an outer one reads it.
    ``quiet_cuda``: while registered, PyTorch's "CUDA is not available ... Disabling autocast."
    warning is not shown (the watch models the region instead)."""

    quiet_cuda = False

    def entered(self, region: Any, asked: bool | None) -> None:
        """``region`` (a ``torch.autocast``) was entered; ``asked``: the ``enabled`` it was made
        with, ``None`` when it was made before any watch was registered."""

    def exited(self, region: Any) -> None:
        """``region`` was left."""


_watches: list[AutocastWatch] = []
_lock = threading.Lock()
_requested: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_originals: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None


def requested(region: Any) -> bool | None:
    """The ``enabled`` ``region`` (a ``torch.autocast``) was made with, when it was made while a
    watch was registered; else ``None``."""
    return _requested.get(region)


def watch(observer: AutocastWatch) -> None:
    """Tell ``observer`` of autocast regions until :func:`unwatch`."""
    global _originals
    with _lock:
        _watches.append(observer)
        if _originals is not None:
            return
        cls = torch.amp.autocast_mode.autocast
        _originals = (cls.__init__, cls.__enter__, cls.__exit__)
        init, enter, leave = _originals

        def __init__(
            self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None
        ) -> None:
            with warnings.catch_warnings():
                if device_type == "cuda" and any(w.quiet_cuda for w in list(_watches)):
                    warnings.filterwarnings("ignore", message=_NO_CUDA_WARNING)
                init(self, device_type, dtype, enabled, cache_enabled)
            _requested[self] = bool(enabled)

        def __enter__(self: Any) -> Any:
            result = enter(self)
            asked = _requested.get(self)
            for observer in reversed(list(_watches)):
                observer.entered(self, asked)
            return result

        def __exit__(self: Any, *exc_info: Any) -> Any:
            result = leave(self, *exc_info)
            for observer in reversed(list(_watches)):
                observer.exited(self)
            return result

        cls.__init__, cls.__enter__, cls.__exit__ = __init__, __enter__, __exit__  # type: ignore[method-assign]


def unwatch(observer: AutocastWatch) -> None:
    """Stop telling ``observer``; the last one gone, ``torch.autocast`` is PyTorch's own again."""
    global _originals
    with _lock:
        _watches.remove(observer)
        if _watches or _originals is None:
            return
        cls = torch.amp.autocast_mode.autocast
        cls.__init__, cls.__enter__, cls.__exit__ = _originals  # type: ignore[method-assign]
        _originals = None


class DisabledCudaRegions(AutocastWatch):
    """The ``torch.autocast("cuda")`` regions that ran disabled because this PyTorch has no CUDA
    (not those made with ``enabled=False``, nor those another watch turned on), in the threads
    ``counts()`` says are measured: their dtypes, in the order first entered."""

    def __init__(self, counts: Callable[[], bool]) -> None:
        self._counts = counts
        #: The ``dtype`` of each such region, without repeats, in the order first entered.
        self.dtypes: list[torch.dtype] = []

    def entered(self, region: Any, asked: bool | None) -> None:
        if region.device != "cuda" or asked is False or torch.cuda.is_available():
            return
        if torch.is_autocast_enabled("cuda") or not self._counts():
            return
        if region.fast_dtype not in self.dtypes:
            self.dtypes.append(region.fast_dtype)

    def describe(self) -> str | None:
        """What the line that says where numbers come from adds, or ``None`` when nothing ran so."""
        if not self.dtypes:
            return None
        names = " and ".join(f"torch.autocast('cuda', {dtype})" for dtype in self.dtypes)
        return (
            f"{names} ran disabled, in float32 for float32 inputs (PyTorch without CUDA disables it; on a "
            "GPU CUDA's autocast op lists apply: smaller activations, cast copies of the weights)"
        )
