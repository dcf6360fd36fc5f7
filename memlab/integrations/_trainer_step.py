"""One optimizer step of a Hugging Face ``Trainer``, as ``Trainer._inner_training_loop`` runs it,
written as a plain function of the model and optimizer so that an estimate runs it on copies.

:func:`optimizer_step` mirrors transformers 4.57's loop: per optimizer step it fetches
``gradient_accumulation_steps`` micro-batches through the trainer's own ``get_batch_samples`` (from
an iterator that allocates each batch as accelerate's ``DataLoaderShard`` does, one batch ahead),
calls the trainer's own ``training_step`` for each (``compute_loss``, the autocast context,
``accelerator.backward``), sums the loss into ``tr_loss``, clips with ``accelerator.clip_grad_norm_``,
steps the (accelerate-wrapped) optimizer and the scheduler and zeroes the gradients. It runs these
methods on a shallow copy of the trainer whose model, optimizer, scheduler and accelerator lists
are the estimate's own, so nothing of the user's trainer changes. What it leaves out: callbacks,
logging (``_maybe_log_save_evaluate``: its ``.item()`` reads and temporaries run only every
``logging_steps``), ``floating_point_ops`` (no tensors) and the values the loop reads only for
logging (``isnan``/``isinf`` of the loss: allocated, never read).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memlab.estimate.result import EstimateError
from memlab.estimate.values import stands_for

__all__ = ["TrainerLoop", "optimizer_step", "plan_batches", "untouched"]


@dataclass(frozen=True)
class _Spec:
    """A tensor of a batch: an estimate allocates one of its shape and dtype in its place, holding
    its values where the estimate runs for real (``method="cpu"``: token ids must be valid)."""

    value: torch.Tensor


def _spec(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return _Spec(batch.detach().cpu())
    if isinstance(batch, dict):
        return type(batch)({key: _spec(value) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_spec(value) for value in batch)
    return batch


def _allocate(spec: Any, device: torch.device) -> Any:
    """A batch of new tensors of ``spec``'s shapes and values (data-free under the estimate's fake
    mode, where the run knows the values: :func:`memlab.estimate.values.stands_for`), made in the
    order the collator made the real batch's (a dict's insertion order)."""
    if isinstance(spec, _Spec):
        value = spec.value
        new = torch.empty(value.shape, dtype=value.dtype, device=device)
        if not isinstance(new, FakeTensor):
            return new.copy_(value)
        stands_for(new, value)  # its values known to the run: HF's mask checks stay data-free
        return new
    if isinstance(spec, dict):
        return type(spec)({key: _allocate(value, device) for key, value in spec.items()})
    if isinstance(spec, (list, tuple)):
        return type(spec)(_allocate(value, device) for value in spec)
    return spec


@dataclass(frozen=True)
class BatchPlan:
    """The batches ``steps`` optimizer steps fetch: per epoch the specs of its batches (those the
    steps take and, where the loader prefetches, the one it holds ahead) and per step the epoch it
    runs in and how many micro-batches it takes; ``prefetch``: the loader collates one batch ahead
    (accelerate's ``DataLoaderShard``)."""

    epochs: list[list[Any]]
    steps: list[tuple[int, int]]
    prefetch: bool


def plan_batches(trainer: Any, dataloader: Any, steps: int) -> BatchPlan:
    """Draw the real batches ``steps`` optimizer steps of ``trainer`` take from ``dataloader`` (the
    trainer's train dataloader, collated as the trainer collates) and keep their shapes and dtypes.
    The loop's epoch arithmetic is the trainer's (a last step of an epoch takes the remainder)."""
    accumulation = trainer.args.gradient_accumulation_steps
    prefetch = type(dataloader).__name__ == "DataLoaderShard"
    length = len(dataloader) if hasattr(dataloader, "__len__") else None
    per_epoch = length if length is not None else trainer.args.max_steps * accumulation
    remainder = per_epoch % accumulation or accumulation
    updates = per_epoch // accumulation + int(remainder < accumulation)
    epochs: list[list[Any]] = []
    plan: list[tuple[int, int]] = []
    while len(plan) < steps:
        sizes = [accumulation if u != updates - 1 else remainder for u in range(updates)][: steps - len(plan)]
        wanted = sum(sizes) + int(prefetch)
        batches = []
        for batch in dataloader:
            batches.append(_spec(batch))
            if len(batches) == wanted:
                break
        if not batches:
            raise EstimateError("the trainer's train dataloader yields no batch: nothing to estimate")
        plan += [(len(epochs), size) for size in sizes]
        epochs.append(batches)
    return BatchPlan(epochs, plan, prefetch)


def _batches(specs: list[Any], device: torch.device, prefetch: bool) -> Iterator[Any]:
    """The batches of one epoch, allocated when ``DataLoaderShard.__iter__`` collates them: one
    ahead of the batch it yields (``prefetch``), else when yielded."""
    if not prefetch:
        for spec in specs:
            yield _allocate(spec, device)
        return
    current = _allocate(specs[0], device)
    for spec in specs[1:]:
        following = _allocate(spec, device)
        yield current
        current = following
    yield current


class TrainerLoop:
    """What the trainer's loop keeps from one optimizer step to the next, for one estimate run:
    its view of the trainer, the loss sum ``tr_loss``, the last step's batches, loss and gradient
    norm, the epoch's batch iterator. Made anew for each run (under the estimate's fake mode)."""

    def __init__(self, plan: BatchPlan, scheduler: Any, num_training_steps: int) -> None:
        self.plan = plan
        self.scheduler_source = scheduler  # the user's scheduler (copied onto the copies), or None
        self.num_training_steps = num_training_steps
        self.index = 0
        self.view: Any = None
        self.held: dict[str, Any] = {}

    def start(self, trainer: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """What ``_inner_training_loop`` does before its first step, on ``model`` and ``optimizer``
        (the estimate's copies): gradient checkpointing, accelerate's preparation (the autocast
        wrapper of ``forward``, the optimizer wrapper), the scheduler, ``tr_loss``, ``zero_grad``."""
        from accelerate.optimizer import AcceleratedOptimizer
        from accelerate.utils import DistributedType

        args = trainer.args
        accelerator = copy.copy(trainer.accelerator)
        if accelerator.distributed_type != DistributedType.NO:
            raise EstimateError(
                f"the trainer runs {accelerator.distributed_type} across processes; estimate(trainer) "
                "supports one process (distributed type NO)"
            )
        for name in ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects"):
            setattr(accelerator, name, [])
        accelerator.scaler = copy.deepcopy(trainer.accelerator.scaler)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
            )
        model.train()
        accelerator.prepare_model(model, device_placement=False)
        wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=accelerator.scaler)
        accelerator._optimizers.append(wrapped)
        view = copy.copy(trainer)
        view.accelerator = accelerator
        view.model = view.model_wrapped = model
        view.optimizer = wrapped
        if self.scheduler_source is not None:
            view.lr_scheduler = copy.deepcopy(
                self.scheduler_source, {id(self.scheduler_source.optimizer): optimizer}
            )
            _track_step_called(optimizer)
        else:
            view.lr_scheduler = None
            view.create_scheduler(self.num_training_steps, optimizer=optimizer)
        self.view = view
        self.device = next(model.parameters()).device
        self.held["tr_loss"] = torch.tensor(0.0, device=self.device)
        model.zero_grad()


