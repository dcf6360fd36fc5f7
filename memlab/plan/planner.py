"""``memlab.plan``: the least activation checkpointing, else the fewest micro-batches, that makes a
training step fit a budget.

The plan is searched with estimates (:func:`memlab.estimate`: data-free, exact for what a tracker
counts) and its fit decided as every fit check in memlab decides it: does the step complete under a
CUDA caching allocator capped at the budget, retry path included
(:func:`memlab.estimate.capped.completes_under`). So a plan that fits, applied to the model, fits
when run: its estimate is the plan's, byte for byte.

The knob searched is activation checkpointing of whole blocks (:func:`~memlab.plan.checkpointing.
candidate_blocks`: a transformer's layers), the first ``k`` of them, for the least ``k`` that fits
(:func:`_search`). The step as it is is estimated once; its blocks' saved activations
(``by_module``) say where to try first; each further try is where the peaks measured, taken as a
straight line, reach the budget (blocks of a stack free about as much each), and a count whose
peak of requested bytes that line puts above the budget is taken as not fitting without a try.
So a plan usually costs two or three estimates, and its ``k`` is the least as those lines tell
it (equal to a search that tries every count in ``benchmarks/bench_plan.py --exhaustive``). It
assumes that checkpointing one more block never needs more memory (its activations are freed in
the forward and recomputed late in the backward, when less is held). The last block is the
exception: its recompute runs first in the backward, while everything else is still held, and can
need more than its saved activations (a 6-layer ``TransformerEncoder``: 196 MiB reserved with 5
checkpointed, 208 MiB with all 6), so "all blocks" is tried only when all but the last do not
fit. Whatever the assumptions, a plan that fits is the estimate of exactly that configuration
under the budget.

Where no count of checkpointed blocks fits, the batch is split into micro-batches
(:func:`memlab.plan.accumulation.accumulating`), none checkpointed: 2, then each larger count that
divides the batch, while the peak falls, unless the parameters and optimizer state alone are over
the budget (no micro-batch can go below them). Checkpointing comes first because its cost is
counted (recomputed FLOPs); a micro-batch's cost is not in FLOPs (smaller kernels, every weight
read once per micro-batch) and changes the training loop.

Each checkpointed block runs its forward again in the backward pass (up to the last tensor the
backward needs: PyTorch's non-reentrant checkpoint stops there): the plan's extra compute is the
recomputed FLOPs of one step, counted in the estimates the search runs anyway
(:class:`memlab.plan.flops.FlopCount`: PyTorch's FLOP formulas for matmuls, convolutions and
attention, the ops its ``FlopCounterMode`` counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memlab._gpus import GpuLike, resolve_gpu
from memlab._offload import interrupts_held
from memlab._units import check_count, format_size
from memlab.estimate.estimate import Estimate, _target, run_estimate
from memlab.estimate.fit import budget_in_bytes, modelled_gpu
from memlab.history import categories
from memlab.plan.accumulation import accumulating, batch_size
from memlab.plan.checkpointing import candidate_blocks, checkpoint, is_layer, uncheckpoint
from memlab.plan.flops import counting
from memlab.plan.result import Plan

__all__ = ["plan", "search_plan"]


def plan(
    step: Callable[..., Any],
    *args: Any,
    budget: int | str | None = None,
    gpu: GpuLike | None = None,
    steps: int = 2,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> Plan:
    """The cheapest change that makes ``step(*args, **kwargs)`` (``steps`` calls in a row: the steady
    state of a training loop) complete within ``budget`` (bytes or a size such as ``"16 GiB"``;
    default: :func:`memlab.estimate.fit.default_budget` for ``cuda``: on a GPU machine what this
    process's allocator can still get, else the modelled GPU's memory less the CUDA context's
    allowance), on ``gpu`` (default: the GPU in use, else an H100): none; else the fewest blocks to
    checkpoint of the model among the arguments (the first ``torch.nn.Module``, positional or
    keyword); else, where no checkpointing fits, the fewest micro-batches (equal slices of the batch
    along dimension 0, gradients accumulated, one optimizer step: :meth:`Plan.step`), which needs
    the optimizer among the arguments. Nothing of the user's changes: the search checkpoints the
    model's blocks only while each estimate copies them.

    Returns a :class:`Plan`: whether it fits, which modules to checkpoint or how many
    micro-batches, its estimate (exact when applied: peak bytes as the CUDA caching allocator counts
    them), the recomputed FLOPs per step. ``TypeError`` when no ``torch.nn.Module`` is among the
    arguments; ``ValueError`` for a bad budget or a model with no blocks to checkpoint.

    What it cannot see: what an estimate cannot see (:func:`memlab.estimate`); the other knobs
    (autocast, sharding, optimizer offload) are not searched yet; checkpointing and micro-batches
    are not combined; the cost is in FLOPs, not time (micro-batches add none, but run smaller
    kernels and read every weight once per micro-batch). Each configuration tried costs an estimate
    of ``steps`` steps (of every micro-batch, for micro-batches).
    """
    if not callable(step):
        raise TypeError(
            f"step must be callable (the training step to plan), got {type(step).__name__} {step!r:.80}"
        )
    steps = check_count(steps, "steps", 1)
    model = next((arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.nn.Module)), None)
    if model is None:
        raise TypeError(
            "plan needs the model among the step's arguments (a torch.nn.Module, positional or keyword); "
            "none was given"
        )
    blocks = candidate_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no submodule with parameters to checkpoint")
    limit, _ = budget_in_bytes(budget, 0, torch.device("cuda"), modelled_gpu(gpu))

    modules = [module for _, module in blocks]

    modelled = resolve_gpu(gpu)
    target = _target("cuda" if device is None and gpu is not None else device, (step, args, kwargs))

    def run(count: int, micro_batches: int = 1) -> tuple[Estimate, int, Estimate | None]:
        counted: list[int] = []
        with _checkpointed(modules[:count]):  # a capped run estimates the step again, as checkpointed
            found = run_estimate(
                accumulating(step, micro_batches) if micro_batches > 1 else step,
                lambda: (args, kwargs),
                target,
                steps=steps,
                gpu=modelled,
                call_context=counting(counted),
            )
            return found, counted[-1], found.under(limit)

    found = search_plan(run, [name for name, _ in blocks], limit, layers=is_layer(blocks[0][1]))
    if not found.fits:
        _split(found, lambda micro_batches: run(0, micro_batches), args, kwargs)
    return found


def _split(
    found: Plan, run: Callable[[int], tuple[Estimate, int, Estimate | None]], args: Any, kwargs: Any
) -> None:
    """Micro-batches for a plan that checkpointing cannot make fit: the least count that divides the
    batch into equal micro-batches and fits, with no block checkpointed, tried in increasing order
    while the peak falls (``found`` changed in place; where none fits, it keeps the configuration
    that needs the least). Not tried where the parameters and optimizer state alone (alive through
    every step, whatever its micro-batches) are over the budget."""
    size = batch_size(args, kwargs)
    held = found.baseline.by_category("end")
    floor = held[categories.PARAMETER] + held[categories.OPTIMIZER_STATE]
    if not any(isinstance(leaf, torch.optim.Optimizer) for leaf in pytree.tree_leaves((args, kwargs))):
        found.why_not_micro_batches = "no optimizer among the step's arguments (it must step once per batch)"
    elif size is None or size < 2:
        found.why_not_micro_batches = f"a batch of {size} along dimension 0 cannot be split"
    elif floor > found.budget:
        found.why_not_micro_batches = (
            f"the parameters and optimizer state alone take {format_size(floor)}, over the budget"
        )
    if found.why_not_micro_batches:
        return
    previous = found.baseline.peak_reserved
    for micro_batches in (count for count in range(2, size + 1) if size % count == 0):
        unbounded, _, within = run(micro_batches)
        found.micro_batch_tries.append((micro_batches, within is not None, unbounded.peak_reserved))
        if within is not None or unbounded.peak_reserved < found.estimate.peak_reserved:
            found.micro_batches, found.checkpointed, found.recomputed_flops = micro_batches, [], 0
            found.estimate = within or unbounded
        if within is not None:
            found.fits = True
            return
        if unbounded.peak_reserved >= previous:
            return  # smaller micro-batches no longer lower the peak
        previous = unbounded.peak_reserved


def search_plan(
    run: Callable[[int], tuple[Estimate, int, Estimate | None]], names: list[str], limit: int, layers: bool
) -> Plan:
    """The :class:`Plan` of the least count of first blocks (``names``, in order) checkpointed whose
    step fits ``limit`` bytes, searched as the module docstring says. ``run(count)`` estimates the
    step with the first ``count`` blocks checkpointed: its unbounded estimate, the FLOPs of its last
    step, and its estimate under a CUDA caching allocator capped at ``limit`` (``None`` where it runs
    out of memory there). ``layers``: the blocks are Hugging Face layers (see :attr:`Plan.code`)."""
    unbounded: dict[int, Estimate] = {}  # by blocks checkpointed, in the order tried
    fitted: dict[int, Estimate] = {}  # those that complete within the budget, capped at it
    flops: dict[int, int] = {}  # one step's FLOPs (the last step's) by blocks checkpointed

    def fits(count: int) -> bool:
        unbounded[count], flops[count], within = run(count)
        if within is not None:
            fitted[count] = within
        return within is not None

    most = max(len(names) - 1, 1)  # the last block is tried alone at the end (see the module docstring)
    chosen = _search(fits, unbounded, _savings(unbounded, names), most, limit) if not fits(0) else 0
    if chosen is None and most < len(names) and fits(len(names)):
        chosen = len(names)
    least = min(unbounded, key=lambda count: (unbounded[count].peak_reserved, count))
    return Plan(
        fits=chosen is not None,
        budget=limit,
        blocks=names,
        checkpointed=names[: least if chosen is None else chosen],
        estimate=fitted[chosen] if chosen is not None else unbounded[least],
        baseline=unbounded[0],
        recomputed_flops=flops[chosen] - flops[0] if chosen else 0,
        baseline_flops=flops[0] if chosen else 0,
        tried=[(count, count in fitted, found.peak_reserved) for count, found in unbounded.items()],
        layers=layers,
    )


def _savings(unbounded: dict[int, Estimate], names: list[str]) -> list[int]:
    """Per block, the bytes its ops saved for backward in the step as it is (``by_module``'s
    ``activation``, summed over the block and what it contains): about what checkpointing it frees
    at the peak. Zeros where the estimate's module paths are not the blocks' (another model first)
    or it recorded no module."""
    saved = dict.fromkeys(names, 0)
    if unbounded[0].modules is None:
        return [0] * len(names)
    table = unbounded[0].by_module()["activation"]
    for path, value in table.items():
        block = next((name for name in names if path == name or path.startswith(name + ".")), None)
        if block is not None:
            saved[block] += int(value)
    return [saved[name] for name in names]


def _search(
    fits: Callable[[int], bool], unbounded: dict[int, Estimate], savings: list[int], most: int, limit: int
) -> int | None:
    """The least count of first blocks in ``1..most`` checkpointed whose step fits, as the peaks
    tell it. First try: where the step as it is, less the blocks' saved activations, is within
    ``limit``. Until one fits: where the peak reserved bytes, as a straight line through 0 and the
    most that does not fit, reach ``limit``. Then, between the most that does not fit and the least
    that does: where their peaks of requested bytes (what the tensors ask for at once: the same
    under any allocator, and more than the budget means out of memory), as a line, reach ``limit``;
    a count that line puts above ``limit`` is taken as not fitting without a try (the retry path of
    a capped allocator can fit a step whose unbounded reserved peak is above the budget, never one
    whose requested peak is). ``None`` when ``most`` does not fit."""
    peak = unbounded[0].peak_reserved
    guess, freed = most, 0
    for count, saved in enumerate(savings[:most], 1):
        freed += saved
        if peak - freed <= limit:
            guess = count
            break
    low, high = 0, None  # the most that does not fit, the least that does
    while True:
        if fits(guess):
            high = guess
        else:
            low = guess
        if high is None:
            if low >= most:
                return None
            guess = _crossing(0, low, peak, unbounded[low].peak_reserved, limit, most)
        else:
            if high - low == 1:
                return high
            guess = _crossing(low, high, _requested(unbounded[low]), _requested(unbounded[high]), limit, most)
            if guess >= high:
                return high
        guess = max(guess, low + 1)


def _requested(found: Estimate) -> int:
    return found.stats["requested_bytes.all.peak"]


def _crossing(low: int, high: int, low_peak: int, high_peak: int, limit: int, most: int) -> int:
    """The least count, up to ``most``, where the peaks, taken as a straight line through
    ``(low, low_peak)`` and ``(high, high_peak)``, are within ``limit`` (``most`` where the line
    does not fall)."""
    if low_peak <= high_peak:
        return most
    count = low + -(-(low_peak - limit) * (high - low) // (low_peak - high_peak))  # rounded up
    return min(count, most)


@contextmanager
def _checkpointed(modules: list[torch.nn.Module]) -> Iterator[None]:
    """``modules`` checkpointed while the block runs (an estimate copies them so), then as before,
    also on an error or Ctrl-C."""
    with interrupts_held():
        checkpoint(modules)
    try:
        yield
    finally:
        with interrupts_held():
            uncheckpoint(modules)
