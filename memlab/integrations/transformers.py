"""memlab for a Hugging Face ``Trainer``: :func:`estimate` its optimizer steps before training,
:func:`max_batch_size` of its configuration, and :class:`MemlabCallback`, which measures every step
of ``trainer.train()`` and explains an out-of-memory error in ``TrainingArguments`` terms.

Importing this module imports ``transformers`` (``accelerate`` when an estimate runs); ``import memlab``
never imports it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memlab._devices import parse_device
from memlab._gpus import GpuLike, resolve_gpu
from memlab._units import check_count
from memlab.estimate.estimate import Estimate, run_estimate
from memlab.integrations._trainer_callback import MemlabCallback
from memlab.integrations._trainer_step import TrainerLoop, optimizer_step, plan_batches, untouched
from memlab.plan.flops import Cost
from memlab.plan.result import Plan
from memlab.plan.search import DEFAULT_KNOBS, Outcome
from memlab.plan.settings import Settings

__all__ = ["MemlabCallback", "TrainerBatchFit", "estimate", "max_batch_size", "plan"]


def _device(device: torch.device | str | None) -> torch.device:
    """Whose kernels the estimate mimics: the target GPU (``"cuda"``) unless ``device`` says otherwise."""
    return parse_device("cuda" if device is None else device, name="device")


def _check_trainer(trainer: Any) -> None:
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"trainer must be a transformers.Trainer, got {type(trainer).__name__} {trainer!r:.80}"
        )
    if trainer.train_dataset is None:
        raise ValueError("trainer has no train_dataset: estimate(trainer) needs its batches' shapes")


def _optimizer_and_scheduler(trainer: Any, num_training_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The torch optimizer the trainer's steps update and its scheduler (``None``: made on the
    estimate's copy). A trainer without an optimizer yet makes one, as ``train()`` would, on a
    shallow copy of itself: the user's trainer keeps ``optimizer`` and ``lr_scheduler`` ``None``."""
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    if optimizer is None:
        view = copy.copy(trainer)
        view.optimizer = view.lr_scheduler = None
        view.create_optimizer()
        optimizer, scheduler = view.optimizer, None
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer (after train()) wraps it
    if trainer._created_lr_scheduler:
        scheduler = None  # train() makes its scheduler anew
    return optimizer, scheduler


def _num_training_steps(trainer: Any, dataloader: Any) -> int:
    total = trainer.get_total_train_batch_size(trainer.args)
    return trainer.set_initial_training_values(trainer.args, dataloader, total)[-1]


def _prepare(
    trainer: Any, steps: int, batch_size: int | None = None, accumulation: int | None = None
) -> tuple[Any, Any, Any, Any]:
    """``(trainer view, optimizer, scheduler, plan)``: what an estimate of ``steps`` steps of
    ``trainer`` needs, drawn from its dataloader (with ``per_device_train_batch_size`` set to
    ``batch_size`` and ``gradient_accumulation_steps`` to ``accumulation`` on a copy of its
    arguments when given) and restoring the RNG it uses."""
    view = copy.copy(trainer)
    if batch_size is not None or accumulation is not None:
        # A copy, not dataclasses.replace: TrainingArguments.__post_init__ resets accelerate's state.
        view.args = copy.copy(trainer.args)
    if batch_size is not None:
        view.args.per_device_train_batch_size = batch_size
        view._train_batch_size = batch_size
    if accumulation is not None:
        view.args.gradient_accumulation_steps = accumulation
    accelerator = copy.copy(trainer.accelerator)
    accelerator._dataloaders = []
    view.accelerator = accelerator
    with untouched(), _disable_current_modes():  # an active tracker does not count the draw
        dataloader = view.get_train_dataloader()
        num_training_steps = _num_training_steps(view, dataloader)
        plan = plan_batches(view, dataloader, steps)
        del dataloader
    optimizer, scheduler = _optimizer_and_scheduler(trainer, num_training_steps)
    return view, optimizer, scheduler, (plan, num_training_steps)


def _run(
    trainer: Any,
    steps: int,
    device: torch.device | str | None,
    gpu: GpuLike | None,
    *,
    batch_size: int | None = None,
    accumulation: int | None = None,
    capacity: int | None = None,
    call_context: Any = None,
) -> Estimate:
    view, optimizer, scheduler, (plan, num_training_steps) = _prepare(
        trainer, steps, batch_size, accumulation
    )
    model = trainer.model
    modelled = resolve_gpu(gpu)
    target = _device(device)

    def arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (view, model, optimizer, TrainerLoop(plan, scheduler, num_training_steps)), {}

    with untouched():
        result = run_estimate(
            optimizer_step,
            arguments,
            target,
            steps=steps,
            capacity=capacity,
            gpu=modelled,
            call_context=call_context,
        )
    result.name = f"{type(trainer).__name__} optimizer step"
    args = trainer.args
    if target.type == "cuda" and args.device.type != "cuda" and (args.bf16 or args.fp16):
        where = args.device.type
        result.caveats.append(
            f"the trainer was built on {where}: its bf16/fp16 steps ran under {where}'s autocast, which "
            "casts other ops than CUDA's autocast does on a GPU"
        )
    return result


