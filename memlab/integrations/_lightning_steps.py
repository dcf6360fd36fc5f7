"""Lightning's training loop, step for step, on an estimate's copies of a ``LightningModule``.

:func:`fit_steps` is the plain step function :mod:`memlab.integrations.lightning` estimates: the
optimizer steps ``Trainer.fit`` runs (``loops/training_epoch_loop.py`` and
``loops/optimization/automatic.py`` of Lightning 2.x), with Lightning's own closure, loss
normalisation, precision plugin, logging collection and hooks, on a copy of the module. The copy
gets a stand-in trainer (:class:`StandInTrainer`) in place of the user's: ``self.log`` writes into a
collection of its own, ``self.optimizers()`` and ``manual_backward`` reach the copy's optimizers,
and nothing the user's trainer holds is read or written but its configuration.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.loops.optimization.manual import ManualResult
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from torch.utils._pytree import tree_map_only

__all__ = ["Schedule", "StandInTrainer", "fit_steps", "schedule"]

#: The user's trainer's settings a module may read through ``self.trainer`` during an estimate.
CONFIGURATION = (
    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "precision",
    "max_steps", "max_epochs", "min_steps", "min_epochs", "num_nodes", "num_devices",
    "log_every_n_steps", "default_root_dir", "fast_dev_run", "limit_train_batches",
)  # fmt: skip


@dataclass(frozen=True)
class Schedule:
    """What ``Trainer.fit`` does with each batch, in order: ``zero_grad[i]`` (before its backward),
    ``step[i]`` (an optimizer step after it), ``prefetched[i]`` (the next batch is fetched before it
    runs: Lightning's fetcher reads one batch ahead from a loader without a length)."""

    zero_grad: tuple[bool, ...]
    step: tuple[bool, ...]
    prefetched: tuple[bool, ...]
    batch_idx: tuple[int, ...]  # the batch's index in its epoch
    epoch_end: tuple[bool, ...]


def schedule(steps: int, accumulate: int, epoch_length: int | None, manual: bool) -> Schedule:
    """The batches of ``steps`` optimizer steps with ``accumulate_grad_batches=accumulate`` over a
    dataloader of ``epoch_length`` batches (``None``: unsized); the last batch of an epoch steps
    whatever the accumulation (Lightning's ``_should_accumulate``). Manual optimization: one batch
    per step, the step inside ``training_step``."""
    zero, step, ahead, indices, ends = [], [], [], [], []
    in_epoch = done = 0
    while done < steps:
        indices.append(in_epoch)
        last = epoch_length is not None and in_epoch + 1 == epoch_length
        zero.append(in_epoch % accumulate == 0)
        stepping = manual or (in_epoch + 1) % accumulate == 0 or last
        step.append(stepping)
        done += stepping
        # Lightning's fetcher reads one batch ahead only from an unsized loader, to see its end
        # coming (loops/fetchers.py: _PrefetchDataFetcher), whether or not another step follows.
        ahead.append(epoch_length is None)
        ends.append(last)
        in_epoch = 0 if last else in_epoch + 1
    return Schedule(tuple(zero), tuple(step), tuple(ahead), tuple(indices), tuple(ends))


class _StandInStrategy:
    """What a ``LightningModule`` and Lightning's precision plugins ask of ``trainer.strategy``
    during a training step (``strategies/strategy.py``), for one process on the copy."""

    handles_gradient_accumulation = False
    is_global_zero = True

    def __init__(self, trainer: StandInTrainer, precision_plugin: Any) -> None:
        self._trainer = trainer
        self.precision_plugin = precision_plugin
        self._lightning_optimizers: list[LightningOptimizer] = []

    @property
    def lightning_module(self) -> Any:
        return self._trainer.lightning_module

    model = lightning_module

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        module = model if model is not None else self.lightning_module
        return self.precision_plugin.optimizer_step(optimizer, model=module, closure=closure, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


class StandInTrainer:
    """The trainer an estimate's copy of a ``LightningModule`` sees as ``self.trainer``.

    The user's trainer holds the user's module, optimizers and logged values: the copy must reach
    none of them. This stand-in answers what a training step and Lightning's plugins ask: its
    ``strategy`` (backward and optimizer steps through the trainer's precision plugin),
    ``optimizers`` (the copy's, from ``configure_optimizers``), a ``_results`` collection and a
    logger connector of its own (``self.log`` works and allocates as in a real run; nothing reaches
    the user's loggers), ``global_step`` and ``current_epoch`` counted from 0, and the user's
    trainer's settings (:data:`CONFIGURATION`) read from it. Callbacks are not run (they belong to
    the user's run and may change its state). Anything else is an ``AttributeError`` that says so.
    """

    training = True
    sanity_checking = False
    barebones = False
    world_size = 1
    global_rank = 0
    local_rank = 0
    node_rank = 0
    is_global_zero = True
    callbacks: list[Any] = []  # noqa: RUF012 (never appended to)
    loggers: list[Any] = []  # noqa: RUF012
    logger = None

    def __init__(self, trainer: Any, module: Any, precision_plugin: Any) -> None:
        self._user_trainer = trainer
        self.lightning_module = module
        self.precision_plugin = precision_plugin
        self.strategy = _StandInStrategy(self, precision_plugin)
        self.profiler = PassThroughProfiler()
        self._results = _ResultCollection(training=True)
        self._logger_connector = _LoggerConnector(self)  # type: ignore[arg-type]
        self._accelerator_connector = types.SimpleNamespace(is_distributed=False)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[Any] = []
        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False

    def __getattr__(self, name: str) -> Any:
        if name in CONFIGURATION:
            return getattr(self._user_trainer, name)
        raise AttributeError(
            f"the module's copy in a memlab estimate runs with a stand-in trainer, which has no {name!r}: it "
            f"offers strategy, optimizers, lr_scheduler_configs, global_step, current_epoch, self.log and "
            f"the "
            f"trainer's settings {', '.join(CONFIGURATION)}"
        )


def precision_copy(plugin: Any) -> Any:
    """The trainer's precision plugin for the copy: the same plugin, but a ``GradScaler`` of its own
    (``16-mixed``), started at the user's scaler's current scale, so that its updates stay in the
    estimate. Its tensors are made when the copy's first backward scales a loss, as on a fresh run."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None:
        return plugin
    new_scaler = copy.copy(scaler)
    scale = scaler._scale
    if scale is not None:
        new_scaler._init_scale = float(scale.detach().cpu())
        new_scaler._init_growth_tracker = int(scaler._growth_tracker.detach().cpu())
    new_scaler._scale = None
    new_scaler._growth_tracker = None
    new_scaler._per_optimizer_states = copy.deepcopy(scaler._per_optimizer_states)
    new_scaler._per_optimizer_states.clear()
    new = copy.copy(plugin)
    new.scaler = new_scaler
    return new


class Batches:
    """The batches an estimate feeds, made before the run and not counted (the dataset and the
    host memory they come from); :meth:`fetch` makes the counted copy at the moment Lightning's
    loop would have it: at collation on a CPU run, at the transfer to the device on a GPU."""

    def __init__(self, batches: list[Any], at_transfer: bool, cuda_defaults: bool = False) -> None:
        self.sources = batches
        self.at_transfer = at_transfer
        #: Give the optimizers ``configure_optimizers`` makes the implementation CUDA would choose
        #: (:func:`memlab.estimate.kernels.cuda_optimizer_defaults`): an estimate for CUDA here.
        self.cuda_defaults = cuda_defaults
        #: How many optimizers got CUDA's defaults (for the estimate's ``substituted``).
        self.optimizer_defaults = 0

    def fetch(self, index: int) -> Any:
        return tree_map_only(torch.Tensor, torch.Tensor.clone, self.sources[index])


def fit_steps(module: Any, batches: Batches, plan: Schedule, trainer: Any, plugin: Any) -> None:
    """Run ``module`` (a copy) through the batches of ``plan`` as ``Trainer.fit`` would."""
    stand_in = StandInTrainer(trainer, module, plugin)
    module._trainer = stand_in
    _convert_module(plugin, module)
    optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    stand_in.optimizers, stand_in.lr_scheduler_configs = optimizers, schedulers
    if batches.cuda_defaults:
        from memlab.estimate.kernels import cuda_optimizer_defaults

        batches.optimizer_defaults = sum(bool(cuda_optimizer_defaults(o)) for o in optimizers)
    strategy = stand_in.strategy
    strategy._lightning_optimizers = [
        LightningOptimizer._to_lightning_optimizer(o, strategy) for o in optimizers
    ]
    if module.automatic_optimization and len(optimizers) != 1:
        raise ValueError(
            f"automatic optimization steps exactly one optimizer, configure_optimizers gave "
            f"{len(optimizers)}: set automatic_optimization = False to step several"
        )
    connector, results = stand_in._logger_connector, stand_in._results
    call._call_lightning_module_hook(stand_in, "on_train_start")
    fetched: dict[int, Any] = {}
    for index, batch_idx in enumerate(plan.batch_idx):
        if index not in fetched:
            fetched[index] = _fetch(batches, index)
        if plan.prefetched[index]:
            fetched[index + 1] = _fetch(batches, index + 1)
        batch = _transfer(stand_in, batches, fetched.pop(index))
        connector.on_batch_start(batch)
        call._call_lightning_module_hook(stand_in, "on_train_batch_start", batch, batch_idx)
        if module.automatic_optimization:
            output = _automatic(stand_in, batch, batch_idx, plan.zero_grad[index], plan.step[index])
        else:
            output = _manual(stand_in, batch, batch_idx)
        if plan.step[index]:
            _step_schedulers(stand_in, batch_idx)
        call._call_lightning_module_hook(stand_in, "on_train_batch_end", output, batch, batch_idx)
        connector.on_batch_end()
        del batch, output
        if plan.step[index]:
            stand_in.global_step += 1
        if plan.epoch_end[index]:
            stand_in.current_epoch += 1
            connector.epoch_end_reached()
            connector.on_epoch_end()
            results.reset()


def _convert_module(plugin: Any, module: Any) -> None:
    """The precision plugin's ``convert_module``, as the trainer's setup runs it before training
    (``"bf16-true"``/``"16-true"``: the floating-point parameters and buffers cast). ``HalfPrecision``
    does it by ``module.to(dtype)``, which cannot swap fake parameters; here each one's ``.data`` is
    replaced, which is what ``module.to`` does to plain tensors (the old storage freed at once)."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    if not isinstance(plugin, HalfPrecision):
        plugin.convert_module(module)
        return
    dtype = plugin._desired_input_dtype
    with torch.no_grad():
        for sub in module.modules():
            for tensor in (*sub._parameters.values(), *sub._buffers.values()):
                if tensor is not None and tensor.is_floating_point():
                    tensor.data = tensor.data.to(dtype)


def _fetch(batches: Batches, index: int) -> Any:
    return batches.sources[index] if batches.at_transfer else batches.fetch(index)


def _transfer(trainer: StandInTrainer, batches: Batches, batch: Any) -> Any:
    """``precision.convert_input``, ``on_before_batch_transfer``, the copy to the device,
    ``on_after_batch_transfer`` (``training_epoch_loop.advance``). On a GPU the batches were
    converted when drawn (the conversion runs in host memory)."""
    if not batches.at_transfer:
        batch = trainer.precision_plugin.convert_input(batch)
    batch = call._call_lightning_module_hook(trainer, "on_before_batch_transfer", batch, 0)
    if batches.at_transfer:
        batch = tree_map_only(torch.Tensor, torch.Tensor.clone, batch)
    return call._call_lightning_module_hook(trainer, "on_after_batch_transfer", batch, 0)


def _automatic(
    trainer: StandInTrainer, batch: Any, index: int, zero_grad: bool, step: bool
) -> dict[str, Any]:
    """``_AutomaticOptimization.run``: Lightning's own closure (training step, the loss divided by
    ``accumulate_grad_batches`` and its detached clone, zero_grad, backward), inside the module's
    ``optimizer_step`` hook when the batch steps."""
    module, strategy = trainer.lightning_module, trainer.strategy
    optimizer = strategy._lightning_optimizers[0]
    accumulate = trainer.accumulate_grad_batches

    def step_fn() -> ClosureResult:
        module._current_fx_name = "training_step"
        output = strategy.training_step(batch, index)
        return ClosureResult.from_training_step_output(output, accumulate)

    def backward_fn(loss: torch.Tensor) -> None:
        strategy.backward(loss, optimizer.optimizer)

    def zero_grad_fn() -> None:
        call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer.optimizer)
        call._call_lightning_module_hook(
            trainer, "optimizer_zero_grad", trainer.current_epoch, index, optimizer.optimizer
        )

    closure = Closure(step_fn, backward_fn, zero_grad_fn if zero_grad else None)
    if step:
        call._call_lightning_module_hook(
            trainer, "optimizer_step", trainer.current_epoch, index, optimizer, closure
        )
    else:
        closure()
    result = closure.consume_result()
    return {} if result.loss is None else result.asdict()


def _manual(trainer: StandInTrainer, batch: Any, index: int) -> dict[str, Any]:
    """``_ManualOptimization.run``: the training step does it all."""
    trainer.lightning_module._current_fx_name = "training_step"
    output = trainer.strategy.training_step(batch, index)
    return ManualResult.from_training_step_output(output).asdict()


def _step_schedulers(trainer: StandInTrainer, index: int) -> None:
    """The ``interval="step"`` schedulers after an optimizer step (plateau schedulers need a
    monitored metric and change no memory: skipped)."""
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step" and not config.reduce_on_plateau and (index + 1) % config.frequency == 0:
            call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)
