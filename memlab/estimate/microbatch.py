"""``memlab.autobatch``: run a loss over a batch in micro-batches that fit, with exact gradients.

A mean-reduced loss over ``N`` samples equals the sum over micro-batches of each micro-batch's
mean loss times its share ``n_i / N``; calling ``backward()`` on each scaled micro-batch loss
accumulates the same gradients as one backward over the full batch (up to float rounding). Only
the activations of one micro-batch are alive at a time.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from memlab._gpus import GpuLike, resolve_gpu
from memlab._units import format_size
from memlab.estimate.capped import completes_under
from memlab.estimate.copies import named_objects
from memlab.estimate.estimate import _target, run_estimate
from memlab.estimate.fit import budget_in_bytes, default_budget, modelled_gpu, search

__all__ = ["AutoBatched", "autobatch"]


def _batch_layers(modules: list[torch.nn.Module]) -> list[str]:
    """``name (Class)`` of each layer in training mode whose output depends on the whole batch."""
    found: list[str] = []
    for root in modules:
        for name, module in root.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training:
                found.append(f"{name or type(root).__name__} ({type(module).__name__})")
    return found


class AutoBatched:
    """A loss function that :func:`autobatch` wrapped: call it with a full batch.

    ``micro_batch_size``: the micro-batch size of the last call (``None`` before the first).
    ``micro_batch_sizes``: the size chosen per batch signature (sizes, dtypes and devices of
    the batch-shaped tensors), so a batch of a known shape is not estimated again; an
    out-of-memory error halves the size kept for that signature.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        batch_dim: int,
        budget: int | None,
        micro_batch: int | None,
        gpu: GpuLike | None = None,
    ) -> None:
        functools.update_wrapper(self, loss_fn)
        self.gpu = gpu
        self.loss_fn = loss_fn
        self.batch_dim = batch_dim
        self.budget = budget
        self.micro_batch = micro_batch
        self.micro_batch_size: int | None = None
        self.micro_batch_sizes: dict[tuple[Any, ...], int] = {}
        self._warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Compute the loss of the full batch in micro-batches, calling ``backward()`` on each
        (gradients accumulate into ``.grad`` as one full-batch backward would set them); returns
        the full-batch loss, detached."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        size = self._batch_size(leaves)
        if size == 0:  # nothing to split: what the loss function itself does with an empty batch
            loss = self.loss_fn(*args, **kwargs)
            _check_loss(loss, self.loss_fn)
            loss.backward()
            self.micro_batch_size = 0
            return loss.detach()
        batched = [
            isinstance(leaf, torch.Tensor)
            and leaf.dim() > self.batch_dim
            and leaf.shape[self.batch_dim] == size
            for leaf in leaves
        ]
        signature = tuple(
            (tuple(leaf.shape), leaf.dtype, leaf.device)
            for leaf, is_batch in zip(leaves, batched, strict=True)
            if is_batch
        )
        owners = [*named_objects(self.loss_fn), *leaves]
        modules = [obj for obj in owners if isinstance(obj, torch.nn.Module)]
        micro = self.micro_batch_sizes.get(signature)
        if micro is None:
            micro = self.micro_batch or self._fitting_size(leaves, spec, batched, size)
            self.micro_batch_sizes[signature] = micro = min(micro, size)
        if micro < size and not self._warned:
            self._warned = True
            layers = _batch_layers(modules)
            if layers:
                warnings.warn(
                    f"autobatch: {', '.join(layers)} in training mode normalise over the whole batch, so "
                    f"micro-batches of {micro} (of {size}) give different outputs, running statistics and "
                    f"gradients than the full batch",
                    UserWarning,
                    stacklevel=2,
                )
        params = _parameters(owners)
        saved = _save_gradients(params)
        while True:
            try:
                loss = self._run(leaves, spec, batched, size, micro)
            except torch.OutOfMemoryError:
                if micro == 1:
                    raise
                failed = micro
            else:
                self.micro_batch_size = micro
                return loss
            _restore_gradients(params, saved)
            micro = self.micro_batch_sizes[signature] = max(1, failed // 2)
            warnings.warn(
                f"autobatch: out of memory with micro-batches of {failed} (of {size}); gradients restored "
                f"to their state before the step, retrying with micro-batches of {micro}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _batch_size(self, leaves: list[Any]) -> int:
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > self.batch_dim:
                return leaf.shape[self.batch_dim]
        raise TypeError(
            f"autobatch: {getattr(self.loss_fn, '__qualname__', self.loss_fn)!r} was called without a tensor "
            f"argument that has a dimension {self.batch_dim} (batch_dim) to split"
        )

    def _slices(
        self, leaves: list[Any], spec: Any, batched: list[bool], start: int, stop: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dim = self.batch_dim
        sliced = [
            leaf.narrow(dim, start, stop - start) if is_batch else leaf
            for leaf, is_batch in zip(leaves, batched, strict=True)
        ]
        return pytree.tree_unflatten(sliced, spec)

    def _run(self, leaves: list[Any], spec: Any, batched: list[bool], size: int, micro: int) -> torch.Tensor:
        total: torch.Tensor | None = None
        for start in range(0, size, micro):
            stop = min(start + micro, size)
            args, kwargs = self._slices(leaves, spec, batched, start, stop)
            loss = self.loss_fn(*args, **kwargs)
            _check_loss(loss, self.loss_fn)
            share = (stop - start) / size
            (loss * share).backward()
            part = loss.detach() * share
            total = part if total is None else total + part
            del loss, args, kwargs
        assert total is not None
        return total

    def _fitting_size(self, leaves: list[Any], spec: Any, batched: list[bool], size: int) -> int:
        """The largest micro-batch whose estimated forward and backward, two in a row with the
        gradients already accumulated (as the micro-batch loop runs them), do not run out of
        memory in a modelled allocator of the budget's size (1 when none fits): doubling, then
        bisection, over estimates of slices of this batch."""
        device = _target(None, leaves)
        gpu = modelled_gpu(self.gpu)
        budget = self.budget if self.budget is not None else default_budget(device, gpu)

        def fits(micro: int) -> bool:
            def run(capacity: int | None) -> Any:
                return run_estimate(
                    self.loss_fn,
                    lambda: self._slices(leaves, spec, batched, 0, micro),
                    device,
                    with_grads=True,
                    backward=True,
                    steps=2,
                    capacity=capacity,
                    gpu=gpu,
                    stacks=False,  # whether it fits is all that is read: no stack walk per allocation
                )

            return completes_under(run, budget) is not None

        found = search(fits, 1, size)[0]
        if found == 0 and self.budget is not None:
            needs = run_estimate(
                self.loss_fn,
                lambda: self._slices(leaves, spec, batched, 0, 1),
                device,
                with_grads=True,
                backward=True,
                steps=2,
                gpu=gpu,
                stacks=False,
            ).peak_reserved
            raise ValueError(
                f"autobatch: not even a micro-batch of 1 (of {size}) fits in the budget "
                f"({format_size(budget)}): it needs {format_size(needs)} (peak reserved, estimated)"
            )
        return max(found, 1)


def _check_loss(loss: Any, loss_fn: Callable[..., Any]) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(
            f"autobatch: {getattr(loss_fn, '__qualname__', loss_fn)!r} must return a scalar tensor (a "
            f"mean-reduced loss), got {shape}"
        )


def _parameters(owners: list[Any]) -> list[torch.Tensor]:
    params: dict[int, torch.Tensor] = {}
    for obj in owners:
        if isinstance(obj, torch.nn.Module):
            params.update((id(p), p) for p in obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            params.update((id(p), p) for group in obj.param_groups for p in group["params"])
    return list(params.values())


def _save_gradients(params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Host copies of the gradients that exist before the step, to restore after an out-of-memory
    error (made outside any tracker: on a GPU they would live in host memory)."""
    with _disable_current_modes():
        return {id(p): p.grad.detach().to("cpu", copy=True) for p in params if p.grad is not None}


def _restore_gradients(params: list[torch.Tensor], saved: dict[int, torch.Tensor]) -> None:
    with _disable_current_modes(), torch.no_grad():
        for param in params:
            old = saved.get(id(param))
            param.grad = None if old is None else old.to(param.device)


def autobatch(
    loss_fn: Callable[..., Any] | None = None,
    *,
    batch_dim: int = 0,
    budget: int | str | None = None,
    micro_batch: int | None = None,
    gpu: GpuLike | None = None,
) -> Any:
    """Wrap ``loss_fn``, a function that returns a mean-reduced loss of a batch, so that calling
    the wrapper with a full batch computes it in micro-batches that fit.

    Every tensor argument (also inside lists, tuples and dicts) whose size along ``batch_dim``
    equals that of the first tensor argument is split along it; other arguments are passed
    whole. Each micro-batch's loss is scaled by its share ``n_i / N`` and ``backward()`` is
    called on it, so gradients accumulate to those of the full batch (equal up to float
    rounding); the wrapper returns the full-batch loss, detached. Call ``optimizer.step()``
    after it as after a full-batch backward.

    The micro-batch size is ``micro_batch``, or the largest whose estimated forward and backward
    (:func:`memlab.estimate`, data-free; two micro-batches in a row, with the gradients already
    accumulated) run without running out of memory in a modelled allocator of ``budget`` bytes
    (bytes or a size such as ``"8 GiB"``; default: the GPU's free memory plus what this
    process's allocator caches, within its memory fraction, or on CPU the active
    ``TensorTracker``'s capacity: :func:`memlab.estimate.fit.default_budget`), estimated once per
    batch shape. ``gpu``: the GPU modelled, as for ``memlab.estimate`` (its cuBLAS workspaces are
    counted; default: the active ``TensorTracker``'s, as the tracked run allocates them, else the
    GPU in use, else an H100). If ``torch.OutOfMemoryError``
    happens anyway (memory the estimate cannot see, or held outside ``loss_fn``), the gradients
    that existed before the step are restored (from host copies made at the start of the call),
    the micro-batch is halved and the step retried, with a ``RuntimeWarning``; at micro-batches of
    1 the error is raised.

    An empty batch (size 0 along ``batch_dim``) is passed whole, without an estimate: the loss
    and gradients are what ``loss_fn`` gives for it (a mean over nothing is ``nan``).

    Layers whose output depends on the whole batch (BatchNorm in training mode) cannot give the
    full batch's gradients from micro-batches: a ``UserWarning`` names them once. Use as
    ``autobatch(loss_fn)`` or as a decorator, ``@autobatch`` or ``@autobatch(micro_batch=8)``.
    """
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ValueError(f"batch_dim must be an int >= 0, got {batch_dim!r}")
    if micro_batch is not None and (
        isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1
    ):
        raise ValueError(f"micro_batch must be None (choose by estimate) or an int >= 1, got {micro_batch!r}")
    # the check max_batch_size makes: a size, above 0 bytes (the target and GPU are not read)
    limit = None if budget is None else budget_in_bytes(budget, 0, torch.device("cpu"), None)[0]
    if gpu is not None:
        resolve_gpu(gpu)  # a bad name fails here, not at the first call

    def wrap(fn: Callable[..., Any]) -> AutoBatched:
        if not callable(fn):
            raise TypeError(f"autobatch wraps a loss function, got {type(fn).__name__} {fn!r:.80}")
        return AutoBatched(fn, batch_dim, limit, micro_batch, gpu)

    return wrap if loss_fn is None else wrap(loss_fn)
