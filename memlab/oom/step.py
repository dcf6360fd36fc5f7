"""Remedies that estimate the failing step under a change (a smaller batch with accumulation,
autocast, activation checkpointing) with :mod:`memlab.estimate`, without running it on the device.

The step is the watched call (a profiled function, or a function given to ``explain_oom``) with the
arguments of the call that failed. Estimates run it again on data-free copies of its tensors,
modules and optimizers (the user's objects are not touched), so other side effects of the step
(appending to a list, counting) happen again.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memlab.oom.capture import Call, OOMCapture
from memlab.oom.report import Remedy

__all__ = ["STEP_REMEDIES", "find_batch", "repeated_blocks"]


def find_batch(call: Call) -> tuple[int, int] | None:
    """``(batch size, batch dimension)`` of a call's arguments: the size most tensors among them
    share in dimension ``batch_dim`` (default 0); ``None`` without such a tensor. Tensors inside
    modules and optimizers are not arguments of the batch."""
    dim = 0 if call.batch_dim is None else call.batch_dim
    leaves = pytree.tree_leaves((call.args, call.kwargs))
    sizes = Counter(
        leaf.shape[dim]
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, torch.nn.Parameter) and leaf.dim() > dim
    )
    if not sizes:
        return None
    return sizes.most_common(1)[0][0], dim


def _batch_maker(
    call: Call, size: int, dim: int
) -> tuple[Callable[..., Any], Callable[[int], tuple[Any, ...]]]:
    """``(step, make_batch)`` for :func:`memlab.max_batch_size`: ``make_batch(b)`` gives the call's
    positional arguments with each batch tensor cut to its first ``b`` rows (a copy, so a
    micro-batch holds only its own rows); keyword arguments follow them, passed back by name."""
    names = list(call.kwargs)
    values = (*call.args, *call.kwargs.values())
    batched = [isinstance(v, torch.Tensor) and v.dim() > dim and v.shape[dim] == size for v in values]
    func = call.func

    def make_batch(b: int) -> tuple[Any, ...]:
        return tuple(_cut(v, dim, b) if is_batch else v for v, is_batch in zip(values, batched, strict=True))

    if not names:
        return func, make_batch
    count = len(call.args)

    def step(*args: Any) -> Any:
        return func(*args[:count], **dict(zip(names, args[count:], strict=True)))

    return step, make_batch


def _cut(tensor: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    return tensor.narrow(dim, 0, rows).clone()


def micro_batch_remedy(capture: OOMCapture) -> Remedy | None:
    """The largest micro-batch whose estimated step fits in the capacity
    (:func:`memlab.max_batch_size` up to the batch the call had) and the accumulation steps that
    keep the batch; ``None`` without a batch, or when the estimate of the whole batch fits (the
    memory the step lacked is held outside its arguments: see the held-across-calls remedy)."""
    from memlab.estimate import max_batch_size

    call = capture.call
    found = None if call is None or capture.capacity <= 0 else find_batch(call)
    if found is None:
        return None
    size, dim = found
    step, make_batch = _batch_maker(call, size, dim)  # type: ignore[arg-type]
    fit = max_batch_size(step, make_batch, budget=capture.capacity, high=size, device=_device(capture))
    if fit.batch_size >= size:
        return None
    if fit.batch_size == 0:
        assert fit.next_estimate is not None
        return Remedy(
            "micro_batch",
            f"micro-batches of 1 (of {size}), {size} accumulation steps",
            fit.next_estimate.peak_reserved,
            capture.capacity,
            {"micro_batch": 1, "batch": size, "accumulation_steps": size, "largest_fitting": 0},
        )
    assert fit.estimate is not None
    steps = math.ceil(size / fit.batch_size)
    return Remedy(
        "micro_batch",
        f"micro-batches of {fit.batch_size} (of {size}), {steps} accumulation steps",
        fit.estimate.peak_reserved,
        capture.capacity,
        {
            "micro_batch": fit.batch_size,
            "batch": size,
            "accumulation_steps": steps,
            "largest_fitting": fit.batch_size,
        },
    )


def _device(capture: OOMCapture) -> torch.device:
    return torch.device(capture.device)


def _estimate_step(capture: OOMCapture, context: contextlib.AbstractContextManager[Any]) -> int:
    from memlab.estimate import estimate

    call = capture.call
    assert call is not None
    with context:
        return estimate(call.func, *call.args, device=_device(capture), **call.kwargs).peak_reserved


def _autocast_remedy(capture: OOMCapture, dtype: torch.dtype, kind: str) -> Remedy | None:
    device_type = torch.device(capture.device).type
    if capture.call is None or capture.capacity <= 0 or device_type not in ("cpu", "cuda"):
        return None
    peak = _estimate_step(capture, torch.autocast(device_type, dtype=dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype_name]
    return Remedy(
        kind, f'torch.autocast("{device_type}", torch.{dtype_name}) ({short})', peak, capture.capacity
    )


def bf16_autocast_remedy(capture: OOMCapture) -> Remedy | None:
    """The step estimated under ``torch.autocast(<device type>, torch.bfloat16)``."""
    return _autocast_remedy(capture, torch.bfloat16, "autocast_bf16")


def fp16_autocast_remedy(capture: OOMCapture) -> Remedy | None:
    """The step estimated under ``torch.autocast("cuda", torch.float16)``: on CUDA devices only,
    for GPUs without bfloat16 (on CPU the bf16 remedy is the one listed)."""
    if torch.device(capture.device).type != "cuda":
        return None
    return _autocast_remedy(capture, torch.float16, "autocast_fp16")


def repeated_blocks(model: torch.nn.Module) -> tuple[type[torch.nn.Module], int] | None:
    """The class of the model's repeated blocks and how many there are: among siblings of one
    class under one parent (two or more, holding parameters), the group with the most parameter
    elements; ``None`` when no module repeats."""
    best: tuple[int, type[torch.nn.Module], int] | None = None
    for parent in model.modules():
        groups: dict[type[torch.nn.Module], list[torch.nn.Module]] = {}
        for child in parent.children():
            groups.setdefault(type(child), []).append(child)
        for cls, members in groups.items():
            elements = sum(p.numel() for m in members for p in m.parameters())
            if len(members) >= 2 and elements and (best is None or elements > best[0]):
                best = (elements, cls, len(members))
    return None if best is None else (best[1], best[2])


@contextlib.contextmanager
def checkpointed(cls: type[torch.nn.Module]) -> Iterator[None]:
    """While active, every ``cls`` module runs its forward under non-reentrant
    ``torch.utils.checkpoint`` (saving only its inputs; recomputing in backward)."""
    from torch.utils.checkpoint import checkpoint

    own = cls.__dict__.get("forward")
    original = cls.forward

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, self, *args, use_reentrant=False, **kwargs)

    cls.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del cls.forward
        else:
            cls.forward = own  # type: ignore[method-assign]


def checkpointing_remedy(capture: OOMCapture) -> Remedy | None:
    """The step estimated with activation checkpointing of the repeated blocks of the first module
    among its arguments (:func:`repeated_blocks`); ``None`` without such a module."""
    call = capture.call
    if call is None or capture.capacity <= 0:
        return None
    model = next((a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.nn.Module)), None)
    found = None if model is None else repeated_blocks(model)
    if found is None:
        return None
    cls, count = found
    peak = _estimate_step(capture, checkpointed(cls))
    return Remedy(
        "checkpointing",
        f"activation checkpointing of the {count} {cls.__name__} blocks",
        peak,
        capture.capacity,
        {"block": cls.__name__, "blocks": count},
    )


#: The step remedies, in the order they are listed.
STEP_REMEDIES: tuple[Callable[[OOMCapture], Remedy | None], ...] = (
    micro_batch_remedy,
    bf16_autocast_remedy,
    fp16_autocast_remedy,
    checkpointing_remedy,
)
