"""``memlab.plan``: the least activation checkpointing that makes a training step fit a budget.

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

from memlab._gpus import GpuLike, resolve_gpu
from memlab._offload import interrupts_held
from memlab._units import check_count, format_size
from memlab.estimate.estimate import Estimate, _target, run_estimate
from memlab.estimate.fit import budget_in_bytes, modelled_gpu
from memlab.plan.checkpointing import candidate_blocks, checkpoint, is_checkpointed, is_layer, uncheckpoint
from memlab.plan.flops import counting

__all__ = ["Plan", "plan", "search_plan"]


class Plan:
    """What :func:`plan` found. ``fits``: whether the step completes within :attr:`budget` with
    :attr:`checkpointed` (module names, in the model ``plan`` was given) checkpointed; ``estimate``:
    the step's estimate under the plan, capped at the budget when the plan fits (its
    ``peak_reserved`` is what a ``TensorTracker(capacity=budget)`` run of the applied step reports);
    for a plan that does not fit, :attr:`checkpointed` and ``estimate`` are those of the configuration
    tried that needs the least (unbounded); ``baseline``: the step's estimate as it is;
    ``recomputed_flops``: the FLOPs the checkpointed blocks' forwards run again in one step
    (FlopCounterMode's ops), ``baseline_flops`` those of one step as it is (0 for a plan that
    changes nothing); ``tried``: each configuration
    estimated, as ``(blocks checkpointed, fits, peak reserved bytes of the unbounded run)``;
    ``layers``: the blocks are Hugging Face layers, checkpointed with their own switch (:attr:`code`
    says how).

    :meth:`apply` checkpoints those modules of a model (the one ``plan`` was given, or one of the
    same structure); :meth:`remove` undoes it."""

    def __init__(
        self,
        *,
        fits: bool,
        budget: int,
        blocks: list[str],
        checkpointed: list[str],
        estimate: Estimate,
        baseline: Estimate,
        recomputed_flops: int,
        baseline_flops: int,
        tried: list[tuple[int, bool, int]],
        layers: bool = False,
    ) -> None:
        self.fits = fits
        self.layers = layers
        self.budget = budget
        self.blocks = blocks
        self.checkpointed = checkpointed
        self.estimate = estimate
        self.baseline = baseline
        self.recomputed_flops = recomputed_flops
        self.baseline_flops = baseline_flops
        self.tried = tried
        self._applied: list[torch.nn.Module] = []

    @property
    def extra_compute(self) -> float:
        """The recomputed FLOPs as a fraction of the step's own (0.0 when nothing is checkpointed)."""
        return self.recomputed_flops / self.baseline_flops if self.baseline_flops else 0.0

    def apply(self, model: torch.nn.Module) -> Plan:
        """Checkpoint :attr:`checkpointed` in ``model`` (looked up by name: the model the plan was made
        for, or one built the same way). ``ValueError`` for a plan that does not fit, or a name the
        model does not have (nothing is changed then). Returns the plan (``with plan.apply(model):``
        removes it at the end)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"apply takes the model (a torch.nn.Module), got {type(model).__name__} {model!r:.80}"
            )
        if not self.fits:
            raise ValueError(
                f"this plan does not fit the budget of {format_size(self.budget)}: {self._verdict()}"
            )
        modules = dict(model.named_modules())
        missing = [name for name in self.checkpointed if name not in modules]
        if missing:
            raise ValueError(
                f"the model has no module {missing[0]!r}: apply the plan to the model it was made for "
                f"(its blocks: {', '.join(self.blocks)})"
            )
        chosen = [modules[name] for name in self.checkpointed]
        with interrupts_held():
            newly = [module for module in chosen if not is_checkpointed(module)]  # remove() undoes only these
            checkpoint(newly)
            self._applied.extend(newly)
        return self

    def remove(self) -> None:
        """Undo :meth:`apply` (every model it was applied to): the blocks it checkpointed, not those
        that were checkpointed already (by another plan); nothing if it was not applied."""
        with interrupts_held():
            uncheckpoint(self._applied)
            self._applied.clear()

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    @property
    def code(self) -> str:
        """The plan as code to paste after the model is built (``model`` names it)."""
        if not self.fits:
            return f"# {self._verdict()}"
        if not self.checkpointed:
            return "# no change needed"
        names = ", ".join(repr(name) for name in self.checkpointed)
        if self.layers:  # Hugging Face layers: their own switch
            return (
                "import functools, torch.utils.checkpoint\n"
                f"for name in [{names}]:\n"
                "    layer = model.get_submodule(name)\n"
                "    layer.gradient_checkpointing = True\n"
                "    layer._gradient_checkpointing_func = functools.partial(\n"
                "        torch.utils.checkpoint.checkpoint, use_reentrant=False)"
            )
        return (
            "import functools, torch.utils.checkpoint\n"
            f"for name in [{names}]:\n"
            "    block = model.get_submodule(name)\n"
            "    block.forward = functools.partial(\n"
            "        torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)"
        )

    def _verdict(self) -> str:
        if not self.fits:
            least = format_size(self.estimate.peak_reserved)
            return (
                f"does not fit with these knobs: the least the step needs is {least} reserved, with "
                f"{len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed"
            )
        if not self.checkpointed:
            return "no change needed"
        return (
            f"checkpoint {len(self.checkpointed)} of {len(self.blocks)} blocks ("
            f"{self.checkpointed[0]} to {self.checkpointed[-1]}): +{self.extra_compute:.1%} compute"
        )

    def __repr__(self) -> str:
        lines = [
            f"Plan for a budget of {format_size(self.budget)}: {self._verdict()}",
            f"  as it is: {format_size(self.baseline.peak_reserved)} reserved at peak",
        ]
        if self.fits:
            lines.append(
                f"  planned:  {format_size(self.estimate.peak_reserved)} reserved at peak (within the budget)"
            )
        lines.append("  blocks checkpointed  fits  peak reserved (unbounded)")
        for count, fits, peak in sorted(self.tried):
            lines.append(f"  {count:>18}  {'yes' if fits else 'no':>4}  {format_size(peak):>13}")
        return "\n".join(lines)


def plan(
    step: Callable[..., Any],
    *args: Any,
    budget: int | str | None = None,
    gpu: GpuLike | None = None,
    steps: int = 2,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> Plan:
    """The fewest blocks to checkpoint, of the model among the arguments (the first
    ``torch.nn.Module``, positional or keyword), for ``step(*args, **kwargs)`` (``steps`` calls in a
    row: the steady state of a training loop) to complete within ``budget`` (bytes or a size such
    as ``"16 GiB"``; default: :func:`memlab.estimate.fit.default_budget` for ``cuda``: on a GPU
    machine what this process's allocator can still get, else the modelled GPU's memory less the
    CUDA context's allowance), on ``gpu`` (default: the GPU in use, else an H100). Nothing of the
    user's changes: the search checkpoints the model's blocks only while each estimate copies them.

    Returns a :class:`Plan`: whether it fits, which modules to checkpoint, its estimate (exact when
    applied: peak bytes as the CUDA caching allocator counts them), the recomputed FLOPs per step.
    ``TypeError`` when no ``torch.nn.Module`` is among the arguments; ``ValueError`` for a bad
    budget or a model with no blocks to checkpoint.

    What it cannot see: what an estimate cannot see (:func:`memlab.estimate`); the other knobs
    (micro-batches, autocast, sharding, optimizer offload) are not searched yet; the recompute
    cost is in FLOPs, not time. Each configuration tried costs an estimate of ``steps`` steps.
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

    def run(count: int) -> tuple[Estimate, int, Estimate | None]:
        counted: list[int] = []
        with _checkpointed(modules[:count]):  # a capped run estimates the step again, as checkpointed
            found = run_estimate(
                step,
                lambda: (args, kwargs),
                target,
                steps=steps,
                gpu=modelled,
                call_context=counting(counted),
            )
            return found, counted[-1], found.under(limit)

    return search_plan(run, [name for name, _ in blocks], limit, layers=is_layer(blocks[0][1]))


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
    at the peak. Zeros where the estimate's module paths are not the blocks' (another model first)."""
    table = unbounded[0].by_module()["activation"]
    saved = dict.fromkeys(names, 0)
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
