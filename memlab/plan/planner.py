"""``memlab.plan``: the least activation checkpointing that makes a training step fit a budget.

The plan is searched with estimates (:func:`memlab.estimate`: data-free, exact for what a tracker
counts) and its fit decided as every fit check in memlab decides it: does the step complete under a
CUDA caching allocator capped at the budget, retry path included
(:func:`memlab.estimate.capped.completes_under`). So a plan that fits, applied to the model, fits
when run: its estimate is the plan's, byte for byte.

The knob searched is activation checkpointing of whole blocks (:func:`~memlab.plan.checkpointing.
candidate_blocks`: a transformer's layers), the first ``k`` of them, for the least ``k`` that fits,
searched between 0 and all blocks but the last, each try where the peaks of the two known ends,
taken as a straight line, reach the budget (blocks of a stack free about as much each). It
assumes that checkpointing one more of those never needs more memory (its activations are freed
in the forward and recomputed late in the backward, when less is held). The last block is the
exception: its recompute runs first in the backward, while everything else is still held, and can
need more than its saved activations (a 6-layer ``TransformerEncoder``: 196 MiB reserved with 5
checkpointed, 208 MiB with all 6), so "all blocks" is tried only when all but the last do not
fit. Whatever the assumption, a plan that fits is the estimate of exactly that configuration under
the budget.

Each checkpointed block runs its forward again in the backward pass (up to the last tensor the
backward needs: PyTorch's non-reentrant checkpoint stops there): the plan's extra compute is the
recomputed FLOPs, counted by PyTorch's ``FlopCounterMode`` in estimates of their own of the step
with and without the plan (matmuls, convolutions and attention: the ops PyTorch counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from memlab._gpus import GpuLike
from memlab._offload import interrupts_held
from memlab._units import check_count, format_size
from memlab.estimate.estimate import Estimate, estimate
from memlab.estimate.fit import budget_in_bytes, modelled_gpu
from memlab.plan.checkpointing import candidate_blocks, checkpoint, is_checkpointed, is_layer, uncheckpoint

__all__ = ["Plan", "plan"]


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

    def run(count: int) -> Estimate:
        with _checkpointed(modules[:count]):
            return estimate(step, *args, steps=steps, gpu=gpu, device=device, **kwargs)

    def flops(count: int) -> int:
        """One step's FLOPs with ``count`` blocks checkpointed, from a one-step estimate of its own:
        under ``FlopCounterMode`` (a dispatch mode with module hooks) a step with checkpointed
        blocks can keep other tensors than without it, so no fit is read from it."""
        counted: list[int] = []
        with _checkpointed(modules[:count]):
            estimate(_counting(step, counted), *args, gpu=gpu, device=device, **kwargs)
        return sum(counted)

    unbounded: dict[int, Estimate] = {}  # by blocks checkpointed, in the order tried
    fitted: dict[int, Estimate] = {}  # those that complete within the budget, capped at it

    def fits(count: int) -> bool:
        unbounded[count] = run(count)
        with _checkpointed(modules[:count]):  # a capped run estimates the step again
            within = unbounded[count].under(limit)
        if within is not None:
            fitted[count] = within
        return within is not None

    names = [name for name, _ in blocks]
    most = max(len(blocks) - 1, 1)  # the last block is tried alone at the end (see the module docstring)
    chosen: int | None
    if fits(0):
        chosen = 0
    elif fits(most):
        low, high = 0, most  # low does not fit, high does
        while high - low > 1:
            guess = _interpolated(
                low, high, unbounded[low].peak_reserved, unbounded[high].peak_reserved, limit
            )
            low, high = (low, guess) if fits(guess) else (guess, high)
        chosen = high
    elif most < len(blocks) and fits(len(blocks)):
        chosen = len(blocks)
    else:
        chosen = None
    baseline_flops = flops(0) if chosen != 0 else 0
    least = min(unbounded, key=lambda count: (unbounded[count].peak_reserved, count))
    return Plan(
        fits=chosen is not None,
        budget=limit,
        blocks=names,
        checkpointed=names[: least if chosen is None else chosen],
        estimate=fitted[chosen] if chosen is not None else unbounded[least],
        baseline=unbounded[0],
        recomputed_flops=flops(chosen) - baseline_flops if chosen else 0,
        baseline_flops=baseline_flops,
        tried=[(count, count in fitted, found.peak_reserved) for count, found in unbounded.items()],
        layers=is_layer(blocks[0][1]),
    )


def _interpolated(low: int, high: int, low_peak: int, high_peak: int, limit: int) -> int:
    """The next count to try between ``low`` (does not fit) and ``high`` (fits): where the peaks,
    taken as falling in a straight line from ``low_peak`` to ``high_peak``, reach ``limit`` (each
    checkpointed block of a stack of equal ones frees about as much); strictly between the two."""
    if low_peak > high_peak:
        guess = low + -(-(low_peak - limit) * (high - low) // (low_peak - high_peak))  # rounded up
    else:
        guess = (low + high) // 2
    return min(max(guess, low + 1), high - 1)


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


def _counting(step: Callable[..., Any], flops: list[int]) -> Callable[..., Any]:
    """``step`` under PyTorch's ``FlopCounterMode``; each call appends its FLOPs to ``flops``."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        with FlopCounterMode(display=False) as counter:
            result = step(*args, **kwargs)
        flops.append(counter.get_total_flops())
        return result

    return counted
