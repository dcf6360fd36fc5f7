"""The tracker an estimate runs under: it hands each op copies of the user's tensors the call reaches
(:mod:`memlab.estimate.outside`: no dispatch mode of their own), remembers the first op fake
tensors could not run (which forces a real CPU run, named in the estimate), counts the storages
real kernels allocate where they differ from the meta kernels' (:mod:`memlab.estimate.sizes`), and
keeps an estimate's out-of-memory errors from the OOM observers."""

from __future__ import annotations

import contextlib
import inspect
import linecache
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

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


#: ``TensorTracker.__torch_dispatch__`` without the ``torch._disable_dynamo`` wrapper PyTorch puts
#: on it (see :class:`~memlab.estimate.modes.UnwrappedDispatch`, why an estimate needs none).
_tracker_dispatch = inspect.unwrap(TensorTracker.__torch_dispatch__)


class EstimateTracker(UnwrappedDispatch, TensorTracker):
    """A tracker that remembers the first op fake tensors could not run, and where, and (given
    ``kernels``, whose kernels a fake run mimics) counts the storages real kernels allocate where
    they differ from the meta kernels' (:mod:`memlab.estimate.sizes`).

    Given ``values`` (the run's :class:`~memlab.estimate.values.HostValues`, a dispatch mode), the
    tracker, entered right above it, takes it off the dispatch mode stack and calls its handler
    itself for every op (:attr:`host_values`; it goes back on the stack when the tracker exits):
    the ops reach the same handlers in the same order, through one Python dispatch mode fewer
    (~3 us per op, ``benchmarks/bench_floor.py``). So in every thread whose stack PyTorch copied
    from the entering thread's (autograd's device threads); not in threads started while the
    tracker is active, whose stack it enters without HostValues below it (:meth:`_enter_new_thread`).
    An op a size correction answers (:meth:`RealSizes.corrects`) runs with HostValues back on the
    stack, below the correction's mode, as before."""

    forced_by: str | None = None
    estimated: str | None = None  # how the estimate ran, for the line that says where numbers come from

    def __init__(
        self, *, kernels: str | None = None, stacks: bool = True, values: Any = None, **options: Any
    ) -> None:
        self.stacks = stacks  # before the tracker makes its first allocator
        super().__init__(**options)
        self.real_sizes = RealSizes(kernels) if kernels is not None else None
        #: The :class:`~memlab.estimate.values.HostValues` whose handler the tracker calls (or ``None``).
        self.host_values = values
        self._values_off: Any = None  # host_values, while the tracker has it off the stack
        self._copies: OutsideCopies | None = None  # while copying()

    def __enter__(self) -> EstimateTracker:
        values = self.host_values
        stack = _get_current_dispatch_mode_stack()
        take = values is not None and self._values_off is None and bool(stack) and stack[-1] is values
        if take:
            _pop_mode()
        try:
            super().__enter__()
        except BaseException:
            if take:
                _push_mode(values)
            raise
        if take:
            self._values_off = values
            self._below = self._values_below
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            values = self._values_off
            if values is not None and not self._here.entered:
                self._values_off = self._below = None
                if not self._left_behind:  # taken off the stack: the mode below it is on top again
                    _push_mode(values)

    def _enter_new_thread(self) -> None:
        super()._enter_new_thread()
        self._here.bypass = True  # no HostValues below the tracker here, no user's tensors swapped

    def _values_below(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """The op run by the handler of :attr:`host_values` (off the stack); in a thread started while
        the tracker is active, or under a size correction, the op itself."""
        values = self._values_off
        if values is None or getattr(self._here, "bypass", False):
            return func(*args, **(kwargs or {}))
        return values.__torch_dispatch__(func, types, args, kwargs)

    def _corrected(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """``func`` answered by its size correction, with :attr:`host_values` back on the stack below
        the correction's mode (the ops the correction runs reach it as they did before)."""
        run = self.real_sizes.run  # type: ignore[union-attr]
        here, values = self._here, self._values_off
        if values is None or getattr(here, "bypass", False):
            return run(func, args, lambda: _tracker_dispatch(self, func, types, args, kwargs))
        _push_mode(values)
        here.bypass = True
        try:
            return run(func, args, lambda: _tracker_dispatch(self, func, types, args, kwargs))
        finally:
            here.bypass = False
            _pop_mode()

    def _new_allocator(self) -> Any:
        allocator = super()._new_allocator()
        if not self.stacks and allocator.history is not None:
            allocator.history.stack = _no_stack  # categories and peaks only: no stack walk per allocation
        return allocator

    @contextlib.contextmanager
    def copying(self, copies: OutsideCopies) -> Iterator[None]:
        """While entered: every op this tracker sees gets ``copies``'s copies of the user's tensors
        (:meth:`OutsideCopies.arguments`) before anything else, as if ``copies`` were a dispatch
        mode entered above the tracker (in the threads whose stack PyTorch copies from the calling
        thread's, not in those started meanwhile); on exit ``copies`` sets back the version
        counters of the tensors it copied."""
        with copies:
            self._copies = copies
            try:
                yield
            finally:
                self._copies = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        copies = self._copies
        if copies is not None and not getattr(self._here, "bypass", False):
            args, kwargs = copies.arguments(func, args, kwargs)
        try:
            sizes = self.real_sizes
            if sizes is None:
                return _tracker_dispatch(self, func, types, args, kwargs)
            if sizes.corrects(func, args):
                return self._corrected(func, types, args, kwargs)
            return sizes.checked(func, args, _tracker_dispatch(self, func, types, args, kwargs))
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
