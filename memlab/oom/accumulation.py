"""Gradient accumulation as an estimate runs it: the calls of a step as the micro-batches of an
optimizer step, each a view of its rows of the batch, as ``x.split(micro)`` gives a user.

:class:`Accumulation` makes the copied optimizers step once per ``per_step`` calls.
:class:`MicroBatches` adds the rows: the first micro-batch, the middle ones, and the last, which
holds what is left of the batch (fewer rows when the micro-batch does not divide it: other block
sizes, so another fragmentation). The middle micro-batches are estimated until the allocator comes
out of one exactly as it came out of the one before (then every later one repeats it, the program
and the allocator's rules being deterministic), at most :data:`MIDDLE_ESTIMATED`; where that bound
is reached first, the estimate is not a proof (:attr:`MicroBatches.unproven`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["MIDDLE_ESTIMATED", "Accumulation", "MicroBatches"]

#: Middle micro-batches estimated per optimizer step at most, waiting for the allocator to repeat.
MIDDLE_ESTIMATED = 8


class Accumulation:
    """The calls of an estimated step as the micro-batches of gradient accumulation, ``per_step``
    calls to an optimizer step (a ``call_context`` of :func:`memlab.estimate.estimate.run_estimate`).

    In each call the copied optimizers' ``step()`` runs only if it is the last micro-batch of its
    optimizer step, and ``zero_grad()`` (of the copied optimizers and modules) only while no
    skipped ``step()`` is pending: gradients then accumulate across the micro-batches whether the
    step zeroes them first or last, as in the loop a user writes (backward per micro-batch, one
    ``optimizer.step()`` and ``zero_grad()`` per batch). Only the copies are changed, for the call.
    """

    def __init__(self, per_step: int) -> None:
        self.per_step = per_step
        self._skipped = False  # a step() skipped since the last one that ran

    @contextlib.contextmanager
    def __call__(self, copier: Any, index: int) -> Iterator[None]:
        if index == 0:
            self._skipped = False
        last = index % self.per_step == self.per_step - 1
        patches = [(optimizer, "step", self._step(optimizer.step, last)) for optimizer in copier.optimizers]
        patches += [(owner, "zero_grad", self._zero_grad(owner.zero_grad)) for owner in copier.optimizers]
        patches += [(module, "zero_grad", self._zero_grad(module.zero_grad)) for module in copier.modules]
        saved = [(owner, name, vars(owner).get(name, self)) for owner, name, _ in patches]
        for owner, name, method in patches:
            setattr(owner, name, method)
        try:
            yield
        finally:
            for owner, name, before in saved:
                if before is self:
                    delattr(owner, name)
                else:
                    setattr(owner, name, before)

    def _step(self, step: Callable[..., Any], last: bool) -> Callable[..., Any]:
        def accumulating_step(*args: Any, **kwargs: Any) -> Any:
            if not last:
                self._skipped = True
                return None
            self._skipped = False
            return step(*args, **kwargs)

        return accumulating_step

    def _zero_grad(self, zero_grad: Callable[..., Any]) -> Callable[..., Any]:
        def accumulating_zero_grad(*args: Any, **kwargs: Any) -> Any:
            return None if self._skipped else zero_grad(*args, **kwargs)

        return accumulating_zero_grad


class MicroBatches(Accumulation):
    """A batch of ``size`` rows (dimension ``dim``) in micro-batches of ``micro`` rows, one
    optimizer step per batch, each micro-batch's loss divided by their number before its
    ``backward()``: the calls an estimate runs per optimizer step are the first
    micro-batch, up to :data:`MIDDLE_ESTIMATED` middle ones (skipped once the allocator repeats
    itself, see the module's docstring) and the last, of the rows left. :meth:`step` is the
    watched step called on the rows of the current micro-batch; :meth:`starter` wraps the
    estimate's ``start`` to see its tracker."""

    def __init__(self, size: int, micro: int, dim: int) -> None:
        self.size, self.micro, self.dim = size, micro, dim
        self.count = math.ceil(size / micro)  # micro-batches per optimizer step
        middles = max(self.count - 2, 0)
        super().__init__(min(self.count, 2 + min(middles, MIDDLE_ESTIMATED)))
        self.unproven = False  # a middle micro-batch was left out without the allocator repeating
        self._tracker: Any = None
        self._position = 0
        self._layouts: list[Any] = []  # the allocator after each middle micro-batch of this step
        self._repeating = False

    def rows(self) -> tuple[int, int]:
        """``(first row, rows)`` of the current call's micro-batch."""
        if self._position == self.per_step - 1 and self.count > 1:
            start = (self.count - 1) * self.micro
            return start, self.size - start
        return self._position * self.micro, self.micro

    @contextlib.contextmanager
    def __call__(self, copier: Any, index: int) -> Iterator[None]:
        self._position = index % self.per_step
        if self._position == 0:
            self._layouts, self._repeating = [], False
        with super().__call__(copier, index), self._scaled_loss():
            yield
        if 0 < self._position < self.per_step - 1 and not self._repeating:
            layout = self._layout()
            self._repeating = bool(self._layouts) and layout == self._layouts[-1]
            self._layouts.append(layout)
        left_out = self.count - 2 > len(self._layouts) and not self._repeating
        if self._position == self.per_step - 2 and left_out:
            self.unproven = True

    @contextlib.contextmanager
    def _scaled_loss(self) -> Iterator[None]:
        """While active, ``loss.backward()`` of a scalar loss runs ``(loss / count).backward()``, as
        the loop of gradient accumulation a user writes scales each micro-batch's loss."""
        backward = torch.Tensor.backward
        count = self.count

        def scaled_backward(self: torch.Tensor, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
            if gradient is None and self.dim() == 0 and count > 1:
                return backward(self / count, None, *args, **kwargs)
            return backward(self, gradient, *args, **kwargs)

        torch.Tensor.backward = scaled_backward  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.Tensor.backward = backward  # type: ignore[method-assign]

    def skipping(self) -> bool:
        """Whether the current call is a middle micro-batch that repeats the one before."""
        return 0 < self._position < self.per_step - 1 and self._repeating

    def _layout(self) -> Any:
        """The segments and blocks (addresses, sizes, states) of the tracker's allocators."""
        allocators = getattr(self._tracker, "_allocators", {})
        return [
            (str(device), [_segment(s) for s in allocator.snapshot()])
            for device, allocator in sorted(allocators.items(), key=lambda item: str(item[0]))
        ]

    def starter(self, start: Callable[[Any, Any], None] | None) -> Callable[[Any, Any], None]:
        """``start`` (of :func:`~memlab.estimate.estimate.run_estimate`, or none) that also keeps the
        estimate's tracker, whose allocator the middle micro-batches compare."""

        def starting(tracker: Any, copier: Any) -> None:
            self._tracker = tracker
            if start is not None:
                start(tracker, copier)

        return starting

    def step(
        self, func: Callable[..., Any], batched: list[bool], count: int, names: list[str]
    ) -> Callable[..., Any]:
        """``func`` called with the batch tensors among its arguments (``batched``; the first
        ``count`` positional, then keyword arguments ``names``) cut to the current micro-batch's
        rows (views), or not called for a middle micro-batch that repeats the one before."""

        def micro_step(*values: Any) -> Any:
            if self.skipping():
                return None
            start, rows = self.rows()
            cut = [_cut(v, self.dim, start, rows) if b else v for v, b in zip(values, batched, strict=True)]
            return func(*cut[:count], **dict(zip(names, cut[count:], strict=True)))

        return micro_step


def _segment(segment: dict[str, Any]) -> tuple[Any, ...]:
    blocks = tuple((b["address"], b["size"], b["state"]) for b in segment["blocks"])
    return segment["address"], segment["total_size"], blocks


def _cut(tensor: torch.Tensor, dim: int, start: int, rows: int) -> torch.Tensor:
    return tensor.narrow(dim, start, rows)  # a view of the batch's copy, as the user's split gives
