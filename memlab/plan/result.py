"""What :func:`memlab.plan` finds: :class:`Plan`, its table, its code to paste, applied to a model
and removed again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memlab._offload import interrupts_held
from memlab._units import format_size
from memlab.estimate.estimate import Estimate
from memlab.plan.accumulation import accumulating
from memlab.plan.checkpointing import checkpoint, is_checkpointed, uncheckpoint

__all__ = ["Plan"]


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
    says how). ``micro_batches``: how many micro-batches each batch is split into (1: none; more
    only where no checkpointing fits, with none checkpointed); ``micro_batch_tries``: each count
    estimated, as ``(micro-batches, fits, peak reserved bytes of the unbounded run)``;
    ``why_not_micro_batches``: why they were not tried, where they were not.

    :meth:`apply` checkpoints those modules of a model (the one ``plan`` was given, or one of the
    same structure); :meth:`remove` undoes it; :meth:`step` gives the step to call for a plan with
    micro-batches."""

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
        self.micro_batches = 1
        self.micro_batch_tries: list[tuple[int, bool, int]] = []
        self.why_not_micro_batches: str | None = None
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

    def step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` as the plan runs it: with :attr:`micro_batches` micro-batches, the accumulating step
        (:func:`memlab.plan.accumulation.accumulating`, whose call returns the list of ``step``'s
        results), else ``step`` itself."""
        return accumulating(step, self.micro_batches) if self.micro_batches > 1 else step

    @property
    def code(self) -> str:
        """The plan as code to paste after the model is built (``model`` names it; a plan with
        micro-batches: ``train_step`` names the step)."""
        if not self.fits:
            return f"# {self._verdict()}"
        if self.micro_batches > 1:
            return (
                f"# {self.micro_batches} micro-batches per batch, gradients accumulated, one optimizer step\n"
                "from memlab.plan.accumulation import accumulating\n"
                f"train_step = accumulating(train_step, micro_batches={self.micro_batches})"
            )
        if not self.checkpointed:
            return "# no change needed"
        names = ", ".join(repr(name) for name in self.checkpointed)
        if self.layers:  # Hugging Face layers: their own switch, their KV cache dropped (memlab's helper)
            return (
                "from memlab.plan.checkpointing import checkpoint\n"
                f"checkpoint([model.get_submodule(name) for name in [{names}]])"
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
            how = (
                f"{self.micro_batches} micro-batches"
                if self.micro_batches > 1
                else f"{len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed"
            )
            return f"does not fit with these knobs: the least the step needs is {least} reserved, with {how}"
        if self.micro_batches > 1:
            return (
                f"split each batch into {self.micro_batches} micro-batches (gradients accumulated, one "
                "optimizer step): +0.0% compute"
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
        if self.micro_batch_tries:
            lines.append("        micro-batches  fits  peak reserved (unbounded)")
            for count, fits, peak in self.micro_batch_tries:
                lines.append(f"  {count:>18}  {'yes' if fits else 'no':>4}  {format_size(peak):>13}")
        elif self.why_not_micro_batches:
            lines.append(f"  micro-batches not tried: {self.why_not_micro_batches}")
        return "\n".join(lines)
