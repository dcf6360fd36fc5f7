"""The search :func:`memlab.plan` and its trainer and command-line forms make: the cheapest
configuration of a training step that fits a budget (:func:`search_plan`), over any way of
estimating the step (``run(count, settings)``).

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

Before whole blocks, blocks checkpointed selectively (:func:`memlab.plan.checkpointing.
keep_matmuls`: the outputs of matmuls, convolutions and attention kept, the ops between them run
again: no FLOPs recomputed) are searched the same way, where checkpointing every block so fits.

Where no count of checkpointed blocks fits, the batch is split into micro-batches
(:func:`memlab.plan.accumulation.accumulating`), none checkpointed: 2, then each larger count that
divides the batch, while the peak falls, unless the parameters and optimizer state alone are over
the budget (no micro-batch can go below them). Where none fits either, the fewest blocks are
searched again with the count of micro-batches that needed the least. Checkpointing comes first
because its cost is counted (recomputed FLOPs); a micro-batch's cost is not in FLOPs (smaller
kernels, every weight read once per micro-batch) and changes the training loop.

Each checkpointed block runs its forward again in the backward pass (up to the last tensor the
backward needs: PyTorch's non-reentrant checkpoint stops there): the plan's extra compute is the
recomputed FLOPs of one step, counted in the estimates the search runs anyway
(:class:`memlab.plan.flops.FlopCount`: PyTorch's FLOP formulas for matmuls, convolutions and
attention, the ops its ``FlopCounterMode`` counts), and its time on the modelled GPU by a roofline
of each op (:mod:`memlab.plan.flops` says what a roofline cannot see). Where blocks checkpointed
selectively and whole blocks both fit, the roofline's time chooses between them (:func:`_faster`);
the other knobs are tried in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from memlab._gpus import GPU
from memlab._offload import interrupts_held
from memlab._units import format_size
from memlab.estimate.estimate import Estimate
from memlab.history import categories
from memlab.plan.checkpointing import checkpoint, is_layer, uncheckpoint
from memlab.plan.flops import Cost
from memlab.plan.result import Plan
from memlab.plan.settings import AS_IT_IS, Settings

__all__ = [
    "DEFAULT_KNOBS",
    "KNOBS",
    "Outcome",
    "check_knobs",
    "checkpointed",
    "multi_tensor_skip",
    "search_plan",
]

Outcome = tuple[Estimate, Cost, "Estimate | None"]
"""What a run of the step estimates: its unbounded estimate, the :class:`~memlab.plan.flops.Cost`
(FLOPs, roofline seconds) of its last step, its estimate under the budget (``None`` where it runs
out of memory there)."""


KNOBS = ("autocast", "foreach", "selective", "checkpointing", "micro_batches")
"""What :func:`plan` can change, cheapest first: bf16 autocast (less memory and less time, other
numbers: tried only when asked for), the optimizers' ``foreach`` off (no extra FLOPs, more kernel
launches), checkpointing blocks selectively (the matmuls' and attention's outputs kept: no extra
FLOPs, memory-bound ops run again), checkpointing whole blocks (recomputed FLOPs), micro-batches
(smaller kernels, a changed loop)."""

DEFAULT_KNOBS = ("foreach", "selective", "checkpointing", "micro_batches")
"""The knobs a plan tries unless told otherwise: all but autocast, which changes the numbers."""


def check_knobs(knobs: Iterable[str]) -> tuple[str, ...]:
    """``knobs`` as a tuple, each one of :data:`KNOBS`: ``TypeError`` for a string or a non-collection,
    ``ValueError`` naming the first unknown knob and the valid ones."""
    if isinstance(knobs, str) or not isinstance(knobs, Iterable):
        raise TypeError(
            "knobs must be a collection of knob names such as ('checkpointing',), got "
            f"{type(knobs).__name__} {knobs!r:.80}"
        )
    knobs = tuple(knobs)
    unknown = [knob for knob in knobs if knob not in KNOBS]
    if unknown:
        raise ValueError(f"unknown knob {unknown[0]!r}: the knobs are {', '.join(map(repr, KNOBS))}")
    return knobs


def _free_knobs(
    run: Callable[[int, Settings], Outcome], knobs: tuple[str, ...], rejected: dict[str, str]
) -> Settings:
    """The settings that add no FLOPs (autocast, per-parameter optimizers) among ``knobs``, each tried
    on top of those kept before it and kept where it lowers the peak reserved bytes, until one fits;
    the reason for each not kept goes into ``rejected``."""
    settings = AS_IT_IS
    for knob, field in (("autocast", "autocast"), ("foreach", "per_parameter")):
        if knob not in knobs or knob in rejected:
            continue
        trial = replace(settings, **{field: True})
        before, (unbounded, _, within) = run(0, settings)[0], run(0, trial)
        if within is None and unbounded.peak_reserved >= before.peak_reserved:
            rejected[knob] = (
                f"the peak is no lower with {trial.changes[-1]}: {format_size(unbounded.peak_reserved)} "
                f"reserved, {format_size(before.peak_reserved)} without"
            )
            continue
        settings = trial
        if within is not None:
            break
    return settings


def multi_tensor_skip(optimizers: list[torch.optim.Optimizer], target: torch.device) -> dict[str, str]:
    """``{"foreach": why}`` where no parameter group of ``optimizers`` steps with multi-tensor kernels
    on ``target`` (so turning ``foreach`` off cannot lower anything), else ``{}``: the ``skip`` of
    :func:`search_plan`. PyTorch's default (``foreach=None``, not fused) is multi-tensor where every
    parameter is on a GPU (``torch.optim.optimizer._default_to_fused_or_foreach``)."""

    def multi_tensor(group: dict[str, Any]) -> bool:
        if group.get("fused") or group.get("foreach") is False:
            return False
        return group.get("foreach") is True or target.type != "cpu"

    if any(multi_tensor(group) for optimizer in optimizers for group in optimizer.param_groups):
        return {}
    if not optimizers:
        return {"foreach": "no optimizer among the step's arguments or the names it uses"}
    return {
        "foreach": "no optimizer the step can reach runs multi-tensor kernels (foreach off or fused, or "
        f"PyTorch's default on {target.type})"
    }


def _split(found: Plan, run: Callable[[int], Outcome], batch: int | None) -> None:
    """Micro-batches for a plan that checkpointing cannot make fit: the least count that divides the
    batch (``batch`` long) into equal micro-batches and fits, with no block checkpointed, tried in
    increasing order while the peak falls (``found`` changed in place; where none fits, it keeps the
    configuration that needs the least). ``run(micro_batches)`` estimates the step so. Not tried
    where the parameters and optimizer state alone (alive through every step, whatever its
    micro-batches) are over the budget."""
    held = found.baseline.by_category("end")
    floor = held[categories.PARAMETER] + held[categories.OPTIMIZER_STATE]
    if batch is None or batch < 2:
        found.rejected["micro_batches"] = f"a batch of {batch} along dimension 0 cannot be split"
        return
    if floor > found.budget:
        found.rejected["micro_batches"] = (
            f"the parameters and optimizer state alone take {format_size(floor)}, over the budget"
        )
        return
    previous = run(1)[0].peak_reserved
    for micro_batches in (count for count in range(2, batch + 1) if batch % count == 0):
        unbounded, _, within = run(micro_batches)
        found.micro_batch_tries.append((micro_batches, within is not None, unbounded.peak_reserved))
        if within is not None or unbounded.peak_reserved < found.estimate.peak_reserved:
            found.settings = replace(found.settings, micro_batches=micro_batches)
            found.checkpointed, found.recomputed_flops = [], 0
            found.estimate = within or unbounded
        if within is not None:
            found.fits = True
            return
        if unbounded.peak_reserved >= previous:
            return  # smaller micro-batches no longer lower the peak
        previous = unbounded.peak_reserved


def search_plan(
    run: Callable[[int, Settings], Outcome],
    blocks: list[tuple[str, torch.nn.Module]],
    limit: int,
    *,
    knobs: Iterable[str] = ("checkpointing",),
    skip: dict[str, str] | None = None,
    batch: int | None = None,
    gpu: GPU | None = None,
) -> Plan:
    """The cheapest :class:`Plan` within ``limit`` bytes with ``knobs`` (:data:`KNOBS`), searched
    as the module docstring says: the settings that add no FLOPs, then the least count of first
    ``blocks`` (:func:`~memlab.plan.checkpointing.candidate_blocks`: names and modules, in order)
    checkpointed, then micro-batches of a batch of ``batch``.
    ``run(count, settings)`` estimates the step with the first ``count`` blocks checkpointed and
    those :class:`~memlab.plan.settings.Settings`: its unbounded estimate, the FLOPs of its last
    step, and its estimate under a CUDA caching allocator capped at ``limit`` (``None`` where it
    runs out of memory there); each configuration is run once. ``skip``: the knobs not to try, with
    why; ``gpu``: the GPU whose roofline ``run`` counts (its name is the plan's)."""
    knobs = check_knobs(knobs)
    names = [name for name, _ in blocks]
    layers = bool(blocks) and is_layer(blocks[0][1])  # Hugging Face layers: see Plan.code
    results: dict[tuple[int, Settings], Outcome] = {}

    def once(count: int, settings: Settings) -> Outcome:
        if count == 0 and settings.selective:  # nothing checkpointed: selective or not, the same run
            settings = replace(settings, selective=False)
        if (count, settings) not in results:
            results[count, settings] = run(count, settings)
        return results[count, settings]

    skip = {knob: why for knob, why in (skip or {}).items() if knob in knobs}
    rejected: dict[str, str] = {}  # the knobs the search needed and did not keep
    settings = AS_IT_IS
    if once(0, settings)[2] is None:
        rejected.update((knob, why) for knob, why in skip.items() if knob in ("autocast", "foreach"))
        settings = _free_knobs(once, knobs, rejected)
    if "selective" in knobs and names and once(0, settings)[2] is None:
        selective = replace(settings, selective=True)
        unbounded, _, within = once(len(names), selective)
        if within is not None:
            settings = selective
        else:
            needs = format_size(unbounded.peak_reserved)
            rejected["selective"] = (
                f"with every block checkpointed selectively the step needs {needs} reserved"
            )
    savings = None  # selectively: the blocks free equal shares of what all of them free
    if settings.selective:
        freed = once(0, settings)[0].peak_reserved - once(len(names), settings)[0].peak_reserved
        savings = [max(freed, 0) // len(names)] * len(names)
    found = _checkpointing(
        lambda count: once(count, settings),
        names if "checkpointing" in knobs or settings.selective else [],
        limit,
        layers,
        savings,
    )
    if settings.selective and "checkpointing" in knobs and once(0, AS_IT_IS)[1].seconds is not None:
        found, settings = _faster(found, settings, once, names, limit, layers, rejected)
    found.baseline, found.settings, found.rejected = once(0, AS_IT_IS)[0], settings, rejected
    found.setting_tries = [
        (tried, within is not None, unbounded.peak_reserved)
        for (count, tried), (unbounded, _, within) in results.items()
        if count == 0 and tried != AS_IT_IS
    ]
    if not found.fits and "micro_batches" in knobs:
        if "micro_batches" in skip:
            rejected["micro_batches"] = skip["micro_batches"]
        else:
            _split(
                found, lambda micro_batches: once(0, replace(settings, micro_batches=micro_batches)), batch
            )
    if not found.fits and found.micro_batch_tries and "checkpointing" in knobs and names:
        _combine(found, once, names, limit, layers)
    found.seconds = once(len(found.checkpointed), found.settings)[1].seconds
    found.baseline_seconds = once(0, AS_IT_IS)[1].seconds
    found.gpu = None if gpu is None else gpu.name
    found.estimated = len(results)
    return found


def _combine(
    found: Plan, run: Callable[[int, Settings], Outcome], names: list[str], limit: int, layers: bool
) -> None:
    """Where neither checkpointing nor micro-batches fit alone: the least count of blocks checkpointed
    with the count of micro-batches tried that needs the least (``found`` changed in place where it
    fits or needs less than ``found``'s configuration)."""
    micro_batches = min(found.micro_batch_tries, key=lambda tried: (tried[2], tried[0]))[0]
    both = replace(found.settings, micro_batches=micro_batches)
    combined = _checkpointing(lambda count: run(count, both), names, limit, layers)
    found.combined_tries = [(micro_batches, *tried) for tried in combined.tried[1:]]  # 0: a micro-batch try
    if combined.fits or combined.estimate.peak_reserved < found.estimate.peak_reserved:
        found.fits, found.settings, found.checkpointed = combined.fits, both, combined.checkpointed
        found.estimate = combined.estimate
        found.recomputed_flops, found.baseline_flops = combined.recomputed_flops, combined.baseline_flops


def _faster(
    selective: Plan,
    settings: Settings,
    run: Callable[[int, Settings], Outcome],
    names: list[str],
    limit: int,
    layers: bool,
    rejected: dict[str, str],
) -> tuple[Plan, Settings]:
    """Of the fewest blocks checkpointed selectively (``selective``, with ``settings``) and the fewest
    checkpointed whole, the one whose step takes less time by the roofline (selectively on a tie:
    it recomputes no FLOPs), and its settings; why the other was not kept goes into ``rejected``.
    Selectively, fewer FLOPs run again but more memory-bound ops, and more blocks are needed."""
    whole_settings = replace(settings, selective=False)
    whole = _checkpointing(lambda count: run(count, whole_settings), names, limit, layers)
    if not whole.fits:
        rejected["checkpointing"] = "whole blocks do not fit where blocks checkpointed selectively do"
        return selective, settings
    base = run(0, AS_IT_IS)[1].seconds or 1.0
    times = {
        key: (run(len(plan.checkpointed), chosen)[1].seconds or 0.0) / base - 1
        for key, plan, chosen in (("selective", selective, settings), ("whole", whole, whole_settings))
    }
    said = (
        f"{_blocks(len(selective.checkpointed))} checkpointed selectively: {times['selective']:+.1%} time by "
        f"the roofline; {_blocks(len(whole.checkpointed))} checkpointed whole: {times['whole']:+.1%}"
    )
    if times["whole"] < times["selective"]:
        rejected["selective"] = said
        return whole, whole_settings
    rejected["checkpointing"] = said
    return selective, settings


def _blocks(count: int) -> str:
    return f"{count} block" if count == 1 else f"{count} blocks"


def _checkpointing(
    run: Callable[[int], Outcome],
    names: list[str],
    limit: int,
    layers: bool,
    savings: list[int] | None = None,
) -> Plan:
    """The :class:`Plan` of the least count of first blocks (``names``) checkpointed whose step fits
    ``limit`` bytes; ``run(count)`` as :func:`search_plan`'s with the settings kept. ``savings``: the
    bytes each block is expected to free (default: its saved activations, :func:`_savings`)."""
    unbounded: dict[int, Estimate] = {}  # by blocks checkpointed, in the order tried
    fitted: dict[int, Estimate] = {}  # those that complete within the budget, capped at it
    costs: dict[int, Cost] = {}  # one step's cost (the last step's) by blocks checkpointed

    def fits(count: int) -> bool:
        unbounded[count], costs[count], within = run(count)
        if within is not None:
            fitted[count] = within
        return within is not None

    most = max(len(names) - 1, 1)  # the last block is tried alone at the end (see the module docstring)
    if fits(0):
        chosen: int | None = 0
    else:
        if savings is None and names:
            savings = _savings(unbounded, names)
        chosen = _search(fits, unbounded, savings, most, limit) if names else None
    if chosen is None and 0 < most < len(names) and fits(len(names)):
        chosen = len(names)
    least = min(unbounded, key=lambda count: (unbounded[count].peak_reserved, count))
    return Plan(
        fits=chosen is not None,
        budget=limit,
        blocks=names,
        checkpointed=names[: least if chosen is None else chosen],
        estimate=fitted[chosen] if chosen is not None else unbounded[least],
        baseline=unbounded[0],
        recomputed_flops=costs[chosen].flops - costs[0].flops if chosen else 0,
        baseline_flops=costs[0].flops if chosen else 0,
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
def checkpointed(modules: list[torch.nn.Module], selective: bool = False) -> Iterator[None]:
    """``modules`` checkpointed (:func:`memlab.plan.checkpointing.checkpoint`) while the block runs (an
    estimate copies them so), then as before, also on an error or Ctrl-C."""
    with interrupts_held():
        checkpoint(modules, selective)
    try:
        yield
    finally:
        with interrupts_held():
            uncheckpoint(modules)
