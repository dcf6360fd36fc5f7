"""``MemlabCallback``: a Lightning callback that logs each training batch's peak memory and warns,
before the first step, when the estimated steps will not fit the budget."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback

from memlab._gpus import GpuLike
from memlab._units import format_size, parse_size

__all__ = ["MemlabCallback"]


class MemlabCallback(Callback):
    """``Trainer(callbacks=[MemlabCallback()])``: per training batch, the peak allocated and
    reserved bytes of the run's device, logged to the trainer's loggers as
    ``memlab/peak_allocated`` and ``memlab/peak_reserved`` (bytes; ``step`` the trainer's
    ``global_step``) and kept in :attr:`peaks` (one dict per batch: ``batch_idx``, ``global_step``,
    ``peak_allocated``, ``peak_reserved``).

    A batch's peak is the highest value from the end of the previous batch (the start of training
    for the first) to the end of this one, so it covers the fetch of the next batch, the forward,
    backward and optimizer step. On a CUDA device it is read from ``torch.cuda.max_memory_allocated``
    / ``max_memory_reserved``, whose peaks the callback resets after each batch (CUDA has no other
    way; a user's own ``max_memory_allocated()`` then reads from the last batch on). Elsewhere a
    :class:`memlab.TensorTracker` runs from ``on_train_start`` to the end of training, counting the
    module's parameters from the start and every tensor of the run through the CUDA caching
    allocator model of ``gpu``, so the numbers are those a GPU would show for the same run. The
    values are passed to the loggers as Python ints (``self.log`` would allocate tensors inside
    the step it measures).

    At fit start the callback estimates the steps (:func:`memlab.integrations.lightning.estimate`,
    two optimizer steps, for ``device``: default ``cuda`` when the trainer runs on a GPU or ``gpu``
    is named, else the trainer's device) and warns, with a remedy, when its peak reserved bytes
    exceed ``budget`` (bytes or a size such as ``"16 GiB"``; default: the free GPU memory, or the
    active :class:`~memlab.TensorTracker`'s capacity; no check when none is known). The estimate is
    kept in :attr:`estimate`.
    """

    def __init__(
        self, budget: int | str | None = None, gpu: GpuLike | None = None, *, device: str | None = None
    ) -> None:
        super().__init__()
        self.budget = None if budget is None else parse_size(budget, name="budget")
        self.gpu = gpu
        self.device = device
        self.peaks: list[dict[str, int]] = []
        self.estimate: Any = None
        self._tracker: Any = None

    # -- the check before training ------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from memlab.estimate.fit import default_budget, modelled_gpu
        from memlab.integrations.lightning import estimate

        device = self._target(trainer)
        budget = self.budget
        if budget is None:
            try:
                budget = default_budget(torch.device(device), modelled_gpu(self.gpu))
            except ValueError:
                budget = None
        source = trainer.fit_loop._data_source.instance
        loaders = None if source is pl_module or source is trainer.datamodule else source
        self.estimate = estimate(
            trainer, pl_module, trainer.datamodule, train_dataloaders=loaders, device=device, gpu=self.gpu
        )
        if budget is not None and not self.estimate.fits(budget):
            needed, workspaces = self.estimate.peak_reserved, self.estimate.workspaces
            warnings.warn(_does_not_fit(needed, budget, trainer, pl_module, workspaces), stacklevel=2)

    def _target(self, trainer: Any) -> str:
        if self.device is not None:
            return self.device
        if trainer.strategy.root_device.type == "cuda" or self.gpu is not None:
            return "cuda"
        return trainer.strategy.root_device.type

    # -- per-batch peaks ------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._on_cuda(trainer):
            return
        import memlab

        self._tracker = memlab.TensorTracker(gpu=self.gpu)
        self._tracker.__enter__()
        self._tracker.adopt(roots=[pl_module])
        self._tracker.adopt(roots=trainer.optimizers)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._on_cuda(trainer):
            index = trainer.strategy.root_device
            allocated, reserved = (
                torch.cuda.max_memory_allocated(index),
                torch.cuda.max_memory_reserved(index),
            )
            torch.cuda.reset_peak_memory_stats(index)
        elif self._tracker is not None:
            tracker = self._tracker
            allocated, reserved = tracker.max_memory_allocated(), tracker.max_memory_reserved()
            tracker.reset_peak_memory_stats()
        else:
            return
        record = {
            "batch_idx": batch_idx,
            "global_step": trainer.global_step,
            "peak_allocated": allocated,
            "peak_reserved": reserved,
        }
        self.peaks.append(record)
        metrics = {"memlab/peak_allocated": allocated, "memlab/peak_reserved": reserved}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)

    @staticmethod
    def _on_cuda(trainer: Any) -> bool:
        return trainer.strategy.root_device.type == "cuda"


def _does_not_fit(needed: int, budget: int, trainer: Any, module: Any, workspaces: Any = None) -> str:
    """The warning: what the steps need (and the modelled cuBLAS workspaces that includes), the
    budget, and what to change in the trainer's terms."""
    from memlab.sources.workspace_note import workspaces_note

    note = workspaces_note(workspaces)
    text = (
        f"memlab: the training steps are estimated to need {format_size(needed)} reserved"
        + ("" if note is None else f" ({note})")
        + f", more than the budget of {format_size(budget)}. "
    )
    size = getattr(module, "batch_size", None)
    hparams = getattr(module, "hparams", None)
    if size is None and hparams is not None and "batch_size" in hparams:
        size = hparams["batch_size"]
    accumulate = trainer.accumulate_grad_batches
    if isinstance(size, int) and size > 1:
        smaller = max(1, math.floor(size * budget / needed))
        factor = math.ceil(size / smaller)
        text += (
            f"Lower batch_size={size} (memlab.integrations.lightning.max_batch_size(trainer, module, "
            f"budget=...) finds the largest that fits, about {smaller} by proportion) and raise "
            f"accumulate_grad_batches from "
            f"{accumulate} to {accumulate * factor} to keep the effective batch"
        )
    else:
        text += "Lower the batch size and raise accumulate_grad_batches to keep the effective batch"
    if str(trainer.precision) in ("32-true", "32"):
        text += ", or train with precision='bf16-mixed'"
    return text + "."
