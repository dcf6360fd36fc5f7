"""Remedies that estimate the failing step under a change (a smaller batch with accumulation,
autocast, activation checkpointing) with :mod:`memlab.estimate`, without running it on the device.

The step is the watched call (a profiled function, or a function given to ``explain_oom``) with the
arguments of the call that failed. Estimates run it again on data-free copies of its tensors,
modules and optimizers (the user's objects are not touched), so other side effects of the step
(appending to a list, counting) happen again. Each is estimated for :data:`REMEDY_STEPS` optimizer
steps in a row, from the allocator state right after the failure (:mod:`memlab.oom.state`: the
cached segments, and the copies of the live tensors in their originals' blocks) under the
capacity; where that state is unknown, from an empty allocator, and the report then shows a
margin instead of "fits".
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from memlab._units import format_size
from memlab.oom.accumulation import MIDDLE_ESTIMATED, Accumulation, MicroBatches
from memlab.oom.capture import Call, OOMCapture
from memlab.oom.report import Remedy
from memlab.oom.state import AllocatorState
from memlab.sources.allocator.config import K_SMALL_BUFFER

if TYPE_CHECKING:
    from memlab.estimate.result import Estimate
    from memlab.plan.flops import Cost
    from memlab.plan.search import Outcome

__all__ = [
    "REMEDY_STEPS",
    "SPARE",
    "STEP_REMEDIES",
    "Accumulation",
    "find_batch",
    "step_peak",
    "unsure",
]

#: Optimizer steps each step remedy is estimated for: the first from the state at the failure, the
#: second from what the first leaves (optimizer state, cached blocks), as training goes on.
REMEDY_STEPS = 2
#: The bytes a step remedy must also fit without to be marked "fits": one small-pool segment.
SPARE = K_SMALL_BUFFER
Start = AllocatorState | str  # the state a remedy starts from, or why the state at the failure is unknown
CallContext = Callable[[Any, int], contextlib.AbstractContextManager[Any]]  # (copier, call index)


def find_batch(call: Call) -> tuple[int, int] | None:
    """``(batch size, batch dimension)`` of a call's arguments: the size most tensors among them
    share in dimension ``batch_dim`` (default 0); ``None`` without such a tensor. Tensors inside
    modules and optimizers are not arguments of the batch."""
    dim = 0 if call.batch_dim is None else call.batch_dim
    leaves = pytree.tree_leaves((call.args, call.kwargs))
    sizes = Counter(
        leaf.shape[dim]
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, torch.nn.Parameter) and leaf.dim() > dim
    )
    if not sizes:
        return None
    return sizes.most_common(1)[0][0], dim


def _peak(
    capture: OOMCapture,
    start: Start,
    fn: Callable[..., Any],
    make_arguments: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
    capacity: int | None,
    call_context: CallContext | None = None,
    micro_batches: MicroBatches | None = None,
) -> Estimate:
    """The estimate of ``fn`` for :data:`REMEDY_STEPS` optimizer steps (each of
    the calls ``micro_batches`` plans, or one), from ``start`` (the state at the failure; an empty
    allocator where it is unknown) under ``capacity`` bytes (``None``: no limit), counting the
    cuBLAS workspaces of the GPU the failing run modelled (``capture.gpu``; for a GPU's own error,
    the GPU in use); ``torch.OutOfMemoryError`` where they do not fit. ``call_context``: as
    :func:`~memlab.estimate.estimate.run_estimate`'s (without micro-batches)."""
    from memlab.estimate.estimate import run_estimate

    starter = start.starter(capacity) if isinstance(start, AllocatorState) else None
    calls = 1
    if micro_batches is not None:
        assert call_context is None
        call_context, starter, calls = micro_batches, micro_batches.starter(starter), micro_batches.per_step
    return run_estimate(
        fn,
        make_arguments,
        _device(capture),
        steps=REMEDY_STEPS * calls,
        capacity=capacity,
        start=starter,
        call_context=call_context,
        gpu=capture.gpu,
        stacks=False,  # a remedy reads peaks only: no stack walk per allocation
    )


