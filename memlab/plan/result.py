"""What :func:`memlab.plan` finds: :class:`Plan`, its table, its code to paste, applied to a model
and removed again."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from memlab._offload import interrupts_held
from memlab._units import format_size
from memlab.estimate.estimate import Estimate
from memlab.plan.checkpointing import checkpoint, is_checkpointed, uncheckpoint
from memlab.plan.settings import Settings, per_parameter, restore

__all__ = ["Plan"]


class Plan:
    """What :func:`plan` found. ``fits``: whether the step completes within :attr:`budget` with
    :attr:`settings` (a :class:`~memlab.plan.settings.Settings`: bf16 autocast, optimizers per parameter,
    micro-batches) and :attr:`checkpointed` (module names, in the model ``plan`` was given) checkpointed;
    ``estimate``: the step's estimate under the plan, capped at the budget when the plan fits (its
    ``peak_reserved`` is what a ``TensorTracker(capacity=budget)`` run of the applied step reports); for a
    plan that does not fit, :attr:`settings`, :attr:`checkpointed` and ``estimate`` are those of the
    configuration tried that needs the least (unbounded); ``baseline``: the step's estimate as it is;
    ``recomputed_flops``: the FLOPs the checkpointed blocks' forwards run again in one step
    (FlopCounterMode's ops), ``baseline_flops`` those of one step with the plan's settings and nothing
    checkpointed (0 where nothing is checkpointed); ``setting_tries``: each setting estimated before
    checkpointing, as ``(settings, fits, peak reserved bytes of the unbounded run)``; ``tried``: each
    count of blocks checkpointed estimated (with the settings kept), as ``(blocks checkpointed, fits, peak
    reserved bytes of the unbounded run)``; ``micro_batch_tries``: each count of micro-batches estimated,
    likewise (only where no checkpointing fits, with none checkpointed); ``combined_tries``: each count of
    blocks checkpointed estimated with micro-batches (only where neither fits alone), as ``(micro-batches,
    blocks checkpointed, fits, peak reserved bytes of the unbounded run)``; ``rejected``: why each knob
    tried or considered was not kept, by knob name; ``layers``: the blocks are Hugging Face layers,
    checkpointed with their own switch (:attr:`code` says how); ``device_type``: where the step's autocast
    runs; ``trainer``: ``"transformers"`` or ``"lightning"`` for a trainer's plan
    (:func:`memlab.integrations.transformers.plan`, :func:`memlab.integrations.lightning.plan`:
    :attr:`code` in its terms), ``None`` for a step's; ``arguments``: for a trainer's plan with
    micro-batches, the trainer's settings that make them (the batch size and the accumulation steps, by
    name); ``seconds``, ``baseline_seconds``: one step's roofline time on ``gpu`` (a name) with the
    plan and as it is (:attr:`extra_time`); ``estimated``: how many configurations the search
    estimated.

    :meth:`apply` checkpoints those modules of a model (the one ``plan`` was given, or one of the
    same structure) and sets the optimizers' ``foreach``; :meth:`remove` undoes it; :meth:`step`
    gives the step to call (autocast, micro-batches)."""

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
        self.settings = Settings()
        self.device_type = "cuda"
        self.rejected: dict[str, str] = {}
        self.setting_tries: list[tuple[Settings, bool, int]] = []
        self.micro_batch_tries: list[tuple[int, bool, int]] = []
        self.combined_tries: list[tuple[int, int, bool, int]] = []
        self.trainer: str | None = None
        self.seconds: float | None = None
        self.baseline_seconds: float | None = None
        self.gpu: str | None = None
        self.estimated = 0  # the configurations the search estimated (a capped rerun not counted)
        self.arguments: dict[str, int] = {}
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
        self._groups: list[tuple[dict[str, Any], Any]] = []  # the optimizers' foreach before apply()

    @property
    def micro_batches(self) -> int:
        """How many micro-batches each batch is split into (1: none)."""
        return self.settings.micro_batches

    @property
    def why_not_micro_batches(self) -> str | None:
        """Why micro-batches were not tried, where they were needed and not tried."""
        return self.rejected.get("micro_batches")

    @property
    def extra_time(self) -> float | None:
        """The plan's roofline time of one step over that of the step as it is, less 1 (0.0: as
        fast; ``None`` where the GPU's peaks are not known): see :mod:`memlab.plan.flops` for what
        a roofline cannot see."""
        if self.seconds is None or not self.baseline_seconds:
            return None
        return self.seconds / self.baseline_seconds - 1

    @property
    def extra_compute(self) -> float:
        """The recomputed FLOPs as a fraction of the step's own (0.0 when nothing is checkpointed)."""
        return self.recomputed_flops / self.baseline_flops if self.baseline_flops else 0.0

    def apply(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    ) -> Plan:
        """Checkpoint :attr:`checkpointed` in ``model`` (looked up by name: the model the plan was made
        for, or one built the same way) and, for a plan whose optimizers step per parameter, set
        ``foreach=False`` in ``optimizer``'s parameter groups (one optimizer or several). The step
        settings (autocast, micro-batches) are the step's: call :meth:`step`'s. ``ValueError`` for a
        plan that does not fit, a name the model does not have, or a plan that changes the optimizer
        given none (nothing is changed then). Returns the plan (``with plan.apply(model):`` removes it
        at the end)."""
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
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            optimizers = [] if optimizer is None else [optimizer]
        else:
            optimizers = list(optimizer) if isinstance(optimizer, Iterable) else [optimizer]
        if not all(isinstance(one, torch.optim.Optimizer) for one in optimizers):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or several, got {optimizer!r:.80}")
        if self.settings.per_parameter and not optimizers:
            raise ValueError(
                "this plan steps the optimizers per parameter (foreach=False): pass the optimizer too, "
                "plan.apply(model, optimizer)"
            )
        chosen = [modules[name] for name in self.checkpointed]
        with interrupts_held():
            newly = [module for module in chosen if not is_checkpointed(module)]  # remove() undoes only these
            checkpoint(newly, self.settings.selective)
            self._applied.extend(newly)
            if self.settings.per_parameter:
                self._groups.extend(per_parameter(optimizers))
        return self

    def remove(self) -> None:
        """Undo :meth:`apply` (every model it was applied to): the blocks it checkpointed, not those
        that were checkpointed already (by another plan), and the optimizers' ``foreach`` as it was;
        nothing if it was not applied."""
        with interrupts_held():
            uncheckpoint(self._applied)
            self._applied.clear()
            restore(self._groups)
            self._groups.clear()

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    def step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` as the plan runs it (:meth:`Settings.step <memlab.plan.settings.Settings.step>`):
        under bf16 autocast where :attr:`settings` say so, and with :attr:`micro_batches`
        micro-batches (:func:`memlab.plan.accumulation.accumulating`, whose call returns the list of
        ``step``'s results); else ``step`` itself."""
        return self.settings.step(step, self.device_type)

    @property
    def code(self) -> str:
        """The plan as code to paste after the model and optimizer are built (``model``,
        ``optimizer`` and ``train_step`` name them)."""
        if not self.fits:
            return f"# {self._verdict()}"
        parts = []
        if self.trainer and self.checkpointed:
            parts.append("model = trainer.model" if self.trainer == "transformers" else "model = module")
        if self.trainer == "transformers" and self.settings.per_parameter:
            parts.append(
                "trainer.create_optimizer()  # the optimizer train() would make, made now\n"
                "optimizer = trainer.optimizer"
            )
        if self.trainer == "lightning" and self.settings.per_parameter:
            parts.append("# in configure_optimizers: the optimizer made with foreach=False")
        if self.checkpointed:
            names = ", ".join(repr(name) for name in self.checkpointed)
            if self.layers or self.settings.selective:  # memlab's helper: a Hugging Face layer's own switch
                selective = ", selective=True" if self.settings.selective else ""
                parts.append(
                    "from memlab.plan.checkpointing import checkpoint\n"
                    f"checkpoint([model.get_submodule(name) for name in [{names}]]{selective})"
                )
            else:
                parts.append(
                    "import functools, torch.utils.checkpoint\n"
                    f"for name in [{names}]:\n"
                    "    block = model.get_submodule(name)\n"
                    "    block.forward = functools.partial(\n"
                    "        torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)"
                )
        if self.settings.per_parameter and self.trainer != "lightning":
            parts.append(
                "for group in optimizer.param_groups:  # per parameter, no multi-tensor kernels\n"
                '    group["foreach"] = False'
            )
        if self.settings.autocast:
            parts.append(
                "# bf16 autocast around the whole step (forward, backward, optimizer step)\n"
                "from memlab.plan.settings import autocasting\n"
                f"train_step = autocasting(train_step, {self.device_type!r})"
            )
        if self.arguments:
            fields = ", ".join(f"{name}={value}" for name, value in self.arguments.items())
            where = {
                "transformers": "in the TrainingArguments the Trainer is built with",
                "lightning": "the batch size the dataloader reads, and the Trainer's argument",
            }[self.trainer]
            parts.append(f"# {where} (the same effective batch):\n#   {fields}")
        elif self.micro_batches > 1:
            parts.append(
                f"# {self.micro_batches} micro-batches per batch, gradients accumulated, one optimizer step\n"
                "from memlab.plan.accumulation import accumulating\n"
                f"train_step = accumulating(train_step, micro_batches={self.micro_batches})"
            )
        return "\n".join(parts) or "# no change needed"

    def _verdict(self) -> str:
        settings = self.settings
        if not self.fits:
            how = [
                *settings.changes,
                *(
                    [
                        f"{len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed"
                        + (" selectively" if settings.selective else "")
                    ]
                    if self.checkpointed
                    else []
                ),
                *([f"{settings.micro_batches} micro-batches"] if settings.micro_batches > 1 else []),
            ]
            least = format_size(self.estimate.peak_reserved)
            return (
                "does not fit with these knobs: the least the step needs is "
                f"{least} reserved, with {', '.join(how) or 'no change'}"
            )
        changes = settings.changes
        if self.checkpointed:
            how = " selectively" if settings.selective else ""
            first, last = self.checkpointed[0], self.checkpointed[-1]
            changes.append(
                f"checkpoint {len(self.checkpointed)} of {len(self.blocks)} blocks{how} ({first} to {last})"
            )
        if settings.micro_batches > 1:
            changes.append(
                f"split each batch into {settings.micro_batches} micro-batches (gradients accumulated, one "
                "optimizer step)"
            )
        if not changes:
            return "no change needed"
        time = "" if self.extra_time is None else f", {self.extra_time:+.1%} time on {self.gpu} (roofline)"
        return f"{', '.join(changes)}: +{self.extra_compute:.1%} compute{time}"

    def __repr__(self) -> str:
        lines = [
            f"Plan for a budget of {format_size(self.budget)}: {self._verdict()}",
            f"  as it is: {format_size(self.baseline.peak_reserved)} reserved at peak",
        ]
        if self.fits:
            lines.append(
                f"  planned:  {format_size(self.estimate.peak_reserved)} reserved at peak (within the budget)"
            )
        for settings, fits, peak in self.setting_tries:
            lines.append(
                f"  tried {', '.join(settings.changes)}: {'fits' if fits else 'does not fit'}, "
                f"{format_size(peak)} reserved (unbounded)"
            )
        lines.extend(
            f"  {knob} not kept: {why}" for knob, why in self.rejected.items() if knob != "micro_batches"
        )
        lines.append(
            "  blocks checkpointed  fits  peak reserved (unbounded)"
            + ("  (selectively: matmul and attention outputs kept)" if self.settings.selective else "")
        )
        for count, fits, peak in sorted(self.tried):
            lines.append(f"  {count:>18}  {'yes' if fits else 'no':>4}  {format_size(peak):>13}")
        if self.micro_batch_tries:
            lines.append("        micro-batches  fits  peak reserved (unbounded)")
            for count, fits, peak in self.micro_batch_tries:
                lines.append(f"  {count:>18}  {'yes' if fits else 'no':>4}  {format_size(peak):>13}")
        elif self.why_not_micro_batches:
            lines.append(f"  micro-batches not tried: {self.why_not_micro_batches}")
        for micro_batches, count, fits, peak in self.combined_tries:
            verdict = "fits" if fits else "does not fit"
            lines.append(
                f"  tried {count} blocks checkpointed, {micro_batches} micro-batches: {verdict}, "
                f"{format_size(peak)} reserved (unbounded)"
            )
        return "\n".join(lines)
