"""``memlab.estimate``: the memory a call will take, measured on data-free copies before running it.

The call runs on copies of its tensors, modules and optimizers (:mod:`memlab.estimate.copies`):
fake tensors (``FakeTensorMode``) on the arguments' device type, or ``meta`` tensors for ``meta``
arguments. A :class:`~memlab.sources.tracker.TensorTracker` counts every storage the run creates
and replays it through the CUDA caching allocator model, so the numbers are those the tracker
gives for a real run, without allocating a byte of tensor data. PyTorch chooses kernels per device;
an estimate for ``device="cuda"`` on a machine without CUDA substitutes CUDA's choices where they
allocate differently (:mod:`memlab.estimate.kernels`). Values the call reads on the host
(``loss.item()``, ``bool()``, ``.tolist()``, ``.numpy()``, an attention-mask check) are answered
without data where they can be (:mod:`memlab.estimate.values`): exactly for tensors computed from
the inputs, as PyTorch's unbacked symbols for values that depend on the weights. Where a value the
run does not have decides a size or a branch (``int(n)``, ``if loss > 1:``, ``nonzero`` of an
activation), the estimate runs the call for real on CPU copies (``method="cpu"``: exact for tracked
bytes, costs host memory and time) and says which op and line forced it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memlab._devices import default_device, parse_device
from memlab._gpus import GPU, GpuLike, resolve_gpu
from memlab._units import check_count, format_size
from memlab.estimate.copies import Copier, named_objects
from memlab.estimate.deepcopy import fake_deepcopy
from memlab.estimate.isolation import Isolation
from memlab.estimate.outside import OutsideCopies, outside_tensors, watch_outside
from memlab.estimate.quiet import fake_tensor_logs_quiet
from memlab.estimate.result import HOW, RERUN, Estimate, EstimateError
from memlab.estimate.run_tracker import EstimateTracker
from memlab.estimate.tensor_copies import host_scalar, tensor_copier
from memlab.estimate.values import fake_mode_with_values
from memlab.history import categories
from memlab.sources.tracker import TensorTracker

__all__ = ["Estimate", "EstimateError", "estimate"]


def estimate(
    fn: Callable[..., Any],
    *args: Any,
    device: torch.device | str | None = None,
    steps: int = 1,
    gpu: GpuLike | None = None,
    **kwargs: Any,
) -> Estimate:
    """Estimate the memory ``fn(*args, **kwargs)`` takes, without running it on real data.

    ``fn`` runs on data-free copies of every tensor, module and optimizer among the arguments
    (nested in lists, tuples, dicts, named tuples and dataclasses) and of those ``fn`` names
    directly as globals or closure variables (a global ``model``, also through the functions of
    its module it calls); a module passed as ``fn`` is copied, and so is the owner of a bound
    method. The user's objects are never touched, moved or given gradients. Other objects (lists
    ``fn`` appends to, dicts it assigns, attributes it sets on ``self`` or on a module, counters in
    globals and closures) are the user's own during the run, as in a real call (a list of losses
    grows step after step and holds them), and are put back as they were when the estimate ends,
    also when it fails or is interrupted (:mod:`memlab.estimate.isolation`): every object ``fn``
    can reach through the globals its functions name, their closures and defaults, the owner of a
    bound method, the arguments, containers, attributes and slots, up to
    :data:`memlab.estimate.isolation.LIMIT` objects; so are the random number generators of torch,
    ``random`` and NumPy. A tensor ``fn`` reaches that way is never handed to an op: each op gets a
    copy of it, the same one all run long (``ema.mul_(0.5)`` changes the copy; its version counter
    is set back), so every tensor of the user's is bit-identical afterwards. What cannot be put
    back is an :class:`EstimateError`: a write to a NumPy array ``fn`` reaches (before it happens,
    naming the array and the line), a generator ``fn`` advanced (after the run). Objects of C
    extensions other than these, the globals of installed packages and memlab's own objects (a
    tracker ``fn`` reaches keeps what it recorded) are not saved.

    ``device`` says whose kernels to mimic: ``"cuda"`` (the default when an argument is on a GPU),
    ``"cpu"``, ``"meta"``; default: the arguments' device type, else torch's default device. On a
    machine without CUDA, ``device="cuda"`` runs fake CPU tensors with CUDA's kernel choices
    substituted where they allocate differently (:mod:`memlab.estimate.kernels`); differences not
    handled are named in ``caveats`` when the run hits them.

    ``gpu``: the GPU whose memory an estimate models (:func:`memlab._gpus.resolve_gpu`: a name such
    as ``"A100"``, a compute capability ``"sm90"`` or ``(9, 0)``; default: the GPU in use on a
    machine with CUDA, else :data:`memlab._gpus.DEFAULT_GPU`, an H100); naming one makes
    ``device`` default to ``"cuda"``. Its cuBLAS/cuBLASLt workspace is counted where PyTorch
    allocates it, as a :class:`~memlab.sources.tracker.TensorTracker` counts it for a real run: at
    the first op that takes a cuBLAS handle (a matmul) of each thread and stream (backward runs on
    the autograd engine's own thread on a GPU, so a training step has two), with the size
    ``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE`` and ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
    give (:mod:`memlab.sources.workspaces`).

    A model sharded with FSDP2 (``fully_shard``) or wrapped in DDP is copied without its wrapper
    and wrapped again, with the same arguments and process group (:mod:`memlab.estimate.sharded`):
    the estimate is this rank's, inside a real job or inside
    :func:`memlab.distributed.fake_group` for a job of any size; DTensor models are copied shard
    by shard.

    Where a real kernel allocates other storages than its meta kernel
    (:data:`memlab.estimate.sizes.CORRECTIONS`), the estimate counts the real kernel's; for a CPU
    LSTM layer, oneDNN's workspace, measured once per layer shape by running the kernel on zeros
    (host memory and the time of one layer's forward).

    ``steps``: how many times to call ``fn`` in a row on the same copies, as a training loop
    ``for ...: result = fn(...)`` does (gradients, optimizer state and the previous result carried
    over; the previous result is released when the next call returns). Peaks are over all calls;
    ``Estimate.peak_step`` says which one reached the peak reserved bytes. A step whose optimizer
    already has state (a model trained for a while) is estimated as data-free as a fresh one:
    optimizer step counters and other one-element CPU tensors are copied with their values, so
    code that reads them (``step.item()`` in Adam) runs on fake tensors.

    Values ``fn`` reads on the host stay data-free where they can (:mod:`memlab.estimate.values`).
    Tensors computed only from the inputs and buffers (token ids, masks, labels, ``arange``) carry
    their real values while small, so ``.item()``, ``bool()``, ``.tolist()`` and ``.numpy()`` of
    them, branches on them (Hugging Face's attention-mask and pad-token checks) and sizes they
    decide (``nonzero``, a boolean mask, ``x[: mask.sum().item()]``) are the real ones. A value
    that depends on the weights (``loss.item()``, ``clip_grad_norm_(...).item()``) is an unbacked
    symbol that may be logged, formatted and summed (read as a float it is 0.0). Such values are
    taken as finite: ``isnan``/``isinf``/``isfinite`` of them and a GradScaler's found-inf check
    give the answers of a step without overflow, and ``caveats`` says so where the step reads
    them; ``.numpy()`` of them gives zeros, also in ``caveats``. Where a value the run does not
    have decides a size or a branch (``int(n)``, ``range(n)``, a size argument, ``if loss > 1:``,
    ``nonzero`` of an activation), or the run fails after reading one, the estimate runs ``fn``
    for real on CPU copies of the arguments (``method="cpu"``; exact for the bytes a tracker
    counts, costs host memory and the time of a real run) and ``forced_by`` names the read or
    op, the line, and the line the value was read from a tensor; ``fn`` has then run twice, and
    ``caveats`` says so (its prints, logging and files happened in both runs). A tensor that
    requires grad and that ``fn`` reaches other than through its arguments or the names it uses
    (a model held by another module's global, say) is an :class:`EstimateError`: its gradients and
    optimizer update would be missing from the estimate.

    Returns an :class:`Estimate`. See its docstring for what an estimate cannot see.
    """
    if not callable(fn):
        raise TypeError(
            f"fn must be callable (a function, module or method), got {type(fn).__name__} {fn!r:.80}"
        )
    steps = check_count(steps, "steps", 1)
    _check_trainer_method(fn)
    modelled = resolve_gpu(gpu)
    target = _target("cuda" if device is None and gpu is not None else device, (fn, args, kwargs))
    built = run_estimate(fn, lambda: (args, kwargs), target, steps=steps, gpu=modelled)
    if _owner_class(fn, _LIGHTNING_MODULE) and getattr(fn, "__name__", "") == "training_step":
        built.caveats.append(
            "a LightningModule's training_step holds the forward only: the backward pass and the "
            "optimizer step are not in this estimate (memlab.integrations.lightning.estimate(trainer, "
            "module) runs them)"
        )
    return built


#: The classes (module, qualified name) whose methods a plain estimate cannot run as a training step.
_TRAINER = ("transformers.trainer", "Trainer")
_LIGHTNING_MODULE = ("lightning.pytorch.core.module", "LightningModule")


def _owner_class(fn: Any, cls: tuple[str, str]) -> bool:
    """Whether ``fn`` is a method bound to an instance of ``cls`` (or a subclass), found by name:
    the framework is not imported."""
    owner = getattr(fn, "__self__", None)
    return owner is not None and any((c.__module__, c.__qualname__) == cls for c in type(owner).__mro__)


def _check_trainer_method(fn: Any) -> None:
    """A Hugging Face ``Trainer``'s methods run only inside ``train()`` (its loop sets the state they
    read): a ``TypeError`` naming the integration that estimates its steps."""
    if _owner_class(fn, _TRAINER):
        raise TypeError(
            f"fn is Trainer.{getattr(fn, '__name__', '?')}, which runs only inside trainer.train() (it reads "
            "state the training loop sets); estimate the trainer's optimizer steps with "
            "memlab.integrations.transformers.estimate(trainer)"
        )


def _target(device: torch.device | str | None, roots: Any) -> torch.device:
    if device is not None:
        return parse_device(device, name="device")
    from memlab._tensors import tensors_within

    types = {t.device.type for t in tensors_within([roots])}
    if "cuda" in types:
        return torch.device("cuda")
    if len(types) == 1:
        return torch.device(types.pop())
    return default_device()


def run_estimate(
    fn: Callable[..., Any],
    make_arguments: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
    device: torch.device,
    *,
    with_grads: bool = False,
    backward: bool = False,
    profiler: Any = None,
    method: str | None = None,
    steps: int = 1,
    capacity: int | None = None,
    start: Callable[[TensorTracker, Copier], None] | None = None,
    call_context: Callable[[Copier, int], contextlib.AbstractContextManager[Any]] | None = None,
    gpu: GPU | None = None,
    stacks: bool = True,
) -> Estimate:
    """Run ``fn`` on data-free copies of what ``make_arguments()`` returns (``(args, kwargs)``;
    called under the fake mode, so tensors it creates are fake from the start) and return the
    :class:`Estimate`. ``with_grads``: give every trainable parameter a gradient first (a step
    that accumulates into existing gradients); ``backward``: call ``.backward()`` on the result;
    ``profiler``: a LineProfiler enabled around the call; ``method``: force ``"cpu"``; ``steps``:
    calls in a row (see :func:`estimate`); ``capacity``: the modelled device's memory in bytes
    (``torch.OutOfMemoryError`` where the run needs more); ``gpu``: the GPU whose cuBLAS
    workspaces the run allocates and whose kernels CUDA's substitutions follow (default:
    :func:`memlab._gpus.resolve_gpu`'s).

    ``start(tracker, copier)`` is called before anything is counted, the copies made
    (``copier.copies`` with their ``copier.originals``): it may start the tracker from an
    allocator in a given state (:meth:`TensorTracker.resume`: a process's cached segments, with
    copies in their originals' blocks) instead of an empty one; the copies it does not place are
    counted as new allocations, and the run's peaks are those of that allocator from there (its
    ``by_category(at="peak")`` reads the allocator's whole history). ``call_context(copier, i)``:
    the context manager the ``i``-th call of ``fn`` (from 0) runs in, given the copies.
    ``stacks=False``: the run's history records no Python stacks (its snapshot's frames are empty;
    peaks and categories are the same), which saves a stack walk per allocation."""
    method = method or ("meta" if device.type == "meta" else "fake")
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if gpu is None:
        gpu = resolve_gpu(None)

    def rerun(new_profiler: Any, new_capacity: int | None) -> Estimate:
        return run_estimate(
            fn, make_arguments, device, with_grads=with_grads, backward=backward,
            profiler=new_profiler, method=method, steps=steps, capacity=new_capacity,
            start=start, call_context=call_context, gpu=gpu, stacks=stacks,
        )  # fmt: skip

    # Values read on the host (.item(), bool(), .numpy()): known ones exact, unknown ones symbols.
    mode, values = fake_mode_with_values() if method == "fake" else (None, None)
    tracker = EstimateTracker(
        history=True,
        capacity=capacity,
        kernels=device.type if method == "fake" else None,
        gpu=gpu,
        stacks=stacks,
        values=values,
    )
    tracker.estimated = HOW[method] + (f", {device.type}'s kernels" if method == "fake" else "")
    kernels = _kernels(device, data_free=method != "cpu", gpu=gpu)
    caveats: list[str] = []
    optimizer_defaults = 0  # optimizers given CUDA's foreach default
    isolation = Isolation(fn, make_arguments)  # the user's state, put back when the run ends
    with (
        isolation,
        _disable_current_modes(),
        mode or contextlib.nullcontext(),
        values or contextlib.nullcontext(),
        fake_tensor_logs_quiet(),
        fake_deepcopy() if mode else contextlib.nullcontext(),
    ):
        copier = Copier(tensor_copier(method, mode))
        args, kwargs = make_arguments()
        isolation.add(args, kwargs)
        copier.modules_first([*named_objects(fn), args, kwargs])
        call, args, kwargs = copier.function(fn), copier(tuple(args)), copier(dict(kwargs))
        if values is not None:
            values.know_inputs(copier)
        if with_grads:
            _give_gradients(copier.modules)
        outside = watch_outside(mode)
        for module in copier.modules:
            tracker.add_model(module)
        for optimizer in copier.optimizers:
            tracker.add_optimizer(optimizer)
            if kernels is not None:
                from memlab.estimate.kernels import cuda_optimizer_defaults

                if cuda_optimizer_defaults(optimizer):
                    optimizer_defaults += 1
        try:
            with tracker, kernels or contextlib.nullcontext():
                if start is not None:
                    start(tracker, copier)
                tracker.adopt(roots=copier.modules)
                tracker.adopt(roots=copier.optimizers)
                tracker.adopt(roots=copier.inputs, category=categories.INPUT)
                tracker.adopt(roots=copier.copies)
                # One adoption, as the line that says where numbers come from reports it.
                tracker.adoptions[:] = [tuple(map(sum, zip(*tracker.adoptions, strict=True)))]
                copier.finish()  # wrappers that allocate when built (DDP's buckets), counted
                copier.release()  # from here on, only what the user's objects hold keeps a copy alive
                reserved_peaks = []
                copies = OutsideCopies(method, mode, isolation.tensors, outside, host_scalar)
                with profiler or contextlib.nullcontext(), tracker.copying(copies):
                    isolation.protect()
                    result = None
                    for index in range(steps):
                        with call_context(copier, index) if call_context else contextlib.nullcontext():
                            result = call(*args, **kwargs)
                        if backward:
                            result.backward()
                        reserved_peaks.append(tracker.max_memory_reserved(_stats_device(tracker)))
                tracker._categorise_known()
                stats_device = _stats_device(tracker)
                built = Estimate(
                    name=name,
                    method=method,
                    device=device,
                    tracker=tracker,
                    stats_device=stats_device,
                    caveats=caveats,
                    substituted=_substituted(kernels, optimizer_defaults),
                    forced_by=None,
                    rerun=rerun,
                    function=fn,
                    steps=steps,
                    peak_step=reserved_peaks.index(max(reserved_peaks)) + 1,
                    gpu=gpu,
                    capacity=capacity,
                )
                del result
        except Exception as error:
            if values is not None:
                values.failed(error)
                tracker.forced_by = values.forced_by or tracker.forced_by
            if tracker.forced_by is None:
                raise  # the user's own error, or ours: never hidden
        if values is not None and values.forced_by is not None:  # also when the step caught ValueNeeded
            tracker.forced_by = values.forced_by
        if tracker.forced_by is None:
            caveats += outside_tensors(outside) + tracker.size_caveats + copier.caveats + isolation.caveats
            caveats += values.caveats if values is not None else []
            if device.type == "cuda":
                caveats += tracker.workspaces.caveats()  # cuDNN's convolution workspaces
            if kernels is not None:
                caveats += kernels.caveats + _host_step_counters(copier.optimizers)
    if tracker.forced_by is not None:  # the run read values fake tensors do not have
        if method == "cpu":
            raise AssertionError("a real CPU run cannot need values")  # pragma: no cover
        cpu = run_estimate(
            fn,
            make_arguments,
            device,
            with_grads=with_grads,
            backward=backward,
            profiler=profiler,
            method="cpu",
            steps=steps,
            capacity=capacity,
            start=start,
            call_context=call_context,
            gpu=gpu,
            stacks=stacks,
        )
        cpu.forced_by = tracker.forced_by
        cpu.caveats.append(RERUN)
        return cpu
    return built


def _host_step_counters(optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """The caveat for optimizer ``step`` counters, which a non-capturable, non-fused optimizer keeps
    in host memory on a GPU (``torch/optim/adam.py``: ``torch.tensor(0.0)`` without a device) while
    a run on CPU tensors counts them with the rest."""
    counters = sum(
        1
        for optimizer in optimizers
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].dim() == 0
    )
    if not counters:
        return []
    return [
        f"{counters} optimizer step counter(s) are counted here ({format_size(counters * 512)} in 512-byte "
        f"blocks); a non-capturable, non-fused optimizer keeps them in host memory on a GPU"
    ]


def _substituted(kernels: Any, optimizer_defaults: int) -> dict[str, int]:
    found = dict(kernels.substituted) if kernels is not None else {}
    if optimizer_defaults:
        found["optimizer_foreach"] = optimizer_defaults
    return found


def _kernels(device: torch.device, data_free: bool, gpu: GPU | None) -> Any:
    """CUDA's kernel choices on ``gpu`` for an estimate of ``cuda`` on a machine that cannot run them."""
    if device.type != "cuda" or torch.cuda.is_available():
        return None
    from memlab.estimate.kernels import CudaKernels

    return CudaKernels(data_free=data_free, gpu=gpu)


def _give_gradients(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)


def _stats_device(tracker: TensorTracker) -> torch.device:
    devices = tracker.devices
    return devices[0] if devices else torch.device("meta")
