"""The tracker an estimate runs under: it hands each op copies of the user's tensors the call reaches
(:mod:`memlab.estimate.outside`: no dispatch mode of their own), remembers the first op fake
tensors could not run (which forces a real CPU run, named in the estimate), counts the storages
real kernels allocate where they differ from the meta kernels' (:mod:`memlab.estimate.sizes`), and
keeps an estimate's out-of-memory errors from the OOM observers."""

from __future__ import annotations

import contextlib
import linecache
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)

from memlab.estimate.modes import UnwrappedDispatch
from memlab.estimate.outside import OutsideCopies
from memlab.estimate.sizes import RealSizes
from memlab.history.recorder import _no_stack, capture_stack
from memlab.sources.tracker import TensorTracker

__all__ = ["DATA_DEPENDENT", "EstimateTracker"]

# What fake tensors cannot do: each forces a real CPU run, named in the estimate.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_OP_NAMES = {
    "_local_scalar_dense": "a tensor's value read in Python (.item(), bool(), int(), float(), if tensor:)",
    "nonzero": "nonzero (torch.nonzero, torch.where(mask), indexing with a boolean mask)",
    "index": "indexing with a boolean mask",
    "masked_select": "masked_select (indexing with a boolean mask)",
}


class EstimateTracker(UnwrappedDispatch, TensorTracker):
    """A tracker that remembers the first op fake tensors could not run, and where, and (given
    ``kernels``, whose kernels a fake run mimics) counts the storages real kernels allocate where
    they differ from the meta kernels' (:mod:`memlab.estimate.sizes`)."""

    forced_by: str | None = None
    estimated: str | None = None  # how the estimate ran, for the line that says where numbers come from

    def __init__(self, *, kernels: str | None = None, stacks: bool = True, **options: Any) -> None:
        self.stacks = stacks  # before the tracker makes its first allocator
        super().__init__(**options)
        self.real_sizes = RealSizes(kernels) if kernels is not None else None

    def _new_allocator(self) -> Any:
        allocator = super()._new_allocator()
        if not self.stacks and allocator.history is not None:
            allocator.history.stack = _no_stack  # categories and peaks only: no stack walk per allocation
        return allocator

    @contextlib.contextmanager
    def copying(self, copies: OutsideCopies) -> Iterator[None]:
        """While entered (in the calling thread): every op this tracker sees gets ``copies``'s
        copies of the user's tensors (:meth:`OutsideCopies.arguments`) before anything else, as
        if ``copies`` were a dispatch mode entered above the tracker; on exit ``copies`` sets back
        the version counters of the tensors it copied."""
        here = self._here
        with copies:
            here.copies = copies
            try:
                yield
            finally:
                here.copies = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        copies = getattr(self._here, "copies", None)
        if copies is not None:
            args, kwargs = copies.arguments(func, args, kwargs)
        try:
            if self.real_sizes is None:
                return super().__torch_dispatch__(func, types, args, kwargs)
            run = super().__torch_dispatch__
            return self.real_sizes.run(func, args, lambda: run(func, types, args, kwargs))
        except DATA_DEPENDENT:
            if self.forced_by is None:
                self.forced_by = _describe_op(func)
            raise

    @property
    def size_caveats(self) -> list[str]:
        """What the run hit whose real size is not known without data (one sentence each)."""
        return list(self.real_sizes.caveats) if self.real_sizes is not None else []

    def _out_of_memory(
        self, storage: torch.UntypedStorage, nbytes: int, error: torch.OutOfMemoryError
    ) -> None:
        """An estimate that runs out of its capacity answers a question (does it fit?); it is not
        the user's out-of-memory error, so the OOM observers (``explain_oom``) are not told."""


def _describe_op(func: Any) -> str:
    name = func.overloadpacket.__name__
    what = _OP_NAMES.get(name, f"aten.{name} (its output depends on tensor values)")
    stack = capture_stack()
    if not stack:
        return what
    filename, line, _ = stack[0]
    code = linecache.getline(filename, line).strip()
    return f"{what} at {filename}:{line}" + (f": {code}" if code else "")
