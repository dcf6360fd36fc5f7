"""The step settings a plan can change besides checkpointing: bf16 autocast around the whole step
(:func:`autocasting`), optimizers that step one parameter at a time (:func:`per_parameter`), and
micro-batches (:func:`memlab.plan.accumulation.accumulating`), together as :class:`Settings`.

One :class:`Settings` object makes the step both for the planner's estimates and for the user
(:meth:`memlab.plan.Plan.step`), so the step that is estimated is the step that runs.

- **bf16 autocast** (``torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward,
  the backward and the optimizer step): matmuls, convolutions and attention run in bf16 and save
  bf16 activations; parameters, gradients and optimizer state stay fp32, and a bf16 copy of each
  weight is cached while the step runs. It changes the numbers the step computes (bf16 keeps 8
  bits of mantissa), which is why :func:`memlab.plan` tries it only when asked. bf16 needs no
  ``GradScaler``; fp16 (which does) is not offered.
- **Optimizers stepping per parameter** (``foreach=False`` in every parameter group): PyTorch's
  default on a GPU (``foreach``) updates all parameters with a few multi-tensor kernels, whose
  intermediate results are as large as all the parameters together; per parameter they are the
  size of the largest one. The update is the same up to float rounding; it launches more kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from memlab._gpus import GPU
from memlab.plan.accumulation import accumulating, wrap_step
from memlab.plan.flops import Cost, counting

__all__ = ["AS_IT_IS", "Settings", "autocasting", "call_context", "per_parameter", "restore"]

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a step is run: ``autocast`` (bf16 autocast around the whole step), ``per_parameter``
    (the optimizers' ``foreach`` off), ``micro_batches`` (each batch split into that many equal
    micro-batches, gradients accumulated), ``selective`` (the blocks a plan checkpoints are
    checkpointed selectively: :func:`memlab.plan.checkpointing.keep_matmuls`)."""

    autocast: bool = False
    per_parameter: bool = False
    micro_batches: int = 1
    selective: bool = False

    def step(self, step: Callable[..., Any], device_type: str) -> Callable[..., Any]:
        """``step`` as these settings run it (autocast on ``device_type``, micro-batches); the
        optimizers' ``foreach`` is set where they live (:func:`per_parameter`), not by the step."""
        if self.autocast:
            step = autocasting(step, device_type)
        if self.micro_batches > 1:
            step = accumulating(step, self.micro_batches)
        return step

    @property
    def changes(self) -> list[str]:
        """What these settings change besides micro-batches, one phrase each."""
        return [
            *(["bf16 autocast"] if self.autocast else []),
            *(["optimizers step per parameter (foreach=False)"] if self.per_parameter else []),
        ]


AS_IT_IS = Settings()
"""The step as it is: no autocast, the optimizers as they are, one batch at a time."""


def autocasting(
    step: Callable[..., Any], device_type: str, dtype: torch.dtype = torch.bfloat16
) -> Callable[..., Any]:
    """``step`` with every call run under ``torch.autocast(device_type, dtype=dtype)`` (``"cuda"``
    for a GPU)."""
    return wrap_step(_autocast, step, device_type, dtype)


def _autocast(
    step: Callable[..., Any], device_type: str, dtype: torch.dtype, *args: Any, **kwargs: Any
) -> Any:
    with torch.autocast(device_type, dtype=dtype):
        return step(*args, **kwargs)


def per_parameter(optimizers: Iterable[torch.optim.Optimizer]) -> list[tuple[dict[str, Any], Any]]:
    """Set ``foreach=False`` in every parameter group of ``optimizers`` (each steps one parameter at a
    time from its next ``step``); returns what was there, for :func:`restore`."""
    saved = [
        (group, group.get("foreach", _MISSING))
        for optimizer in optimizers
        for group in optimizer.param_groups
    ]
    for group, _ in saved:
        group["foreach"] = False
    return saved


def restore(saved: list[tuple[dict[str, Any], Any]]) -> None:
    """Put back the parameter groups' ``foreach`` that :func:`per_parameter` returned."""
    for group, value in reversed(saved):
        if value is _MISSING:
            group.pop("foreach", None)
        else:
            group["foreach"] = value


def call_context(
    settings: Settings, costs: list[Cost], gpu: GPU | None = None
) -> Callable[[Any, int], AbstractContextManager[None]]:
    """The ``call_context`` of an estimate of a step with ``settings``
    (:func:`memlab.estimate.estimate.run_estimate`): each call's :class:`~memlab.plan.flops.Cost` (FLOPs,
    roofline seconds on ``gpu``) appended to ``costs`` (:func:`memlab.plan.flops.counting`) and, for
    per-parameter optimizers, the copied optimizers' ``foreach`` off while it runs (the user's optimizers
    are not touched)."""
    counted = counting(costs, gpu)

    @contextmanager
    def context(copier: Any, index: int) -> Iterator[None]:
        saved = per_parameter(copier.optimizers) if settings.per_parameter else []
        try:
            with counted(copier, index):
                yield
        finally:
            restore(saved)

    return context