def optimizer_step(
    trainer: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loop: TrainerLoop
) -> None:
    """One optimizer step of ``trainer``'s inner training loop on ``model`` and ``optimizer`` (see
    the module docstring); ``loop`` carries what the loop keeps between steps."""
    if loop.view is None:
        loop.start(trainer, model, optimizer)
    view, held, args = loop.view, loop.held, trainer.args
    epoch, size = loop.plan.steps[loop.index]
    if held.get("epoch") != epoch:
        held["epoch"] = epoch
        held["iterator"] = _batches(loop.plan.epochs[epoch], loop.device, loop.plan.prefetch)
    held["batch_samples"], held["num_items_in_batch"] = view.get_batch_samples(
        held["iterator"], size, args.device
    )
    view.current_gradient_accumulation_steps = len(held["batch_samples"])
    accelerator = view.accelerator
    for i, inputs in enumerate(held["batch_samples"]):
        held["inputs"] = inputs
        last = i == len(held["batch_samples"]) - 1
        accelerator.gradient_state._set_sync_gradients(last)
        held["tr_loss_step"] = view.training_step(model, inputs, held["num_items_in_batch"])
        del inputs
        if args.logging_nan_inf_filter:  # the loop reads these only to keep NaN out of its logged loss
            torch.isnan(held["tr_loss_step"])
            torch.isinf(held["tr_loss_step"])
        held["tr_loss"] = held["tr_loss"] + held["tr_loss_step"]
    accelerator.gradient_state._set_sync_gradients(True)
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        held["grad_norm"] = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    view.optimizer.step()
    if not accelerator.optimizer_step_was_skipped and not isinstance(
        view.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    ):
        view.lr_scheduler.step()
    model.zero_grad()
    loop.index += 1


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Wrap the copied optimizer's ``step`` as an LR scheduler wraps its optimizer's when it is made
    (``torch/optim/lr_scheduler.py``; a copy of an optimizer does not keep instance attributes), so
    that the copied scheduler's first ``step`` finds the wrapper and does not warn."""
    func = type(optimizer).step
    owner = weakref.ref(optimizer)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer = owner()
        optimizer._opt_called = True  # type: ignore[union-attr]
        return func(optimizer, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


@contextlib.contextmanager
def untouched() -> Iterator[None]:
    """Restore on exit what drawing batches and running copies changes in the user's process: the
    random number generators (torch's CPU and CUDA ones, Python's, NumPy's) and accelerate's shared
    ``GradientState`` (a dataloader registers itself there while it is iterated)."""
    from accelerate.state import GradientState

    shared = GradientState._shared_state
    saved = {key: list(value) if isinstance(value, list) else value for key, value in shared.items()}
    python_state = random.getstate()
    numpy_state = _numpy_state()
    try:
        with torch.random.fork_rng(
            devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []
        ):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)
        shared.clear()
        shared.update(saved)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - transformers requires NumPy
        return None
    return numpy.random.get_state()
