"""``MemlabCallback``: memlab inside ``trainer.train()``. Per step it measures the peak allocated and
reserved bytes and logs them with the trainer's logs; at train begin it estimates the step against a
budget and warns with the ``TrainingArguments`` that fit; on an out-of-memory error it prints
memlab's post-mortem and the ``TrainingArguments`` that fit."""

from __future__ import annotations

import gc
import logging
import sys
import warnings
from typing import Any, TextIO

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import CallbackHandler

from memlab._gpus import GpuLike
from memlab._units import check_count, format_size, parse_size

__all__ = ["MemlabCallback"]

logger = logging.getLogger("memlab")
PREFIX = "memlab/"


def find_trainer(callback: TrainerCallback) -> Trainer | None:
    """The ``Trainer`` whose callbacks include ``callback`` (callbacks are not given their trainer),
    or ``None``: the referrers of ``callback`` (its handler's list), of that list (the
    ``CallbackHandler``), of the handler (the trainer). Not through the callers' frames: reading a
    running frame's ``f_locals`` (Python 3.11) keeps its local variables alive in a snapshot."""
    for handler in _referrers(callback, list, CallbackHandler):
        for trainer in _referrers(handler, Trainer):
            return trainer
    return None


def _referrers(obj: Any, *path: type) -> list[Any]:
    """The objects of type ``path[-1]`` that hold ``obj`` through objects of the types before it
    (an attribute may be held through the owner's ``__dict__``)."""
    found = [obj]
    for kind in path:
        holders = []
        for held in found:
            for referrer in gc.get_referrers(held):
                if type(referrer) is dict and kind is not dict:
                    owners = [
                        o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer
                    ]
                    holders += [owner for owner in owners if isinstance(owner, kind)]
                elif isinstance(referrer, kind):
                    holders.append(referrer)
        found = holders
    return found


class MemlabCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that measures, predicts and explains the memory of
    ``trainer.train()``: ``Trainer(..., callbacks=[MemlabCallback()])``.

    Per optimizer step it measures the peak allocated and reserved bytes (``memory_stats``'
    ``allocated_bytes.all.peak`` / ``reserved_bytes.all.peak`` of that step) and adds to the
    trainer's logs (``on_log``, so TensorBoard, W&B and ``state.log_history`` get them)
    ``memlab/peak_allocated`` and ``memlab/peak_reserved`` (bytes, the highest step since the last
    log) and, on CPU, ``memlab/<category>`` for the ``log_categories`` largest categories at the
    highest allocated total so far (``parameter``, ``activation``, ``optimizer_state``…). On a GPU it
    reads PyTorch's allocator (``torch.cuda.max_memory_allocated``: it resets the device's peak
    counters at each step begin, as there is no other way to read one step's peak); elsewhere a
    :class:`memlab.TensorTracker` it runs from train begin to train end (the CUDA caching allocator
    model, ``gpu``'s cuBLAS workspaces), which counts the model, optimizer state and the loop's
    loss sum from the start. ``per_step`` keeps ``(step, peak allocated, peak reserved)`` of every step.
    It moves itself before the reporting callbacks, so that they see its values.

    At train begin it estimates two optimizer steps (:func:`memlab.integrations.transformers.estimate`)
    and, when their peak reserved bytes exceed ``budget`` (bytes or ``"16 GiB"``; default: the GPU's
    free memory, or the capacity of an active ``TensorTracker``; without either, no check), warns
    (``warnings`` and the ``memlab`` logger) with the ``TrainingArguments`` that fit
    (:func:`~memlab.integrations.transformers.max_batch_size`). While training, an out-of-memory error
    raised in a ``training_step`` or an optimizer step is explained as :func:`memlab.explain_oom`
    explains it (on ``stream``, default stderr), followed by the ``TrainingArguments`` that fit; an
    error there also stops the callback's tracker (``on_train_end`` is not called then). An error
    raised elsewhere in ``train()`` (the dataloader, a callback) leaves it entered: call
    ``on_train_end`` or start training again.
    """

    def __init__(
        self,
        budget: int | str | None = None,
        gpu: GpuLike | None = None,
        log_categories: int = 3,
        stream: TextIO | None = None,
    ) -> None:
        self.budget = None if budget is None else parse_size(budget, name="budget")
        self.gpu = gpu
        self.log_categories = check_count(log_categories, "log_categories", 0)
        self.stream = stream
        self.per_step: list[tuple[int, int, int]] = []
        self.estimate: Any = None  # the estimate made at train begin
        self.warning: str | None = None
        self._tracker: Any = None  # while training
        #: The ``TensorTracker`` of the last training on CPU, readable after it (``None`` on a GPU).
        self.tracker: Any = None
        self._device: torch.device | None = None
        self._unlogged: list[tuple[int, int]] = []
        self._patched: list[tuple[Any, str]] = []

    # -- placement among the callbacks ----------------------------------------------------------
    def _first(self, trainer: Trainer | None) -> None:
        callbacks = trainer.callback_handler.callbacks if trainer is not None else None
        if callbacks and callbacks[0] is not self and self in callbacks:
            callbacks.remove(self)  # the handler's loop goes on at the next index: nobody is skipped
            callbacks.insert(0, self)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._first(find_trainer(self))

    # -- train begin: estimate, then measure -----------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._stop()  # a tracker left entered by a training that failed outside its steps
        trainer = find_trainer(self)
        self._first(trainer)
        self._device = next(model.parameters()).device if model is not None else args.device
        self.per_step, self._unlogged = [], []
        if trainer is not None:
            self._check_budget(trainer)
            self._watch(trainer)
        if self._device.type == "cuda" and torch.cuda.is_available():
            return
        from memlab.sources.tracker import TensorTracker

        self._tracker = TensorTracker(history=self.log_categories > 0, gpu=self.gpu)
        self._tracker.__enter__()
        loss_sum = _loop_loss_sum()
        # What the loop holds at this moment, in the order it made it: the model, its optimizer
        # (state made in the first step), the loss sum.
        self._tracker.adopt(roots=[model])
        self._tracker.adopt(roots=[trainer.optimizer] if trainer is not None else [])
        self._tracker.adopt(roots=[loss_sum])
        if model is not None:
            self._tracker.add_model(model)
        if trainer is not None and trainer.optimizer is not None:
            self._tracker.add_optimizer(getattr(trainer.optimizer, "optimizer", trainer.optimizer))

    def _budget(self) -> int | None:
        if self.budget is not None:
            return self.budget
        from memlab.estimate.fit import default_budget

        try:
            return default_budget(self._device, self.gpu)
        except ValueError:
            return None  # no GPU, no tracker with a capacity: nothing to check against

    def _check_budget(self, trainer: Trainer) -> None:
        from memlab.integrations.transformers import estimate

        budget = self._budget()
        if budget is None:
            return
        self.estimate = estimate(trainer, device=self._device, gpu=self.gpu)
        if self.estimate.fits(budget):
            return
        from memlab.sources.workspace_note import with_note

        peak = format_size(self.estimate.peak_reserved)
        needs = with_note(f"{peak} (estimated peak reserved", self.estimate.workspaces)
        self.warning = (
            f"memlab: an optimizer step of this Trainer needs {needs}) and the "
            f"budget is {format_size(budget)}: {_remedy(trainer, budget, self)}"
        )
        logger.warning(self.warning)
        warnings.warn(self.warning, ResourceWarning, stacklevel=2)

    # -- out-of-memory errors ---------------------------------------------------------------------
    def _watch(self, trainer: Trainer) -> None:
        """Explain an out-of-memory error of a training step or optimizer step: each runs inside an
        :class:`memlab.oom.watch.OOMWatch` (an instance attribute, removed at train end or at the
        error)."""
        for owner, name in ((trainer, "training_step"), (trainer.optimizer, "step")):
            if owner is None or name in vars(owner):
                continue
            setattr(owner, name, self._watched(trainer, getattr(owner, name)))
            self._patched.append((owner, name))

    def _watched(self, trainer: Trainer, method: Any) -> Any:
        from memlab.oom.watch import OOMWatch

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                with OOMWatch(stream=self.stream):
                    return method(*args, **kwargs)
            except BaseException as error:  # train() ends here: on_train_end will not be called
                self._unwatch()
                self._stop()
                budget = self._budget() if isinstance(error, torch.OutOfMemoryError) else None
                if budget is not None:
                    _say(self.stream, f"memlab: {_remedy(trainer, budget, self)}\n")
                raise

        return watched

    def _unwatch(self) -> None:
        for owner, name in self._patched:
            vars(owner).pop(name, None)
        self._patched = []

    # -- per step ---------------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._tracker is not None:
            self._tracker.reset_peak_memory_stats(self._stats_device())
        elif self._device is not None and self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        source = self._tracker if self._tracker is not None else torch.cuda
        device = self._stats_device()
        peaks = (source.max_memory_allocated(device), source.max_memory_reserved(device))
        self.per_step.append((state.global_step, *peaks))
        self._unlogged.append(peaks)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or not self._unlogged:
            return
        values: dict[str, Any] = {
            f"{PREFIX}peak_allocated": max(a for a, _ in self._unlogged),
            f"{PREFIX}peak_reserved": max(r for _, r in self._unlogged),
        }
        self._unlogged = []
        if self._tracker is not None and self.log_categories:
            ranked = sorted(
                self._tracker.by_category(self._stats_device(), at="peak").items(), key=lambda kv: -kv[1]
            )
            values.update({f"{PREFIX}{name}": size for name, size in ranked[: self.log_categories] if size})
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the trainer appended a copy of logs before on_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unwatch()
        self._stop()

    def _stop(self) -> None:
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
            self.tracker = tracker  # its numbers stay readable after training

    def _stats_device(self) -> torch.device:
        if self._tracker is not None:
            devices = self._tracker.devices
            return devices[0] if devices else torch.device("cpu")
        return self._device if self._device is not None else torch.device("cpu")


def _loop_loss_sum() -> torch.Tensor | None:
    """The running ``_inner_training_loop``'s ``tr_loss`` (the loss sum it keeps all along), or
    ``None``. Python 3.11 keeps a frame's ``f_locals`` snapshot, with references to the values it
    read, as long as the frame runs: the snapshot is emptied at once, or it would keep the first
    ``tr_loss`` alive for the whole training (it does not write back to the frame's variables)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop":
            snapshot = frame.f_locals
            found = snapshot.get("tr_loss")
            snapshot.clear()
            return found if isinstance(found, torch.Tensor) else None
        frame = frame.f_back
    return None


def _remedy(trainer: Trainer, budget: int, callback: MemlabCallback) -> str:
    """The ``TrainingArguments`` that fit ``budget``, said as a sentence."""
    from memlab.integrations.transformers import max_batch_size

    fit = max_batch_size(trainer, budget, device=callback._device, gpu=callback.gpu)
    if fit.batch_size == 0:
        return (
            f"even per_device_train_batch_size=1 does not fit in {format_size(budget)}; try "
            "gradient_checkpointing=True, bf16=True or a smaller model"
        )
    if not fit.changes:
        return f"TrainingArguments as they are fit ({fit.batch_size} per device at most)"
    return f"set TrainingArguments({fit.remedy}) to keep the effective batch of {fit.effective_batch}"


def _say(stream: TextIO | None, text: str) -> None:
    (stream or sys.stderr).write(text)