def _capped(capture: OOMCapture, start: Start, *args: Any, capacity: int, **kwargs: Any) -> int | None:
    """:func:`_peak` under ``capacity`` bytes, or ``None`` where the step does not complete under an
    allocator capped there (retry path included): the question every fit check asks
    (:func:`memlab.estimate.capped.completes_under`)."""
    from memlab.estimate.capped import completes_under

    fitted = completes_under(lambda cap: _peak(capture, start, *args, capacity=cap, **kwargs), capacity)
    return None if fitted is None else fitted.peak_reserved


def _needed(capture: OOMCapture, start: Start, *args: Any, **kwargs: Any) -> int:
    """:func:`_peak` under the capacity, or where that runs out of memory, without a limit (what
    it would need)."""
    peak = _capped(capture, start, *args, capacity=capture.capacity, **kwargs)
    return _peak(capture, start, *args, capacity=None, **kwargs).peak_reserved if peak is None else peak


def _fit(capture: OOMCapture, start: Start, *args: Any, **kwargs: Any) -> tuple[int, bool]:
    """``(peak, spared)``: :func:`_needed`'s peak, and whether the run also fits with
    :data:`SPARE` bytes less (estimated again under ``capacity - SPARE``; from a known state only)."""
    peak = _capped(capture, start, *args, capacity=capture.capacity, **kwargs)
    if peak is None:
        return _peak(capture, start, *args, capacity=None, **kwargs).peak_reserved, False
    if not isinstance(start, AllocatorState):
        return peak, False
    return peak, _capped(capture, start, *args, capacity=capture.capacity - SPARE, **kwargs) is not None


def micro_batch_remedy(capture: OOMCapture, start: Start) -> Remedy | None:
    """The largest micro-batch whose steps with gradient accumulation (:class:`MicroBatches`: as
    many micro-batches as keep the batch, the last one holding the rows left) fit in the capacity
    from ``start`` with :data:`SPARE` bytes to spare, found by doubling then bisection up to the
    batch the call had (:func:`memlab.estimate.fit.search`); ``None`` without a batch, or when the
    whole batch fits (the memory the step lacked is held outside its arguments: see the
    held-across-calls remedy).
    Each micro-batch is a view of its rows of the batch, which stays live. Where the middle
    micro-batches could not be shown to repeat (:attr:`MicroBatches.unproven`), the remedy is a
    margin (``unsure``)."""
    from memlab.estimate.fit import search

    call = capture.call
    found = None if call is None or capture.capacity <= 0 else find_batch(call)
    if found is None:
        return None
    size, dim = found
    if size < 2:
        return None
    assert call is not None
    values = (*call.args, *call.kwargs.values())
    batched = [isinstance(v, torch.Tensor) and v.dim() > dim and v.shape[dim] == size for v in values]

    def peak(micro: int, capacity: int | None) -> tuple[int | None, bool]:
        """The micro-batched step's peak under ``capacity`` (``None``: it does not complete there;
        a ``capacity`` of ``None``: unbounded), and whether its middle micro-batches were unproven."""
        plan = MicroBatches(size, micro, dim)
        step = plan.step(call.func, batched, len(call.args), list(call.kwargs))
        arguments = (step, lambda: (values, {}))
        if capacity is None:
            return _peak(capture, start, *arguments, None, micro_batches=plan).peak_reserved, plan.unproven
        return _capped(capture, start, *arguments, capacity=capacity, micro_batches=plan), plan.unproven

    def fits(micro: int) -> bool:  # with one small segment to spare (see unsure())
        return peak(micro, capture.capacity - SPARE)[0] is not None

    micro = search(fits, 1, size)[0]
    if micro >= size:
        return None
    needs, unproven = peak(max(micro, 1), capture.capacity)
    if needs is None:
        needs, unproven = peak(1, None)
    assert needs is not None
    steps = math.ceil(size / max(micro, 1))
    why = unsure(start, spared=micro > 0)
    if why is None and unproven:
        why = (
            f"the allocator did not repeat itself within {MIDDLE_ESTIMATED} middle micro-batches, "
            "so the other ones were not estimated"
        )
    return Remedy(
        "micro_batch",
        f"micro-batches of {max(micro, 1)} (of {size}), {steps} accumulation steps",
        needs,
        capture.capacity,
        {"micro_batch": max(micro, 1), "batch": size, "accumulation_steps": steps, "largest_fitting": micro},
        unsure=why,
    )


