"""Micro-batches with gradient accumulation for a whole training step (forward, backward,
optimizer step), without rewriting it: :func:`accumulating`.

The step runs once per micro-batch, on equal slices of the batch; the optimizers among its
arguments step once, after the last micro-batch, on the gradients of all of them divided by
their number, which for a loss that is a mean over the batch are the full batch's gradients (up
to float rounding). Their ``zero_grad`` runs where it clears nothing the micro-batches
accumulate: in the first micro-batch before its step (a step that zeroes first), and after the
real step (a step that zeroes last); the learning-rate schedulers among the arguments step once,
in the last micro-batch. What the step does between its backward and its optimizer step
(gradient clipping, a ``GradScaler``'s ``unscale_``) runs in every micro-batch, on the gradients
accumulated so far: keep it out of a step to accumulate, or clip after the last micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memlab._offload import interrupts_held
from memlab._units import check_count

__all__ = ["accumulating", "batch_size", "wrap_step"]

_MISSING = object()


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int = 0) -> int | None:
    """The size along ``batch_dim`` of the first tensor among the arguments (nested in lists,
    tuples and dicts) that has that dimension; ``None`` where none has."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
            return leaf.shape[batch_dim]
    return None


def accumulating(step: Callable[..., Any], micro_batches: int, batch_dim: int = 0) -> Callable[..., Any]:
    """``step`` run as ``micro_batches`` micro-batches with gradient accumulation: calling the result
    with a batch calls ``step`` on each of ``micro_batches`` equal slices along ``batch_dim`` of every
    tensor argument of the batch's size (the other arguments passed whole), with the optimizers among
    the arguments stepping once, on the accumulated gradients divided by ``micro_batches`` (see the
    module docstring); returns the list of ``step``'s results, one per micro-batch.

    Only one micro-batch's activations are alive at a time; the gradients are alive from the first
    micro-batch's backward on. ``ValueError`` where the batch does not split into equal micro-batches;
    ``TypeError`` where no optimizer (``torch.optim.Optimizer``) is among the arguments."""
    micro_batches = check_count(micro_batches, "micro_batches", 1)
    return wrap_step(_accumulate, step, micro_batches, batch_dim)


def wrap_step(runner: Callable[..., Any], step: Callable[..., Any], *options: Any) -> Callable[..., Any]:
    """``step`` run by ``runner(step, *options, *args, **kwargs)`` at each call, with ``step``'s name
    and docstring. A partial, not a closure: an estimate rebinds the names ``step`` uses
    (:mod:`memlab.estimate.copies` follows a partial's function arguments). ``TypeError`` where
    ``step`` is not callable."""
    if not callable(step):
        raise TypeError(f"step must be callable (a training step), got {type(step).__name__} {step!r:.80}")
    wrapped = functools.partial(runner, step, *options)
    functools.update_wrapper(wrapped, step)
    return wrapped


def _accumulate(
    step: Callable[..., Any], micro_batches: int, batch_dim: int, *args: Any, **kwargs: Any
) -> list[Any]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    size = batch_size(args, kwargs, batch_dim)
    if size is None:
        raise ValueError(
            f"accumulating {getattr(step, '__qualname__', step)!r}: no tensor argument has a dimension "
            f"{batch_dim} to split into micro-batches; pass the batch as tensors"
        )
    if size % micro_batches:
        raise ValueError(
            f"a batch of {size} along dimension {batch_dim} does not split into {micro_batches} equal "
            f"micro-batches: pass a batch whose size is a multiple of {micro_batches}"
        )
    optimizers = [leaf for leaf in leaves if isinstance(leaf, torch.optim.Optimizer)]
    if not optimizers:
        raise TypeError(
            f"accumulating {getattr(step, '__qualname__', step)!r}: no optimizer among its arguments; pass "
            "the optimizer the step calls, so that it steps once per batch"
        )
    schedulers = [leaf for leaf in leaves if isinstance(leaf, torch.optim.lr_scheduler.LRScheduler)]
    part = size // micro_batches
    batched = [
        isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and leaf.shape[batch_dim] == size
        for leaf in leaves
    ]
    results = []
    for index in range(micro_batches):
        sliced = [
            leaf.narrow(batch_dim, index * part, part) if is_batch else leaf
            for leaf, is_batch in zip(leaves, batched, strict=True)
        ]
        call_args, call_kwargs = pytree.tree_unflatten(sliced, spec)
        with _deferred(optimizers, schedulers, index == 0, index == micro_batches - 1, micro_batches):
            results.append(step(*call_args, **call_kwargs))
        del sliced, call_args, call_kwargs
    return results


@contextmanager
def _deferred(
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    first: bool,
    last: bool,
    micro_batches: int,
) -> Iterator[None]:
    """While one micro-batch runs: each optimizer's ``step`` a no-op except in the last micro-batch
    (there it divides the gradients by ``micro_batches`` first), its ``zero_grad`` a no-op except in
    the first micro-batch before ``step`` is called and after the real step; each scheduler's
    ``step`` a no-op except in the last. Instance attributes, put back as they were at the end."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, replacement: Callable[..., Any]) -> None:
        patches.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, replacement)

    with interrupts_held():  # all patched or none
        for optimizer in optimizers:
            real_step, real_zero = optimizer.step, optimizer.zero_grad
            called = [False]  # step() was called in this micro-batch

            def step(
                *a: Any, _opt: Any = optimizer, _real: Any = real_step, _called: Any = called, **k: Any
            ) -> Any:
                _called[0] = True
                if not last:
                    return None
                with torch.no_grad():
                    for group in _opt.param_groups:
                        for param in group["params"]:
                            if param.grad is not None:
                                param.grad.div_(micro_batches)
                return _real(*a, **k)

            def zero_grad(*a: Any, _real: Any = real_zero, _called: Any = called, **k: Any) -> Any:
                if (first and not _called[0]) or (last and _called[0]):
                    return _real(*a, **k)
                return None

            # the attributes of what they stand in for: a scheduler's mark that it wrapped ``step``
            patch(optimizer, "step", functools.update_wrapper(step, real_step))
            patch(optimizer, "zero_grad", functools.update_wrapper(zero_grad, real_zero))
        for scheduler in schedulers:
            if not last:
                patch(scheduler, "step", lambda *a, **k: None)
    try:
        yield
    finally:
        with interrupts_held():
            for obj, name, old in reversed(patches):
                if old is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)
