"""``memlab.max_batch_size``: the largest batch whose estimated step fits in a memory budget.

Each candidate batch size is estimated (:func:`memlab.estimate.estimate`, on fake tensors: nothing
is allocated, not even the batch, which ``make_batch`` creates under the fake mode), by doubling
from ``low`` until a size does not fit, then by bisection, never by extrapolating from a few runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlab._devices import parse_device
from memlab._units import format_size, parse_size
from memlab.estimate.estimate import Estimate, run_estimate

__all__ = ["BatchFit", "default_budget", "max_batch_size", "search"]


@dataclass(frozen=True)
class BatchFit:
    """What :func:`max_batch_size` found.

    ``batch_size``: the largest batch size whose estimated peak reserved bytes plus ``headroom``
    fit in ``budget`` (0 when even ``low`` does not fit). ``estimate``: the :class:`Estimate` of
    that size (``None`` for 0); ``next_estimate``: the estimate of ``batch_size + 1`` (``None``
    where ``high`` was reached and fits). ``estimates``: how many estimates the search ran.
    ``budget`` and ``headroom`` in bytes.
    """

    batch_size: int
    estimate: Estimate | None
    next_estimate: Estimate | None
    estimates: int
    budget: int
    headroom: int

    def __repr__(self) -> str:
        text = f"largest batch that fits in {format_size(self.budget)}"
        if self.headroom:
            text += f" with {format_size(self.headroom)} headroom"
        text += f": {self.batch_size}"
        if self.estimate is not None:
            text += f" (peak reserved {format_size(self.estimate.peak_reserved)})"
        if self.next_estimate is not None:
            text += f"; {self.batch_size + 1} needs {format_size(self.next_estimate.peak_reserved)}"
        return f"{text}; {self.estimates} estimates"


def default_budget(device: torch.device) -> int:
    """The memory a step on ``device`` may use when no budget is given, in bytes: on a CUDA GPU,
    its free memory plus what this process's caching allocator holds but does not use
    (``reserved - allocated``); elsewhere the ``capacity`` of the active
    :class:`~memlab.sources.tracker.TensorTracker`. ``ValueError`` when there is neither."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    from memlab.sources.tracker import active_tracker

    tracker = active_tracker()
    if tracker is not None and tracker.capacity is not None:
        return tracker.capacity
    raise ValueError(
        "budget: no CUDA GPU to read free memory from and no active TensorTracker with a capacity; "
        "pass budget as bytes or a size such as '16 GiB'"
    )


def _check_count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
) -> BatchFit:
    """The largest batch size ``B`` (``low <= B <= high``) whose estimated peak reserved memory
    plus ``headroom`` fits in ``budget``.

    ``make_batch(B)`` returns the step's arguments for batch size ``B``: ``step(*batch)`` when it
    returns a tuple, else ``step(batch)``. It is called under the estimate's fake mode, so the
    tensors it creates (``torch.randn(B, ...)``) hold no data; ``step`` and its arguments are
    copied as by :func:`~memlab.estimate.estimate`, so the model and optimizer it names are
    counted (parameters, gradients, optimizer state) and left untouched. ``budget`` (bytes or a
    size such as ``"16 GiB"``) is the memory the whole step may use, model included; by default
    :func:`default_budget`. ``device``: whose kernels to mimic, as for ``estimate`` (default: the
    default device, or ``cuda`` on a GPU machine).

    Sizes are searched by doubling from ``low``, then by bisection: O(log B) estimates, each the
    cost of one data-free step; a step whose peak does not grow with the batch stops at ``high``
    (``None``: doubling goes on until a size does not fit). It assumes that a larger batch never
    needs less memory. Returns a :class:`BatchFit`, with the estimates of ``B`` and ``B + 1``.
    """
    if not callable(step) or not callable(make_batch):
        bad = "step" if not callable(step) else "make_batch"
        raise TypeError(f"{bad} must be callable")
    low = _check_count(low, "low", 1)
    if high is not None:
        high = _check_count(high, "high", low)
    extra = parse_size(headroom, name="headroom")
    if device is not None:
        target = parse_device(device, name="device")
    else:
        target = torch.device("cuda") if torch.cuda.is_available() else torch.get_default_device()
    limit = default_budget(target) if budget is None else parse_size(budget, name="budget")
    found: dict[int, Estimate] = {}

    def fits(size: int) -> bool:
        if size not in found:
            found[size] = run_estimate(step, lambda: call_arguments(make_batch(size)), target)
        return found[size].peak_reserved + extra <= limit

    def result(size: int, next_size: int | None) -> BatchFit:
        return BatchFit(
            size, found.get(size), None if next_size is None else found[next_size], len(found), limit, extra
        )

    good, bad = search(fits, low, high)
    return result(good, bad)


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
