"""``copy.deepcopy`` of a fake tensor inside an estimate: the allocations of a real deep copy.

A step may deep-copy tensors (an EMA model made with ``copy.deepcopy(model)``, torchmetrics'
state defaults when Lightning's ``self.log`` makes its first metric). PyTorch's
``Tensor.__deepcopy__`` cannot do that for a fake tensor: it deep-copies the tensor's ``__dict__``,
which holds the ``FakeTensorMode`` itself (and its converter's memo of real tensors), so the copy
belongs to another mode and the estimate's next op meets real tensors; a fake constant (the real
CPU value of ``torch.tensor(0.0)``) fails to copy its storage (``Attempted to set the storage of a
tensor on device "meta"``). While :func:`fake_deepcopy` is entered, a fake tensor's deep copy does
what the real one allocates, through the fake mode, so the estimate's tracker counts it as a
tracked real run does: a new storage of the source's whole storage (a view copies all of it; views
of one storage deep-copied together share one copy), then the 0-dim ``new_empty([])`` that
``set_`` points at that storage (a block held for a moment), as a detached strided view of the
copy, with its ``requires_grad``, its gradient's copy and its Python attributes; a ``Parameter``
as ``Parameter.__deepcopy__`` does (a clone of its own elements, no gradient). A constant is
cloned, so its value stays readable (a view of a constant then copies only its own elements).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["fake_deepcopy"]

_lock = threading.Lock()
_entered = 0  # entries of fake_deepcopy not yet exited (estimates may run inside estimates)
_saved: Any = None  # what FakeTensor's own __dict__ held under "__deepcopy__" (None: nothing)


@contextlib.contextmanager
def fake_deepcopy() -> Iterator[None]:
    """While entered (in any thread), ``copy.deepcopy`` of a :class:`FakeTensor` makes a fake copy
    that allocates what the real copy would (see the module docstring). Call it where the fake
    mode is active: the copy's ops run through the mode on top of the dispatch stack."""
    global _entered, _saved
    with _lock:
        if _entered == 0:
            _saved = FakeTensor.__dict__.get("__deepcopy__")
            FakeTensor.__deepcopy__ = _deepcopy  # type: ignore[method-assign]
        _entered += 1
    try:
        yield
    finally:
        with _lock:
            _entered -= 1
            if _entered == 0:
                if _saved is None:
                    del FakeTensor.__deepcopy__
                else:
                    FakeTensor.__deepcopy__ = _saved  # type: ignore[method-assign]
                _saved = None


def _deepcopy(self: FakeTensor, memo: dict[Any, Any]) -> torch.Tensor:
    found = memo.get(id(self))
    if found is not None:
        return found
    if not self.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol "
            "at the moment (PyTorch's Tensor.__deepcopy__; the estimate's fake copy follows it)"
        )
    if isinstance(self, torch.nn.Parameter):  # Parameter.__deepcopy__: a clone of its own elements
        with torch.no_grad():
            new = torch.nn.Parameter(self.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = new
        return new
    with torch.no_grad():
        if self.constant is not None or self.layout is not torch.strided or self.is_quantized:
            new = self.clone()
            if self.layout is torch.strided:
                moment = self.new_empty([])  # the real copy's 0-dim block that set_ frees
                del moment
        else:
            storage = self.untyped_storage()
            key = ("memlab.fake_storage", id(storage))
            base = memo.get(key)
            if base is None:
                base = self.new_empty((storage.nbytes() // self.element_size(),))
                memo[key] = base
                memo.setdefault("memlab.fake_sources", []).append(storage)  # its id stays its own
            moment = self.new_empty([])  # the real copy's 0-dim block that set_ frees
            del moment
            # Not set_: FakeTensorMode's dispatch cache keeps the storage set_ is given alive
            # (its cache key holds it), so the copy would never be freed.
            new = base.as_strided(self.size(), self.stride(), self.storage_offset()).detach()
    if self.requires_grad:
        new.requires_grad_()
    if self.grad is not None:
        new.grad = copy.deepcopy(self.grad, memo)
    for name, value in self.__dict__.items():
        # the user's attributes, not the fake tensor's own nor the estimate's (a known value,
        # memlab.estimate.known: the copy's value is not known, reading it is as for any other)
        if name not in new.__dict__ and not name.startswith("_memlab_"):
            new.__dict__[name] = copy.deepcopy(value, memo)
    memo[id(self)] = new
    return new
