"""One training step of a model built from its config (:mod:`memlab.integrations.models`),
estimated data-free: the engine of ``memlab estimate``.

:func:`estimate_training` builds the model, its optimizer and a batch under the estimate's
``FakeTensorMode`` (``make_arguments`` of :func:`memlab.estimate.estimate.run_estimate`), wraps the
model as a sharded job would (FSDP2's ``fully_shard`` on each repeated block and then on the root,
as torchtitan does, or DDP) inside :func:`memlab.distributed.fake_group`, and estimates
:func:`training_step` on the GPU modelled. :func:`largest_batch` searches the largest batch that
fits, as :func:`memlab.max_batch_size` does, building the model again for each size (a model made
under one estimate's fake mode cannot be used under another's).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memlab._gpus import DEFAULT_GPU, GPU
from memlab._units import check_count
from memlab.estimate.estimate import Estimate, run_estimate
from memlab.estimate.fit import BatchFit, search_batch_size
from memlab.integrations.models import ModelRecipe
from memlab.plan.checkpointing import candidate_blocks, checkpoint
from memlab.plan.flops import Cost
from memlab.plan.result import Plan
from memlab.plan.search import DEFAULT_KNOBS, Outcome, search_plan
from memlab.plan.settings import AS_IT_IS, Settings, call_context

__all__ = [
    "OPTIMIZERS",
    "ParameterCount",
    "TrainingSetup",
    "estimate_training",
    "largest_batch",
    "plan_training",
    "training_step",
]

#: ``--optimizer`` name -> how it is built (PyTorch's defaults otherwise; ``foreach`` left to
#: PyTorch, which picks the foreach kernels for CUDA tensors, as an estimate for CUDA models).
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}
_PARALLEL = (None, "fsdp", "ddp")


@dataclass(frozen=True)
class TrainingSetup:
    """What one training step does: ``batch_size`` x ``seq_len`` tokens (``seq_len`` ignored for
    images), parameters of ``dtype``, the forward under CUDA autocast to ``autocast`` (``None``:
    off), ``optimizer`` (a key of :data:`OPTIMIZERS`), activation checkpointing, ``parallel``
    (``"fsdp"``, ``"ddp"`` or ``None``) over ``world_size`` ranks, ``steps`` steps in a row, on
    ``gpu``."""

    batch_size: int = 1
    seq_len: int | None = None
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    world_size: int = 1
    parallel: str | None = None
    steps: int = 1
    gpu: GPU = DEFAULT_GPU

    def __post_init__(self) -> None:
        for name in ("batch_size", "world_size", "steps"):
            check_count(getattr(self, name), name, 1)
        if self.seq_len is not None:
            check_count(self.seq_len, "seq_len", 1)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if self.parallel not in _PARALLEL:
            raise ValueError(f"parallel must be None, 'fsdp' or 'ddp'; got {self.parallel!r}")


@dataclass
class ParameterCount:
    """The model's parameters, counted before any sharding: ``total`` (tied weights once) and
    ``largest_layer`` (the most any one module holds itself, DeepSpeed's ``largest_layer_params``)."""

    total: int = 0
    largest_layer: int = 0
    model_class: str = ""
    counted: bool = field(default=False, repr=False)

    def count(self, model: torch.nn.Module) -> None:
        """Count ``model``'s parameters, once (later calls, for other batch sizes, keep the first)."""
        if self.counted:
            return
        self.total = sum({id(p): p.numel() for p in model.parameters()}.values())
        self.largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        self.model_class = type(model).__name__
        self.counted = True


def training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    *,
    autocast: torch.dtype | None = None,
    own_loss: bool = True,
) -> torch.Tensor:
    """Forward (under ``torch.autocast("cuda", autocast)`` when given), backward, optimizer step,
    gradients set to ``None``; returns the loss. ``own_loss``: the model computes its loss from
    ``batch``'s ``labels`` (Hugging Face), else it is the cross entropy of ``model(batch["images"])``."""
    region = torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with region:
        if own_loss:
            loss = model(**batch).loss
        else:
            loss = torch.nn.functional.cross_entropy(model(batch["images"]), batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _device() -> torch.device:
    """Where the fake tensors stand: CUDA where there is a GPU, else CPU (whose fake tensors an
    estimate for ``cuda`` runs with CUDA's kernel choices)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _wrap(model: torch.nn.Module, recipe: ModelRecipe, setup: TrainingSetup, mesh: Any) -> torch.nn.Module:
    if setup.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # init_sync off: checking and broadcasting the ranks' parameters reads their data; the
        # estimate's copier wraps a copy again, its reducer's buckets counted (estimate.sharded).
        return DistributedDataParallel(model, init_sync=False)
    if setup.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in _blocks(model, recipe.layer_classes):
            fully_shard(module, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return model


def _blocks(model: torch.nn.Module, layer_classes: tuple[str, ...]) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the modules of the classes the library names
    (``layer_classes``), else the entries of the model's ``ModuleList``s (``model.layers``,
    ``encoder.layer``: where models keep their blocks)."""
    if layer_classes:
        return [m for m in model.modules() if m is not model and type(m).__name__ in layer_classes]
    return [m for holder in model.modules() if isinstance(holder, torch.nn.ModuleList) for m in holder]


def _arguments(
    recipe: ModelRecipe,
    setup: TrainingSetup,
    batch_size: int,
    counted: ParameterCount,
    mesh: Any,
    checkpointed: int = 0,
    selective: bool = False,
) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    """``make()`` for an estimate: the model built, its first ``checkpointed`` blocks
    (:func:`memlab.plan.checkpointing.candidate_blocks`) checkpointed (``selective``: keeping the
    matmuls' and attention's outputs), wrapped, with its optimizer and a batch."""

    def make() -> tuple[tuple[Any, ...], dict[str, Any]]:
        with torch.device(_device()):
            model = recipe.build(setup.dtype)
            counted.count(model)
            if setup.gradient_checkpointing:
                recipe.enable_checkpointing(model)
            checkpoint([module for _, module in candidate_blocks(model)[:checkpointed]], selective)
            model = _wrap(model, recipe, setup, mesh)
            optimizer = OPTIMIZERS[setup.optimizer](model.parameters())
            batch = recipe.batch(batch_size, setup.seq_len, setup.dtype)
        gc.freeze()  # the model lives through the estimate: out of full collections too (see _job)
        return (model, optimizer, batch), {}

    return make


@contextlib.contextmanager
def _job(recipe: ModelRecipe, setup: TrainingSetup) -> Iterator[Any]:
    """The context the estimates run in: the library's warnings off, the garbage collector's full
    collections spared what lives throughout, and for a sharded job a
    :func:`~memlab.distributed.fake_group` of ``setup.world_size`` ranks. Yields the device mesh
    FSDP2 shards over (``None`` without FSDP)."""
    # The objects made before (the imports': torch's and transformers', hundreds of thousands) and
    # each model built (``make`` freezes it) are left out of full collections while the estimates
    # run: each would scan them all again, to find no garbage (0.5-0.9 CPU s of an 8B or 70B
    # model's estimate; benchmarks/bench_estimate_command.py). Garbage the steps make is collected
    # as before; everything frozen is handed back to the collector at the end.
    # Frozen inside the group, handed back before it ends: objects frozen are out of
    # gc.get_objects(), where the group's end looks for the device meshes to disown.
    with recipe.quiet(), warnings.catch_warnings():
        # copy.deepcopy of FSDP2's modules asks each fake tensor for its data pointer; harmless
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        # FSDP2's advice on blocks that return views (in-place ops on them skip its hooks): the
        # model's own code, which a memory estimate neither changes nor needs
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        with _group(setup) as mesh:
            gc.freeze()
            try:
                yield mesh
            finally:
                gc.unfreeze()


@contextlib.contextmanager
def _group(setup: TrainingSetup) -> Iterator[Any]:
    """A :func:`~memlab.distributed.fake_group` for a sharded job, and under FSDP its device mesh,
    made here, outside the estimate's fake mode, since a mesh reads its tensor of ranks."""
    if setup.parallel is None:
        yield None
        return
    from memlab.distributed import fake_group

    with fake_group(setup.world_size):
        if setup.parallel != "fsdp":
            yield None
            return
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh(_device().type, (setup.world_size,))


def _estimate(
    recipe: ModelRecipe,
    setup: TrainingSetup,
    batch_size: int,
    capacity: int | None,
    counted: ParameterCount,
    mesh: Any,
    checkpointed: int = 0,
    flops: list[Cost] | None = None,
    settings: Settings = AS_IT_IS,
) -> Estimate:
    """The estimate of ``setup.steps`` steps at ``batch_size``, capped at ``capacity`` bytes, with the
    first ``checkpointed`` blocks checkpointed and the plan's ``settings``; each step's FLOPs
    appended to ``flops`` (if given)."""
    step = functools.partial(
        training_step, autocast=setup.autocast, own_loss=recipe.library == "transformers"
    )
    functools.update_wrapper(step, training_step)
    return run_estimate(
        settings.step(step, "cuda"),
        _arguments(recipe, setup, batch_size, counted, mesh, checkpointed, settings.selective),
        torch.device("cuda"),
        steps=setup.steps,
        capacity=capacity,
        gpu=setup.gpu,
        call_context=None if flops is None else call_context(settings, flops, setup.gpu),
        stacks=False,  # the command prints no snapshot: peaks and categories need no stacks
    )


def estimate_training(recipe: ModelRecipe, setup: TrainingSetup) -> tuple[Estimate, ParameterCount]:
    """The :class:`~memlab.estimate.result.Estimate` of ``setup.steps`` training steps of
    ``recipe``'s model (:func:`training_step`) on ``setup.gpu``, for rank 0 of a
    ``setup.world_size``-rank job under ``setup.parallel``, and its parameter count. Nothing is
    allocated: the model, optimizer and batch are fake tensors from the start. What it cannot see
    is what an estimate cannot (:data:`memlab.estimate.result.CANNOT_SEE`)."""
    counted = ParameterCount()
    with _job(recipe, setup) as mesh:
        return _estimate(recipe, setup, setup.batch_size, None, counted, mesh), counted


def largest_batch(
    recipe: ModelRecipe,
    setup: TrainingSetup,
    budget: int,
    high: int | None = None,
    progress: bool | None = None,
) -> BatchFit:
    """The largest batch size (from 1, up to ``high``) whose ``setup.steps`` steps run in a modelled
    allocator of ``budget`` bytes without running out of memory, searched by doubling then
    bisection as :func:`memlab.max_batch_size` does; each size builds the model anew (data-free).
    A language model's memory grows with its batch, so the search ends without ``high``.
    ``progress``: the search's line on stderr (:func:`memlab.estimate.fit.search_batch_size`)."""
    counted = ParameterCount()
    with _job(recipe, setup) as mesh:
        return search_batch_size(
            lambda size, capacity: _estimate(recipe, setup, size, capacity, counted, mesh),
            budget,
            0,
            setup.steps,
            high=high,
            progress=progress,
            task="estimate --max-batch-size",
        )


def plan_training(recipe: ModelRecipe, setup: TrainingSetup, budget: int) -> Plan:
    """:func:`memlab.plan` for ``recipe``'s model built data-free, with its knobs: the optimizer
    stepping per parameter, the fewest of its first blocks
    (:func:`memlab.plan.checkpointing.candidate_blocks`, named as in the model the recipe builds)
    checkpointed, else micro-batches of ``setup.batch_size``, for ``setup.steps`` steps to complete
    within ``budget`` bytes on ``setup.gpu``; each configuration tried builds the model anew.
    ``ValueError`` with ``setup.gradient_checkpointing`` (it checkpoints every layer already) or
    for a model without blocks."""
    if setup.gradient_checkpointing:
        raise ValueError("planning chooses the blocks to checkpoint: leave gradient checkpointing off")
    with torch.device("meta"):
        blocks = candidate_blocks(recipe.build(setup.dtype))
    if not blocks:
        raise ValueError(f"{recipe.name} has no submodule with parameters to checkpoint")
    counted = ParameterCount()
    with _job(recipe, setup) as mesh:

        def run(count: int, settings: Settings) -> Outcome:
            flops: list[Cost] = []
            found = _estimate(recipe, setup, setup.batch_size, None, counted, mesh, count, flops, settings)
            return found, flops[-1], found.under(budget)

        return search_plan(
            run,
            blocks,
            budget,
            knobs=DEFAULT_KNOBS,
            batch=setup.batch_size,
            gpu=setup.gpu,
        )