def _device(capture: OOMCapture) -> torch.device:
    return torch.device(capture.device)


def unsure(start: Start, spared: bool = True) -> str | None:
    """Why a step remedy estimated from ``start`` promises nothing (``Remedy.unsure``), or ``None``
    when it starts from the state it will meet and also fits with :data:`SPARE` bytes less
    (``spared``): a user's loop around the changed step keeps a few small tensors the estimated
    step did not (the last loss, a value logged), and where those need a new small-pool segment,
    that segment must fit."""
    if not isinstance(start, AllocatorState):
        return f"the state at the failure is unknown ({start}), so estimated from an empty allocator"
    if not spared:
        return (
            f"it fits with less than {format_size(SPARE)} to spare, which a small tensor the loop "
            "keeps beyond the step (a logged loss) can take"
        )
    return None


def step_peak(
    capture: OOMCapture,
    start: Start,
    context: contextlib.AbstractContextManager[Any] | None = None,
    call_context: CallContext | None = None,
) -> int:
    """Peak reserved bytes of the watched call's step estimated under ``context`` (and each call
    under ``call_context(copier, index)``, given the copies) for :data:`REMEDY_STEPS` steps from
    ``start`` under the capacity, or without a limit where it does not fit there (what it would
    need)."""
    call = capture.call
    assert call is not None
    with context or contextlib.nullcontext():
        return _needed(capture, start, call.func, lambda: (call.args, call.kwargs), call_context=call_context)


def step_fit(
    capture: OOMCapture,
    start: Start,
    context: contextlib.AbstractContextManager[Any] | None = None,
    call_context: CallContext | None = None,
) -> tuple[int, bool]:
    """:func:`step_peak`, and whether the step also fits with :data:`SPARE` bytes less (see
    :func:`_fit`): what a step remedy needs to say "fits"."""
    call = capture.call
    assert call is not None
    with context or contextlib.nullcontext():
        return _fit(capture, start, call.func, lambda: (call.args, call.kwargs), call_context=call_context)