def estimate(
    trainer: Any,
    steps: int = 2,
    *,
    device: torch.device | str | None = None,
    gpu: GpuLike | None = None,
) -> Estimate:
    """The memory ``steps`` optimizer steps of ``trainer.train()`` take, estimated data-free before
    training (:func:`memlab.estimate` on copies: the user's trainer, model, optimizer, scheduler,
    accelerator and random number generators are left as they were).

    Each step is the trainer's own: ``gradient_accumulation_steps`` micro-batches of
    ``per_device_train_batch_size`` from its train dataloader (real batches are drawn and collated
    as the trainer does, for their shapes and dtypes; an estimate allocates data-free tensors of
    them, one batch ahead as accelerate's loader collates), each through the trainer's own
    ``training_step`` (``compute_loss``, bf16/fp16 autocast as its accelerator wraps ``forward``,
    ``accelerator.backward``), ``max_grad_norm`` clipping, its optimizer (made as ``train()`` makes
    it when there is none yet: ``create_optimizer``) and scheduler, ``zero_grad``;
    ``gradient_checkpointing`` is enabled on the copy as ``train()`` enables it. Bytes as
    :class:`memlab.Estimate` counts them (the CUDA caching allocator model), including the batches,
    the loss sum the loop keeps and the gradient norm; the model, its gradients and optimizer state
    from the start. Not seen: callbacks, logging steps (``logging_steps``: a few 512-byte
    temporaries), evaluation and checkpoint saving, and what :class:`memlab.Estimate` lists.

    ``device``: whose kernels to mimic, default ``"cuda"`` (the training GPU; ``gpu`` as for
    :func:`memlab.estimate`: default the GPU in use, else an H100); ``"cpu"`` estimates a CPU run.
    A trainer built on CPU autocasts as CPU does: estimated for a GPU, its bf16/fp16 steps keep
    CPU's autocast (a caveat says so). One process only (an ``EstimateError`` for a distributed
    run). The batches the estimate makes hold the loader's values for the run
    (:func:`memlab.estimate.values.stands_for`), so what the step reads of them (HF's attention-mask
    checks) is answered as the real step answers it, data-free; reads that force a real run are
    those :func:`memlab.estimate` names in ``forced_by``.
    """
    _check_trainer(trainer)
    steps = check_count(steps, "steps", 1)
    return _run(trainer, steps, device, gpu)


@dataclasses.dataclass(frozen=True)
class TrainerBatchFit:
    """What :func:`max_batch_size` found for a trainer.

    ``batch_size``: the largest ``per_device_train_batch_size`` whose ``steps`` optimizer steps fit
    in ``budget`` bytes (0 when even 1 does not); ``fit``: the search's
    :class:`memlab.estimate.fit.BatchFit` (its estimates of that size and the next). To keep the
    user's effective batch (``per_device_train_batch_size * gradient_accumulation_steps`` =
    ``effective_batch``), ``per_device_train_batch_size`` is the largest divisor of it that fits
    and ``gradient_accumulation_steps`` the quotient; ``changes`` are the ``TrainingArguments``
    fields to set (empty when the trainer's own fit), ``remedy`` says them as keyword arguments.
    """

    batch_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    effective_batch: int
    changes: dict[str, int]
    fit: Any

    @property
    def remedy(self) -> str:
        """The changes as ``TrainingArguments`` keyword arguments (``""`` when none is needed)."""
        return ", ".join(f"{name}={value}" for name, value in self.changes.items())

    def __repr__(self) -> str:
        text = f"largest per_device_train_batch_size that fits: {self.batch_size} ({self.fit!r})"
        if self.batch_size == 0:
            return text
        keep = f"to keep the effective batch of {self.effective_batch}: "
        return (
            f"{text}\n{keep}{self.remedy}" if self.changes else f"{text}\n{keep}the trainer's arguments fit"
        )


