"""``memlab.max_batch_size``: the largest batch whose repeated training steps fit in a memory budget.

Each candidate batch size is estimated (:func:`memlab.estimate.estimate`, on fake tensors: nothing
is allocated, not even the batch, which ``make_batch`` creates under the fake mode) for several
steps in a row under a modelled allocator whose capacity is the budget, by doubling from ``low``
until a size runs out of memory, then by bisection, never by extrapolating from a few runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlab._devices import default_device, parse_device
from memlab._gpus import GPU, GpuLike, resolve_gpu
from memlab._progress import Progress
from memlab._units import check_count, format_size, parse_size
from memlab.estimate.capped import completes_under
from memlab.estimate.estimate import Estimate, run_estimate
from memlab.sources.workspace_note import with_note

__all__ = ["BatchFit", "default_budget", "max_batch_size", "modelled_gpu", "search"]


@dataclass(frozen=True)
class BatchFit:
    """What :func:`max_batch_size` found.

    ``batch_size``: the largest batch size whose ``steps`` estimated steps in a row run without
    running out of memory in an allocator of ``budget - headroom`` bytes (0 when even ``low``
    does not). ``estimate``: the :class:`Estimate` of that size, run under that capacity (``None``
    for 0); ``next_size``: the smallest size that ran out of memory (``batch_size + 1``, or
    ``low`` when nothing fits; ``None`` where ``high`` was reached and fits); ``next_estimate``:
    its estimate without a capacity, whose ``peak_reserved`` is what it would need.
    ``estimates``: how many estimates the search ran. ``budget`` and ``headroom`` in bytes. Its
    text ends with the modelled cuBLAS workspaces the estimates include, where there are any
    (:func:`memlab.sources.workspace_note.workspaces_note`; ``CUBLAS_WORKSPACE_CONFIG=:0:0`` turns
    them off).
    """

    batch_size: int
    estimate: Estimate | None
    next_estimate: Estimate | None
    estimates: int
    budget: int
    headroom: int
    steps: int = 2
    next_size: int | None = None

    def __repr__(self) -> str:
        text = f"largest batch that fits in {format_size(self.budget)}"
        if self.headroom:
            text += f" with {format_size(self.headroom)} headroom"
        text += f" for {self.steps} steps in a row" if self.steps > 1 else " for 1 step"
        text += f": {self.batch_size}"
        if self.estimate is not None:
            text += f" (peak reserved {format_size(self.estimate.peak_reserved)})"
        if self.next_estimate is not None:
            text += f"; {self.next_size} needs {format_size(self.next_estimate.peak_reserved)}"
        found = self.estimate or self.next_estimate
        return with_note(f"{text}; {self.estimates} estimates", None if found is None else found.workspaces)


def default_budget(device: torch.device, gpu: GpuLike | None = None) -> int:
    """The memory a step on ``device`` may use when no budget is given, in bytes.

    On a CUDA GPU (a machine with CUDA, ``device`` ``cuda``): what this process's caching allocator
    may still reserve, plus what it holds but does not use (``reserved - allocated``). It may
    reserve the GPU's free memory (``torch.cuda.mem_get_info``), but no more than the limit
    ``torch.cuda.set_per_process_memory_fraction`` sets, less what it reserved already:
    ``mem_get_info`` ignores that limit, the allocator does not (``CUDACachingAllocator.cpp``: a
    new segment fails beyond ``allowed_memory_maximum``, the fraction times the total memory, which
    ``torch.cuda.get_per_process_memory_fraction`` reads back divided by it).

    Elsewhere: the ``capacity`` of the active :class:`~memlab.sources.tracker.TensorTracker`; else,
    for ``device`` ``cuda`` on a machine without CUDA, the total memory of the GPU modelled (``gpu``,
    or the active tracker's, or :data:`memlab._gpus.DEFAULT_GPU`) less
    :data:`memlab._gpus.CONTEXT_ALLOWANCE` (the CUDA context). ``ValueError`` when there is none
    of these, or the GPU's memory is unknown (a GPU given only by its compute capability)."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
        fraction = torch.cuda.get_per_process_memory_fraction(index)
        if fraction < 1.0:
            limit = round(fraction * torch.cuda.get_device_properties(index).total_memory)
            free = min(free, max(limit - reserved, 0))
        return free + reserved - allocated
    from memlab.sources.tracker import active_tracker

    tracker = active_tracker()
    if tracker is not None and tracker.capacity is not None:
        return tracker.capacity
    if device.type == "cuda":
        return modelled_gpu(gpu).default_budget()
    raise ValueError(
        "budget: no CUDA GPU to read free memory from and no active TensorTracker with a capacity; "
        "pass budget as bytes or a size such as '16 GiB'"
    )


def modelled_gpu(gpu: GpuLike | None) -> GPU:
    """The GPU whose allocator and cuBLAS workspaces the estimates of a step model: ``gpu``
    (:func:`memlab._gpus.resolve_gpu`); without one, the GPU the active
    :class:`~memlab.sources.tracker.TensorTracker` models (a tracked run's step is estimated for
    that GPU), else :func:`~memlab._gpus.resolve_gpu`'s default."""
    if gpu is None:
        from memlab.sources.tracker import active_tracker

        tracker = active_tracker()
        if tracker is not None and tracker.gpu is not None:
            return tracker.gpu
    return resolve_gpu(gpu)


def call_arguments(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a batch is passed to a step: a tuple as positional arguments, anything else as one."""
    return (batch, {}) if isinstance(batch, tuple) else ((batch,), {})


def max_batch_size(
    step: Callable[..., Any],
    make_batch: Callable[[int], Any],
    budget: int | str | None = None,
    *,
    low: int = 1,
    high: int | None = None,
    headroom: int | str = 0,
    device: torch.device | str | None = None,
    steps: int = 2,
    gpu: GpuLike | None = None,
    progress: bool | None = None,
) -> BatchFit:
    """The largest batch size ``B`` (``low <= B <= high``) at which ``steps`` training steps in a
    row fit in ``budget`` minus ``headroom``: the steady state of training, not only its first
    step (whose peak has no optimizer state or gradients yet).

    Each size is estimated as :func:`~memlab.estimate.estimate` does with ``steps=steps``, under a
    modelled CUDA caching allocator whose capacity is ``budget - headroom`` bytes: a size fits when
    no step runs out of memory there (with the allocator's retry path: cached blocks are freed
    before it gives up, as on a GPU). Training at ``B`` under that capacity then never runs out of
    memory in the steps estimated (nor later, when each step frees what it makes), and ``B + 1``
    does within them.

    ``make_batch(B)`` returns the step's arguments for batch size ``B``: ``step(*batch)`` when it
    returns a tuple, else ``step(batch)``. It is called under the estimate's fake mode, so the
    tensors it creates (``torch.randn(B, ...)``) hold no data; ``step`` and its arguments are
    copied as by :func:`~memlab.estimate.estimate`, so the model and optimizer it names are
    counted (parameters, gradients, optimizer state) and left untouched. ``budget`` (bytes or a
    size such as ``"16 GiB"``) is the memory the whole step may use, model included; by default
    :func:`default_budget` (on a machine without CUDA, for ``cuda``: the GPU's total memory less
    :data:`memlab._gpus.CONTEXT_ALLOWANCE`). ``device``: whose kernels to mimic, as for
    ``estimate`` (default: ``cuda`` on a GPU machine or when ``gpu`` is named, else the default
    device). ``gpu``: the GPU modelled, as for ``estimate`` (its cuBLAS workspaces are counted;
    default: the active tracker's, else the GPU in use, else :data:`memlab._gpus.DEFAULT_GPU`).
    What the estimates cannot see (cuDNN workspaces, the CUDA context on a GPU machine) is not in
    the budget: leave it as ``headroom``.

    ``progress``: a line on stderr says which batch is being tried and how many estimates ran
    (``True``: always; ``False``: never; ``None``: when stderr is a terminal, unless
    ``MEMLAB_PROGRESS=0``); each result is also logged on the ``memlab`` logger
    (:mod:`memlab._progress`).

    Sizes are searched by doubling from ``low``, then by bisection: O(log B) estimates, each the
    cost of ``steps`` data-free steps; a step whose peak does not grow with the batch stops at
    ``high`` (``None``: doubling goes on until a size does not fit). It assumes that a larger batch
    never needs less memory. Returns a :class:`BatchFit`, with the estimates of ``B`` and ``B + 1``.
    """
    if not callable(step) or not callable(make_batch):
        bad = "step" if not callable(step) else "make_batch"
        raise TypeError(f"{bad} must be callable")
    low = check_count(low, "low", 1)
    if high is not None:
        high = check_count(high, "high", low)
    steps = check_count(steps, "steps", 1)
    if device is not None:
        target = parse_device(device, name="device")
    elif torch.cuda.is_available() or gpu is not None:
        target = torch.device("cuda")
    else:
        target = default_device()
    modelled = modelled_gpu(gpu)
    limit, extra = budget_in_bytes(budget, headroom, target, modelled)

    def estimate(size: int, capacity: int | None) -> Estimate:
        arguments = lambda: call_arguments(make_batch(size))  # noqa: E731
        return run_estimate(step, arguments, target, steps=steps, capacity=capacity, gpu=modelled)

    return search_batch_size(estimate, limit, extra, steps, low=low, high=high, progress=progress)


def budget_in_bytes(
    budget: int | str | None, headroom: int | str, target: torch.device, gpu: GPU
) -> tuple[int, int]:
    """``(budget, headroom)`` in bytes, as a batch finder takes them: ``budget`` a size (``"16 GiB"``)
    or by default :func:`default_budget` of ``target`` and ``gpu``; ``ValueError`` for a budget of
    0 bytes, or unless the headroom is less than the budget."""
    extra = parse_size(headroom, name="headroom")
    limit = default_budget(target, gpu) if budget is None else parse_size(budget, name="budget")
    if budget is not None and limit == 0:
        raise ValueError(f"budget must be a size above 0 bytes (e.g. '8 GiB'), got {budget!r}")
    if extra >= limit:
        raise ValueError(
            f"headroom ({format_size(extra)}) must be less than the budget ({format_size(limit)})"
        )
    return limit, extra


def search_batch_size(
    run: Callable[[int, int | None], Estimate],
    budget: int,
    headroom: int,
    steps: int,
    *,
    low: int = 1,
    high: int | None = None,
    progress: bool | None = None,
    task: str = "max_batch_size",
) -> BatchFit:
    """The search every batch finder runs (:func:`max_batch_size`, the trainers' integrations,
    ``memlab estimate --max-batch-size``): ``run(size, capacity)`` estimates ``steps`` steps at batch
    ``size`` under a modelled allocator of ``capacity`` bytes (``None``: unbounded), raising
    ``torch.OutOfMemoryError`` where they do not fit. Sizes are searched by doubling from ``low``,
    then bisection (:func:`search`), each in ``budget - headroom`` bytes (both in bytes); without
    ``high``, a step whose memory does not grow with the batch is a ``ValueError``. The size above
    the answer is estimated once more without a capacity, for what it needs. ``progress`` and
    ``task`` name the progress line (:class:`memlab._progress.Progress`). Returns a
    :class:`BatchFit`."""
    found: dict[int, Estimate | None] = {}
    shown = Progress(task, progress=progress)

    def fits(size: int) -> bool:
        if size not in found:
            shown.update(f"trying batch {size} (estimate {len(found) + 1})", logging.DEBUG)
            found[size] = completes_under(lambda capacity: run(size, capacity), budget - headroom)
            if high is None:
                _check_growth(found, size)
            shown.update(_outcome(size, found[size], budget - headroom, len(found)))
        return found[size] is not None

    with shown:
        good, bad = search(fits, low, high)
        if bad is not None:
            shown.update(f"estimating what batch {bad} needs (estimate {len(found) + 1})", logging.DEBUG)
        needs = None if bad is None else run(bad, None)
        fit = BatchFit(
            good, found.get(good), needs, len(found) + (bad is not None), budget, headroom, steps, bad
        )
        shown.done(repr(fit))
    return fit


def _outcome(size: int, estimate: Estimate | None, capacity: int, count: int) -> str:
    """The progress line of one batch size's estimate: whether it fits, and the estimates so far."""
    plural = "s" if count > 1 else ""
    if estimate is None:
        return f"batch {size} does not fit in {format_size(capacity)} ({count} estimate{plural})"
    peak = format_size(estimate.peak_reserved)
    return f"batch {size} fits, peak reserved {peak} ({count} estimate{plural})"


def _check_growth(found: dict[int, Estimate | None], size: int) -> None:
    """``ValueError`` when ``size`` and half of it fit with the same peak of requested bytes: the
    step's memory does not grow with the batch, so doubling without ``high`` would never stop."""
    half = found.get(size // 2) if size % 2 == 0 else None
    estimate = found[size]
    if estimate is None or half is None:
        return
    peak = estimate.stats["requested_bytes.all.peak"]
    if peak == half.stats["requested_bytes.all.peak"]:
        raise ValueError(
            f"the step's memory does not grow with the batch size (batches of {size // 2} and {size} both "
            f"request a peak of {format_size(peak)}): pass high= to bound the search"
        )


def search(fits: Callable[[int], bool], low: int, high: int | None) -> tuple[int, int | None]:
    """``(largest size that fits, the size just above it)`` among ``low..high`` (``high=None``: no
    bound), by doubling from ``low`` until a size does not fit, then bisection; ``(0, low)`` when
    ``low`` does not fit, ``(high, None)`` when ``high`` fits. Assumes that fitting is monotonic."""
    if not fits(low):
        return 0, low
    good, bad = low, None
    while bad is None:
        size = good * 2 if high is None else min(good * 2, high)
        if size == good:
            return good, None  # high reached and fits
        if fits(size):
            good = size
        else:
            bad = size
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, bad