def _autocast_remedy(capture: OOMCapture, start: Start, dtype: torch.dtype, kind: str) -> Remedy | None:
    device_type = torch.device(capture.device).type
    if capture.call is None or capture.capacity <= 0 or device_type not in ("cpu", "cuda"):
        return None
    peak, spared = step_fit(capture, start, torch.autocast(device_type, dtype=dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype_name]
    return Remedy(
        kind,
        f'torch.autocast("{device_type}", torch.{dtype_name}) ({short})',
        peak,
        capture.capacity,
        unsure=unsure(start, spared),
    )


def bf16_autocast_remedy(capture: OOMCapture, start: Start) -> Remedy | None:
    """The step estimated under ``torch.autocast(<device type>, torch.bfloat16)``."""
    return _autocast_remedy(capture, start, torch.bfloat16, "autocast_bf16")


def fp16_autocast_remedy(capture: OOMCapture, start: Start) -> Remedy | None:
    """The step estimated under ``torch.autocast("cuda", torch.float16)``: on CUDA devices only,
    for GPUs without bfloat16 (on CPU the bf16 remedy is the one listed)."""
    if torch.device(capture.device).type != "cuda":
        return None
    return _autocast_remedy(capture, start, torch.float16, "autocast_fp16")


def _checkpointing_first(
    model: torch.nn.Module, names: list[str], flops: list[Cost] | None = None
) -> CallContext:
    """The ``call_context`` that checkpoints the blocks ``names`` of the estimate's copy of ``model``
    before the first call (:func:`memlab.plan.checkpointing.checkpoint`: a Hugging Face layer with its
    own switch, which drops its KV cache; any other block by its ``forward``; only the copy changes)
    and, given ``flops``, counts each call's FLOPs into it."""
    from memlab.plan.checkpointing import checkpoint
    from memlab.plan.flops import counting

    counted = counting(flops) if flops is not None else None

    @contextlib.contextmanager
    def applied(copier: Any, index: int) -> Iterator[None]:
        if index == 0 and names:
            copies = [copy for copy in copier.modules if type(copy) is type(model)]
            if not copies:
                raise ValueError(f"the estimate made no copy of the {type(model).__name__} to checkpoint")
            for copy in copies:  # the copy the estimate made of the user's model
                checkpoint([copy.get_submodule(name) for name in names])
        with counted(copier, index) if counted else contextlib.nullcontext():
            yield

    return applied


def _step_model(call: Any) -> torch.nn.Module | None:
    """The model of a watched call: the first module among its arguments, the objects its function
    names (the owner of a bound method) and the modules they hold as attributes."""
    from memlab.estimate.copies import named_objects
    from memlab.oom.names import holders

    roots = holders([*call.args, *call.kwargs.values(), *named_objects(call.func)])
    return next((root for root in roots if isinstance(root, torch.nn.Module)), None)


def checkpointing_remedy(capture: OOMCapture, start: Start) -> Remedy | None:
    """The fewest of the step's model's blocks (:func:`memlab.plan.checkpointing.candidate_blocks`)
    to checkpoint for the failing step to fit, from the state at the failure: the search
    :func:`memlab.plan` makes (:func:`memlab.plan.search.search_plan`), with a fit decided under
    the capacity less :data:`SPARE` bytes where that state is known, so the remedy and a plan never
    disagree. The remedy's peak is that of the chosen count estimated as every step remedy is
    (:func:`step_fit`); where no count fits, that of the count that needs the least. ``None``
    without a model with blocks. A model that cannot be checkpointed raises, and the report says
    why (:func:`memlab.oom.postmortem.build_report`)."""
    from memlab.estimate.capped import completes_under
    from memlab.plan.checkpointing import candidate_blocks
    from memlab.plan.search import search_plan

    call = capture.call
    if call is None or capture.capacity <= 0:
        return None
    model = _step_model(call)
    blocks = [] if model is None else candidate_blocks(model)
    if model is None or not blocks:
        return None
    names = [name for name, _ in blocks]
    limit = capture.capacity - (SPARE if isinstance(start, AllocatorState) else 0)

    def make() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return call.args, call.kwargs

    def run(count: int, _: Any) -> Outcome:  # checkpointing only: no settings
        flops: list[Cost] = []
        context = _checkpointing_first(model, names[:count], flops)
        unbounded = _peak(capture, start, call.func, make, None, call_context=context)
        within = completes_under(
            lambda cap: _peak(capture, start, call.func, make, cap, call_context=context),
            limit,
            known=unbounded,
        )
        return unbounded, flops[-1], within

    found = search_plan(run, blocks, limit)
    chosen = found.checkpointed
    if found.fits and not chosen:
        return None  # the step as it is fits from this state: no checkpointing to recommend
    if not chosen:  # checkpointing lowers nothing as far as tried: the count tried that needs the least
        chosen = names[: min((peak, count) for count, _, peak in found.tried if count)[1]]
    peak, spared = step_fit(capture, start, call_context=_checkpointing_first(model, chosen))
    block = type(blocks[0][1]).__name__
    action = f"checkpoint {len(chosen)} of the {len(names)} {block} blocks ({chosen[0]} to {chosen[-1]})"
    if len(chosen) == 1:
        action = f"checkpoint 1 of the {len(names)} {block} blocks ({chosen[0]})"
    details: dict[str, Any] = {
        "block": block,
        "blocks": len(names),
        "checkpointed": chosen,
        "transformers": found.layers,
    }
    return Remedy("checkpointing", action, peak, capture.capacity, details, unsure=unsure(start, spared))


#: The step remedies, in the order they are listed: each takes the capture and the state at the
#: failure (or why it is unknown).
STEP_REMEDIES: tuple[Callable[[OOMCapture, Start], Remedy | None], ...] = (
    micro_batch_remedy,
    bf16_autocast_remedy,
    fp16_autocast_remedy,
    checkpointing_remedy,
)
