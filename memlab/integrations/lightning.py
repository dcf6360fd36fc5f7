"""memlab for Lightning: estimate a ``LightningModule``'s training steps under a ``Trainer``'s
configuration, find the largest batch that fits without an out-of-memory error, and log each
step's peak memory from a callback.

A ``training_step`` holds only the forward; :func:`estimate` runs what ``Trainer.fit`` runs around
it (Lightning's closure, backward through the precision plugin, gradient clipping, the optimizer
step and zero_grad, ``accumulate_grad_batches``, manual optimization) on data-free copies
(:mod:`memlab.integrations._lightning_steps`). Lightning is imported by this module only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from memlab._devices import parse_device
from memlab._gpus import GpuLike, resolve_gpu
from memlab._units import check_count
from memlab.estimate.estimate import Estimate, run_estimate
from memlab.estimate.fit import BatchFit, budget_in_bytes, modelled_gpu, search_batch_size
from memlab.integrations._lightning_callback import MemlabCallback
from memlab.plan.flops import Cost
from memlab.plan.result import Plan
from memlab.plan.search import DEFAULT_KNOBS, Outcome
from memlab.plan.settings import Settings

__all__ = ["MemlabCallback", "estimate", "max_batch_size", "plan"]


def estimate(
    trainer: Any,
    module: Any,
    datamodule: Any = None,
    *,
    train_dataloaders: Any = None,
    steps: int = 2,
    device: torch.device | str | None = None,
    gpu: GpuLike | None = None,
) -> Estimate:
    """The memory ``steps`` optimizer steps of ``trainer.fit(module, ...)`` take, estimated without
    running them: an :class:`~memlab.estimate.result.Estimate` (bytes as the CUDA caching allocator
    model counts them: 512 B blocks, cached segments; peaks over all the steps).

    What runs, on data-free copies of ``module`` (the user's module, trainer, optimizers and RNG
    states are left as they were): for each batch, what ``Trainer.fit`` does with it in Lightning
    2.x: ``precision_plugin.convert_input``, the module's batch-transfer hooks, ``training_step``
    under the trainer's precision (``"bf16-mixed"``/``"16-mixed"`` autocast, ``"bf16-true"``
    parameters cast), the loss divided by ``accumulate_grad_batches`` and its detached copy,
    ``optimizer_zero_grad`` at the first batch of each accumulation, backward through the
    precision plugin (a ``GradScaler``'s scaling for ``"16-mixed"``), and on the batch that ends
    an accumulation the module's ``optimizer_step`` (its closure, ``gradient_clip_val``, the
    optimizer and ``interval="step"`` schedulers from ``configure_optimizers`` in any of its return
    forms). With ``automatic_optimization = False`` the ``training_step`` does all of it and
    ``self.optimizers()`` and ``self.manual_backward`` reach the copies. ``self.log`` works: it
    writes into a result collection of the estimate's own (the copy's stand-in trainer,
    :class:`~memlab.integrations._lightning_steps.StandInTrainer`), allocating what it allocates in a
    real run. Lightning's data fetcher reads one batch ahead, so the next batch is alive during each
    step, as here.

    The batches are the first ones of the training dataloader, drawn for real (``train_dataloaders``,
    else ``datamodule.train_dataloader()``, else ``module.train_dataloader()``): as many as the
    steps consume, plus the one fetched ahead. Their tensors are counted from the moment Lightning
    has them: collated on a CPU run, copied to the GPU on a GPU run.

    ``device``: whose kernels and memory to model, ``"cuda"`` by default (the GPU ``gpu`` names, as
    for :func:`memlab.estimate`) whatever device the trainer runs on here; ``"cpu"`` estimates a CPU
    run (equal to a tracked ``trainer.fit()`` on CPU).

    Not seen: callbacks (not run: they belong to the user's run), validation, loggers, what the
    trainer allocates before the first batch and the caveats of :func:`memlab.estimate` (cuDNN
    workspaces, the CUDA context, ...). A step that reads tensor values (``.item()``) runs for real
    on CPU copies (``method="cpu"``; ``forced_by`` says where).
    """
    run, _ = _prepared(trainer, module, datamodule, train_dataloaders, steps, device, gpu)
    return run(None)


def max_batch_size(
    trainer: Any,
    module: Any,
    datamodule: Any = None,
    *,
    budget: int | str | None = None,
    batch_arg_name: str = "batch_size",
    steps: int = 2,
    low: int = 1,
    high: int | None = None,
    headroom: int | str = 0,
    device: torch.device | str | None = None,
    gpu: GpuLike | None = None,
    apply: bool = False,
    progress: bool | None = None,
) -> BatchFit:
    """The largest batch size whose ``steps`` optimizer steps of ``trainer.fit`` fit in ``budget``
    minus ``headroom`` bytes: Lightning's ``BatchSizeFinder`` contract, found by estimates
    (:func:`estimate` under a modelled allocator of that capacity) instead of by running out of
    memory. Returns a :class:`~memlab.estimate.fit.BatchFit`.

    As ``BatchSizeFinder`` does, the batch size is the attribute ``batch_arg_name`` of the
    ``datamodule`` (when it has one), else of ``module``, else of ``module.hparams``, and each size
    is tried through the dataloader that ``train_dataloader()`` builds with it, up to ``high``
    (default: the length of that loader's dataset, where it has one). Sizes are tried on
    shallow copies of that owner: the user's objects keep their value unless ``apply=True``, which
    sets the size found (as ``BatchSizeFinder`` does). Searched by doubling from ``low`` then
    bisection (see :func:`memlab.max_batch_size`); ``budget``: bytes or a size such as
    ``"16 GiB"``, by default :func:`memlab.estimate.fit.default_budget` (the free GPU memory, or the
    active :class:`~memlab.TensorTracker`'s capacity). Dataloaders passed to ``fit`` directly
    cannot be resized: a ``ValueError``, as in Lightning. ``progress``: a line on stderr says which
    batch is being tried (as for :func:`memlab.max_batch_size`: on a terminal, unless ``False`` or
    ``MEMLAB_PROGRESS=0``).
    """
    low = check_count(low, "low", 1)
    if high is not None:
        high = check_count(high, "high", low)
    owner, where = _batch_size_owner(module, datamodule, batch_arg_name)
    target = _device(device)
    limit, extra = budget_in_bytes(budget, headroom, target, modelled_gpu(gpu))

    def sized(size: int) -> tuple[Any, Any]:
        new_owner = _with_batch_size(owner, where, batch_arg_name, size)
        if owner is module:
            return new_owner, datamodule
        return module, new_owner

    def run(size: int, capacity: int | None) -> Estimate:
        return _prepared(trainer, *sized(size), None, steps, device, gpu)[0](capacity)

    if high is None:  # a batch is never larger than the dataset (BatchSizeFinder stops there too)
        high = _dataset_length(_train_loader(*sized(low), None))
        if high is not None:
            high = max(high, low)
    fit = search_batch_size(
        run, limit, extra, steps, low=low, high=high, progress=progress, task="Lightning max_batch_size"
    )
    good = fit.batch_size
    if apply and good:
        _set_batch_size(owner, where, batch_arg_name, good)
    return fit


def plan(
    trainer: Any,
    module: Any,
    datamodule: Any = None,
    *,
    budget: int | str | None = None,
    batch_arg_name: str = "batch_size",
    steps: int = 2,
    device: torch.device | str | None = None,
    gpu: GpuLike | None = None,
    knobs: Iterable[str] = DEFAULT_KNOBS,
) -> Plan:
    """:func:`memlab.plan` for ``trainer.fit(module, datamodule)``: the cheapest change that makes
    ``steps`` optimizer steps (as :func:`estimate` runs them) complete within ``budget`` bytes
    (default as :func:`max_batch_size`'s), with the knobs of :func:`memlab.plan` except autocast (a
    Lightning run's is its ``precision``): the optimizers' ``foreach`` off, the fewest of the
    module's first blocks checkpointed, else micro-batches, which for Lightning are the batch size
    (``batch_arg_name``, found as :func:`max_batch_size` finds it) divided by ``n`` and
    ``accumulate_grad_batches`` multiplied by ``n`` (the same effective batch; ``n`` divides the
    batch size). :attr:`memlab.plan.Plan.arguments` holds those values and :attr:`~memlab.plan.
    Plan.code` says the change; ``plan.apply(module)`` checkpoints the blocks. Nothing of the user's
    objects changes. The FLOPs are those of all ``steps`` steps (Lightning's loop runs them as one
    call). ``ValueError`` for the autocast knob and what :func:`memlab.plan` rejects; what it cannot
    see is what :func:`estimate` cannot."""
    from memlab.plan.checkpointing import candidate_blocks
    from memlab.plan.search import checkpointed, search_plan
    from memlab.plan.settings import call_context

    _check_objects(trainer, module)
    knobs = tuple(knobs) if not isinstance(knobs, str) else knobs
    if "autocast" in knobs:
        raise ValueError(
            "a Lightning run's autocast is its Trainer's precision='bf16-mixed': set it and plan again; "
            "the knobs for Lightning are 'foreach', 'checkpointing', 'micro_batches'"
        )
    limit, _ = budget_in_bytes(budget, 0, _device(device), modelled_gpu(gpu))
    blocks = candidate_blocks(module) if {"selective", "checkpointing"} & set(knobs) else []
    modules = [block for _, block in blocks]
    skip, batch, owner, where = {}, None, None, "attribute"
    try:
        owner, where = _batch_size_owner(module, datamodule, batch_arg_name)
        batch = owner.hparams[batch_arg_name] if where == "hparams" else getattr(owner, batch_arg_name)
    except ValueError as error:
        skip["micro_batches"] = str(error)
    accumulate = trainer.accumulate_grad_batches

    def run(count: int, settings: Settings) -> Outcome:
        flops: list[Cost] = []
        split = settings.micro_batches
        job, data, accumulating = module, datamodule, trainer
        if split > 1:
            resized = _with_batch_size(owner, where, batch_arg_name, batch // split)
            job, data = (resized, datamodule) if owner is module else (module, resized)
            accumulating = copy.copy(trainer)
            accumulating.accumulate_grad_batches = accumulate * split
        with checkpointed(modules[:count], settings.selective):
            run_steps, _ = _prepared(
                accumulating,
                job,
                data,
                None,
                steps,
                device,
                gpu,
                call_context(settings, flops, resolve_gpu(gpu)),
            )
            found = run_steps(None)
            return found, flops[-1], found.under(limit)

    found = search_plan(
        run,
        blocks,
        limit,
        knobs=knobs,
        skip=skip,
        batch=batch,
        gpu=resolve_gpu(gpu),
    )
    found.device_type, found.trainer = _device(device).type, "lightning"
    if found.micro_batches > 1:
        found.arguments = {
            batch_arg_name: batch // found.micro_batches,
            "accumulate_grad_batches": accumulate * found.micro_batches,
        }
    return found


def _device(device: torch.device | str | None) -> torch.device:
    return parse_device("cuda" if device is None else device, name="device")


def _prepared(
    trainer: Any,
    module: Any,
    datamodule: Any,
    train_dataloaders: Any,
    steps: int,
    device: torch.device | str | None,
    gpu: GpuLike | None,
    call_context: Any = None,
) -> tuple[Any, Any]:
    """``(run, plan)``: ``run(capacity)`` estimates the steps (under a modelled allocator of
    ``capacity`` bytes, or none), on batches drawn now; ``call_context`` as for
    :func:`memlab.estimate.estimate.run_estimate` (the loop is one call)."""
    from memlab.integrations import _lightning_steps as loop

    _check_objects(trainer, module)
    steps = check_count(steps, "steps", 1)
    target = _device(device)
    modelled = modelled_gpu(gpu)
    if train_dataloaders is not None and _is_datamodule(train_dataloaders):
        datamodule, train_dataloaders = train_dataloaders, None
    manual = not module.automatic_optimization
    accumulate = trainer.accumulate_grad_batches
    if manual and accumulate != 1:
        raise ValueError(
            f"accumulate_grad_batches={accumulate} with manual optimization: Lightning does not accumulate "
            f"for "
            f"a module with automatic_optimization = False; use accumulate_grad_batches=1"
        )
    with _rng_kept():
        loader = _train_loader(module, datamodule, train_dataloaders)
        length = _length(loader)
        plan = loop.schedule(steps, accumulate, length, manual)
        drawn = _draw(loader, len(plan.step) + plan.prefetched[-1])
    if len(drawn) < len(plan.step) + plan.prefetched[-1] and len(drawn) < len(plan.step):
        raise ValueError(
            f"the training dataloader gave {len(drawn)} batch(es); {steps} optimizer step(s) with "
            f"accumulate_grad_batches={accumulate} need {len(plan.step)}"
        )
    if len(drawn) < len(plan.step) + plan.prefetched[-1]:  # an unsized loader that ended: nothing ahead
        plan = dataclasses.replace(plan, prefetched=(*plan.prefetched[:-1], False))
    plugin = _plugin_for(trainer.precision_plugin, target)
    at_transfer = target.type != "cpu"
    cuda_defaults = target.type == "cuda" and not torch.cuda.is_available()
    made: list[Any] = []

    def arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
        sources = [tree_map_only(torch.Tensor, torch.Tensor.clone, batch) for batch in drawn]
        if at_transfer:
            sources = [plugin.convert_input(batch) for batch in sources]
        made.append(loop.Batches(sources, at_transfer, cuda_defaults))
        return (module, made[-1], plan, trainer, plugin), {}

    def run(capacity: int | None) -> Estimate:
        made.clear()
        with _rng_kept(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")
            built = run_estimate(
                loop.fit_steps, arguments, target, capacity=capacity, gpu=modelled, call_context=call_context
            )
        if made and made[-1].optimizer_defaults:
            built.substituted["optimizer_foreach"] = made[-1].optimizer_defaults
        return built

    return run, plan


def _check_objects(trainer: Any, module: Any) -> None:
    import lightning.pytorch as pl

    if not isinstance(trainer, pl.Trainer):
        raise TypeError(f"trainer must be a lightning.pytorch.Trainer, got {type(trainer).__name__}")
    if not isinstance(module, pl.LightningModule):
        raise TypeError(f"module must be a lightning.pytorch.LightningModule, got {type(module).__name__}")


def _is_datamodule(obj: Any) -> bool:
    import lightning.pytorch as pl

    return isinstance(obj, pl.LightningDataModule)


def _train_loader(module: Any, datamodule: Any, train_dataloaders: Any) -> Any:
    """The training dataloader ``Trainer.fit`` would use: the one given, else the datamodule's,
    else the module's. An owner whose ``train_dataloader()`` needs its ``setup("fit")`` first (a
    dataset made there) is set up as a shallow copy, so the user's object is not changed."""
    if train_dataloaders is not None:
        return train_dataloaders
    if datamodule is not None and not _is_datamodule(datamodule):
        raise TypeError(
            f"datamodule must be a lightning.pytorch.LightningDataModule, got {type(datamodule).__name__}"
        )
    owner = datamodule if datamodule is not None else module
    try:
        return owner.train_dataloader()
    except NotImplementedError:
        raise ValueError(
            f"{type(owner).__name__} defines no train_dataloader(): pass train_dataloaders= or a datamodule"
        ) from None
    except Exception:
        ready = copy.copy(owner)
        ready.setup("fit")
        return ready.train_dataloader()


def _dataset_length(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _draw(loader: Any, count: int) -> list[Any]:
    """The first ``count`` batches, epoch after epoch (a loader shorter than ``count`` starts again)."""
    drawn: list[Any] = []
    while len(drawn) < count:
        before = len(drawn)
        for batch in loader:
            drawn.append(batch)
            if len(drawn) == count:
                break
        if len(drawn) == before:
            break  # an empty loader
        if _length(loader) is None:
            break  # an unsized loader is not started again
    return drawn


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """The random states of torch (CPU and CUDA), Python and NumPy, put back on exit: drawing
    batches (a shuffling sampler) and running steps (dropout) leave the user's streams where they were."""
    state = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _plugin_for(plugin: Any, target: torch.device) -> Any:
    """The trainer's precision plugin for the estimate: a scaler of its own, and autocast on the
    target device's type (a CPU trainer's ``"bf16-mixed"`` estimated for a GPU casts as CUDA does)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from memlab.integrations._lightning_steps import precision_copy

    if isinstance(plugin, MixedPrecision) and plugin.device != target.type and target.type != "meta":
        scaler = None
        if plugin.scaler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "CUDA is not available": memlab's estimate enables it
                scaler = torch.amp.GradScaler(target.type, init_scale=plugin.scaler.get_scale())
        return MixedPrecision(plugin.precision, target.type, scaler=scaler)
    return precision_copy(plugin)


# -- the batch size -------------------------------------------------------------------------------


def _batch_size_owner(module: Any, datamodule: Any, name: str) -> tuple[Any, str]:
    """``(object, "attribute" | "hparams")`` holding ``name``, in ``BatchSizeFinder``'s order."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"batch_arg_name must be an attribute name, got {name!r}")
    if datamodule is not None and hasattr(datamodule, name):
        return datamodule, "attribute"
    if name in vars(module) or hasattr(type(module), name):
        return module, "attribute"
    hparams = getattr(module, "hparams", None)
    if hparams is not None and name in hparams:
        return module, "hparams"
    raise ValueError(
        f"Field {name!r} not found in the module, the datamodule, nor the module's hparams: the batch "
        f"size is "
        f"searched by setting it there (batch_arg_name names the attribute)"
    )


def _with_batch_size(owner: Any, where: str, name: str, size: int) -> Any:
    """A shallow copy of ``owner`` whose batch size is ``size`` (its ``hparams`` copied too)."""
    new = copy.copy(owner)
    if where == "hparams":
        hparams = copy.copy(owner.hparams)
        hparams[name] = size
        new._hparams = hparams
    else:
        setattr(new, name, size)
    return new


def _set_batch_size(owner: Any, where: str, name: str, size: int) -> None:
    if where == "hparams":
        owner.hparams[name] = size
    else:
        setattr(owner, name, size)