def keep_effective_batch(batch_size: int, per_device: int, accumulation: int) -> tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` whose product is
    ``per_device * accumulation`` with the largest per-device batch no larger than ``batch_size``."""
    effective = per_device * accumulation
    size = next(d for d in range(min(batch_size, effective), 0, -1) if effective % d == 0)
    return size, effective // size


def max_batch_size(
    trainer: Any,
    budget: int | str | None = None,
    *,
    steps: int = 2,
    headroom: int | str = 0,
    device: torch.device | str | None = None,
    gpu: GpuLike | None = None,
    progress: bool | None = None,
) -> TrainerBatchFit:
    """The largest ``per_device_train_batch_size`` at which ``steps`` optimizer steps of
    ``trainer`` (as :func:`estimate` runs them) fit in ``budget`` bytes less ``headroom``, and the
    ``gradient_accumulation_steps`` that keeps the trainer's effective batch.

    Searched as :func:`memlab.max_batch_size` searches (doubling, then bisection, each size one
    data-free estimate under a modelled allocator of that capacity, with its retry path), on the
    trainer's own data: each size draws its batches from the trainer's dataloader built with that
    batch size on a copy of its arguments. ``budget`` (bytes or ``"16 GiB"``): default as
    :func:`memlab.max_batch_size`'s (the GPU's free memory; the capacity of the active
    ``TensorTracker``). Nothing of the user's trainer changes; apply ``changes`` to its
    ``TrainingArguments`` yourself. What the estimates cannot see (cuDNN workspaces, the CUDA
    context) belongs in ``headroom``. ``progress``: a line on stderr says which batch is being tried
    (as for :func:`memlab.max_batch_size`: on a terminal, unless ``False`` or ``MEMLAB_PROGRESS=0``).
    """
    from memlab.estimate.fit import budget_in_bytes, modelled_gpu, search_batch_size

    _check_trainer(trainer)
    steps = check_count(steps, "steps", 1)
    modelled = modelled_gpu(gpu)
    target = _device(device)
    limit, extra = budget_in_bytes(budget, headroom, target, modelled)

    def run(size: int, capacity: int | None) -> Estimate:
        return _run(trainer, steps, target, modelled, batch_size=size, capacity=capacity)

    high = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else None
    fit = search_batch_size(
        run, limit, extra, steps, high=high, progress=progress, task="Trainer max_batch_size"
    )
    good = fit.batch_size
    args = trainer.args
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if good == 0:
        return TrainerBatchFit(0, 0, 0, per_device * accumulation, {}, fit)
    size, steps_needed = keep_effective_batch(good, per_device, accumulation)
    changes = {}
    if size != per_device:
        changes = {"per_device_train_batch_size": size, "gradient_accumulation_steps": steps_needed}
    return TrainerBatchFit(good, size, steps_needed, per_device * accumulation, changes, fit)


def plan(
    trainer: Any,
    budget: int | str | None = None,
    *,
    steps: int = 2,
    device: torch.device | str | None = None,
    gpu: GpuLike | None = None,
    knobs: Iterable[str] = DEFAULT_KNOBS,
) -> Plan:
    """:func:`memlab.plan` for a ``Trainer``: the cheapest change that makes ``steps`` optimizer steps
    of ``trainer.train()`` (as :func:`estimate` runs them) complete within ``budget`` bytes (default
    as :func:`max_batch_size`'s), with the knobs of :func:`memlab.plan` except autocast (a trainer's
    is its ``bf16``/``fp16`` argument): its optimizer's ``foreach`` off, the fewest of its model's
    first blocks checkpointed, else micro-batches, which for a trainer are its own
    ``TrainingArguments``: ``per_device_train_batch_size`` divided by ``n`` and
    ``gradient_accumulation_steps`` multiplied by ``n`` (the same effective batch; ``n`` divides the
    per-device batch). :attr:`memlab.plan.Plan.arguments` holds those fields, :attr:`~memlab.plan.
    Plan.code` says the change in trainer terms; ``plan.apply(trainer.model)`` checkpoints the blocks
    (before ``train()``). Nothing of the user's trainer changes. ``ValueError`` for the autocast knob
    and what :func:`memlab.plan` rejects; what it cannot see is what :func:`estimate` cannot."""
    from memlab.estimate.fit import budget_in_bytes, modelled_gpu
    from memlab.plan.checkpointing import candidate_blocks
    from memlab.plan.search import checkpointed, multi_tensor_skip, search_plan
    from memlab.plan.settings import call_context

    _check_trainer(trainer)
    steps = check_count(steps, "steps", 1)
    knobs = tuple(knobs) if not isinstance(knobs, str) else knobs
    if "autocast" in knobs:
        raise ValueError(
            "a Trainer's autocast is its TrainingArguments' bf16=True (or fp16=True): set it and plan "
            "again; the knobs for a Trainer are 'foreach', 'checkpointing', 'micro_batches'"
        )
    modelled = modelled_gpu(gpu)
    target = _device(device)
    limit, _ = budget_in_bytes(budget, 0, target, modelled)
    blocks = candidate_blocks(trainer.model) if {"selective", "checkpointing"} & set(knobs) else []
    modules = [module for _, module in blocks]
    per_device, accumulation = (
        trainer.args.per_device_train_batch_size,
        trainer.args.gradient_accumulation_steps,
    )

    def run(count: int, settings: Settings) -> Outcome:
        flops: list[Cost] = []
        split = settings.micro_batches
        with checkpointed(modules[:count], settings.selective):
            found = _run(
                trainer,
                steps,
                target,
                modelled,
                batch_size=per_device // split if split > 1 else None,
                accumulation=accumulation * split if split > 1 else None,
                call_context=call_context(settings, flops, modelled),
            )
            return found, flops[-1], found.under(limit)

    found = search_plan(
        run,
        blocks,
        limit,
        knobs=knobs,
        skip=multi_tensor_skip([_optimizer_and_scheduler(trainer, 0)[0]], target),
        batch=per_device,
        gpu=modelled,
    )
    found.device_type = target.type
    found.trainer = "transformers"
    if found.micro_batches > 1:
        found.arguments = {
            "per_device_train_batch_size": per_device // found.micro_batches,
            "gradient_accumulation_steps": accumulation * found.micro_batches,
        }
    return found
