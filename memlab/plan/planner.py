"""``memlab.plan``: the cheapest change that makes a training step fit a budget, searched with
estimates of the user's step on copies of its objects (:func:`plan`), by the search of
:mod:`memlab.plan.search`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memlab._gpus import GpuLike, resolve_gpu
from memlab._units import check_count
from memlab.estimate.copies import named_objects
from memlab.estimate.estimate import _target, run_estimate
from memlab.estimate.fit import budget_in_bytes, modelled_gpu
from memlab.plan.accumulation import batch_size
from memlab.plan.checkpointing import candidate_blocks
from memlab.plan.flops import Cost
from memlab.plan.result import Plan
from memlab.plan.search import (
    DEFAULT_KNOBS,
    Outcome,
    check_knobs,
    checkpointed,
    multi_tensor_skip,
    search_plan,
)
from memlab.plan.settings import Settings, call_context

__all__ = ["plan"]


def plan(
    step: Callable[..., Any],
    *args: Any,
    budget: int | str | None = None,
    gpu: GpuLike | None = None,
    steps: int = 2,
    device: torch.device | str | None = None,
    knobs: Iterable[str] = DEFAULT_KNOBS,
    **kwargs: Any,
) -> Plan:
    """The cheapest change that makes ``step(*args, **kwargs)`` (``steps`` calls in a row: the steady
    state of a training loop) complete within ``budget`` (bytes or a size such as ``"16 GiB"``; default:
    :func:`memlab.estimate.fit.default_budget` for ``cuda``: on a GPU machine what this process's
    allocator can still get, else the modelled GPU's memory less the CUDA context's allowance), on ``gpu``
    (default: the GPU in use, else an H100), with the ``knobs`` (of :data:`~memlab.plan.search.KNOBS`)
    tried in this order, each kept only where it lowers the peak: ``"autocast"`` (bf16 autocast around the
    whole step; not by default: it changes the numbers); ``"foreach"`` (the optimizers step per parameter,
    ``foreach=False``: where any optimizer the step can reach runs multi-tensor kernels); ``"selective"``:
    the fewest blocks to checkpoint selectively (:func:`memlab.plan.checkpointing.keep_matmuls`: no FLOPs
    recomputed), where that fits with every block; then ``"checkpointing"``: the fewest blocks to
    checkpoint of the model among the arguments (the first ``torch.nn.Module``, positional or keyword);
    else, where no checkpointing fits, ``"micro_batches"``: the fewest micro-batches (equal slices of the
    batch along dimension 0, gradients accumulated, one optimizer step), which needs the optimizer among
    the arguments; where neither fits alone, both. Nothing of the user's changes: the search checkpoints
    the model's blocks only while each estimate copies them, and sets ``foreach`` on the copies.

    Returns a :class:`Plan`: whether it fits, what it changes (:attr:`Plan.settings`, the modules to
    checkpoint), why each knob tried was not kept (:attr:`Plan.rejected`), its estimate (exact when
    applied with :meth:`Plan.apply` and :meth:`Plan.step`: peak bytes as the CUDA caching allocator counts
    them), the recomputed FLOPs per step and the roofline seconds of one step on ``gpu``. ``TypeError``
    when no ``torch.nn.Module`` is among the arguments or ``knobs`` is not a collection of names;
    ``ValueError`` for a bad budget, an unknown knob, or a model with no blocks to checkpoint (with
    ``"checkpointing"``).

    What it cannot see: what an estimate cannot see (:func:`memlab.estimate`); sharding and optimizer
    offload are not searched yet; checkpointing and micro-batches are combined only where neither fits
    alone (with the micro-batches that needed the least); the cost is FLOPs and a roofline's time on
    ``gpu`` (:attr:`Plan.extra_time`; not what launches many small kernels costs: micro-batches and
    per-parameter optimizers are slower than it says), which chooses between selective and whole-block
    checkpointing where both fit; the other knobs are tried in their fixed order. Each configuration
    tried costs an estimate of ``steps`` steps."""
    if not callable(step):
        raise TypeError(
            f"step must be callable (the training step to plan), got {type(step).__name__} {step!r:.80}"
        )
    steps = check_count(steps, "steps", 1)
    knobs = check_knobs(knobs)
    model = next((arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.nn.Module)), None)
    if model is None:
        raise TypeError(
            "plan needs the model among the step's arguments (a torch.nn.Module, positional or keyword); "
            "none was given"
        )
    checkpointing = {"selective", "checkpointing"} & set(knobs)
    blocks = candidate_blocks(model) if checkpointing else []
    if checkpointing and not blocks:
        raise ValueError(f"{type(model).__name__} has no submodule with parameters to checkpoint")
    limit, _ = budget_in_bytes(budget, 0, torch.device("cuda"), modelled_gpu(gpu))

    modules = [module for _, module in blocks]
    modelled = resolve_gpu(gpu)
    target = _target("cuda" if device is None and gpu is not None else device, (step, args, kwargs))

    def run(count: int, settings: Settings) -> Outcome:
        counted: list[Cost] = []
        with checkpointed(modules[:count], settings.selective):  # a capped run estimates it again, so
            found = run_estimate(
                settings.step(step, target.type),
                lambda: (args, kwargs),
                target,
                steps=steps,
                gpu=modelled,
                call_context=call_context(settings, counted, modelled),
            )
            return found, counted[-1], found.under(limit)

    skip = multi_tensor_skip(_optimizers(step, args, kwargs), target)
    if not any(isinstance(leaf, torch.optim.Optimizer) for leaf in pytree.tree_leaves((args, kwargs))):
        skip["micro_batches"] = "no optimizer among the step's arguments (it must step once per batch)"
    found = search_plan(
        run,
        blocks,
        limit,
        knobs=knobs,
        skip=skip,
        batch=batch_size(args, kwargs),
        gpu=modelled,
    )
    found.device_type = target.type
    return found


def _optimizers(step: Callable[..., Any], args: Any, kwargs: Any) -> list[torch.optim.Optimizer]:
    """The optimizers among the step's arguments and the names it uses (globals, closures)."""
    leaves = pytree.tree_leaves((args, kwargs, named_objects(step)))
    return [leaf for leaf in leaves if isinstance(leaf, torch.optim.Optimizer)]
