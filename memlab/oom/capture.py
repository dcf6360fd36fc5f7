"""The state of memory at the moment of an out-of-memory error, captured once as plain data.

A :class:`TensorTracker`'s modelled allocator calls :func:`capture_tracker_oom` (through
``memlab.sources.tracker.OOM_OBSERVERS``) before its ``torch.OutOfMemoryError`` leaves the op; on a
GPU PyTorch's out-of-memory observer calls :func:`capture_cuda_oom`. Both read the allocator's
statistics, its segments, the Python stack and the largest live tensors while they are still what
they were when the request failed; :mod:`memlab.oom.postmortem` turns a capture into a report.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch

from memlab._gpus import GPU
from memlab._tensors import live_tensors, storages_of
from memlab._user_code import user_frame
from memlab.history import categories
from memlab.history.recorder import Frame, Stack, capture_stack, is_own_file
from memlab.oom.names import Culprit, culprits
from memlab.sources.allocator.config import allocation_size, round_size
from memlab.sources.tracker import active_tracker
from memlab.sources.workspace_note import ModelledWorkspaces, tracker_workspaces

__all__ = [
    "Call",
    "HeldBlock",
    "OOMCapture",
    "capture_cuda_oom",
    "capture_tracker_oom",
]

_MODEL_STATE = {categories.PARAMETER, categories.BUFFER, categories.GRADIENT, categories.OPTIMIZER_STATE}
_NOT_HELD = {*_MODEL_STATE, categories.WORKSPACE}  # what the step needs in every call
_sequence = itertools.count(1)


class Call:
    """One call of a watched step (a profiled function, or a function given to ``explain_oom``):
    the function, its arguments, and when it started (microseconds since the epoch, the clock of
    the history's trace entries). A plain class: one is made per watched call."""

    __slots__ = ("args", "batch_dim", "func", "kwargs", "started_us")

    def __init__(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        started_us: int,
        batch_dim: int | None = None,
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.started_us = started_us
        self.batch_dim = batch_dim

    @property
    def code(self) -> CodeType | None:
        """The code object of the step (decorators unwrapped), or ``None`` for a callable without one."""
        func = self.func
        while hasattr(func, "__wrapped__"):
            func = func.__wrapped__
        return getattr(func, "__code__", None)


@dataclass(frozen=True)
class HeldBlock:
    """A block allocated by an earlier call of the step, alive at the OOM, that the failing call
    cannot reach: its bytes, category and ``file:line`` of its allocation."""

    address: int
    size: int
    category: str
    allocated_at: str | None


@dataclass
class OOMCapture:
    """What was true when a request failed; sizes in bytes.

    ``requested`` is the storage's size, ``block_size`` the allocator's rounded block for it and
    ``segment_size`` the device allocation it tried (``Tried to allocate`` in PyTorch's message).
    ``kept`` maps ``id`` of each storage that the call's arguments and the names its function
    uses hold (parameters, gradients, optimizer state, inputs: what outlives the failure) to the
    address of its block (with a trace only; see :func:`kept_blocks`).
    ``stats`` are ``memory_stats()`` at that moment (after the allocator's retry path freed its
    unused cached segments). ``snapshot`` is the ``torch.cuda.memory._snapshot()`` dict (with its
    trace where a history was recorded), ``trace_complete`` whether that trace holds every event
    since the allocator began (what a replay needs). ``gpu``: the GPU a tracker's modelled run
    models (whose cuBLAS workspaces remedies estimated for the step count), ``None`` for a real
    GPU's error, whose remedies model the GPU in use; ``workspaces``: the cuBLAS workspaces that
    run had modelled on the device, which its numbers include (``None``: none).
    ``module`` is ``(path, "forward" | "backward")``
    of the module that was running and ``activations`` ``(path, bytes)`` of the module whose saved
    tensors held the most, where a tracker recorded memory per module
    (:meth:`memlab.TensorTracker.by_module`); ``None`` otherwise.
    """

    error_id: int
    message: str
    device: str
    source: str
    stack: Stack
    requested: int
    block_size: int
    segment_size: int
    capacity: int
    stats: dict[str, int]
    largest_free_block: int
    config: str = ""
    culprits: list[Culprit] = field(default_factory=list)
    held: list[HeldBlock] = field(default_factory=list)
    snapshot: dict[str, Any] | None = None
    trace_complete: bool = False
    trace_checked: bool | None = None  # whether a replay of the trace ends where the allocator was
    call: Call | None = None
    note: str | None = None
    kept: dict[int, int] = field(default_factory=dict)
    module: tuple[str, str] | None = None
    activations: tuple[str, int] | None = None
    sequence: int = field(default_factory=lambda: next(_sequence))
    gpu: GPU | None = None
    workspaces: ModelledWorkspaces | None = None


def _largest_free_block(segments: Iterable[dict[str, Any]]) -> int:
    return max(
        (
            block["size"]
            for segment in segments
            for block in segment["blocks"]
            if block["state"] == "inactive"
        ),
        default=0,
    )


def _step_frame(code: CodeType | None) -> FrameType | None:
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _place(frames: list[dict[str, Any]]) -> str | None:
    """``file:line`` of the innermost of a snapshot's ``frames`` in the user's code."""
    frame = user_frame([(f["filename"], f["line"]) for f in frames])
    return None if frame is None else f"{frame[0]}:{frame[1]}"


def _in_code(frames: list[dict[str, Any]], code: CodeType) -> bool:
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return any(
        f["filename"] == code.co_filename
        and f["name"] == code.co_name
        and code.co_firstlineno <= f["line"] <= last
        for f in frames
    )


def _held_across_calls(tracker: Any, snapshot: dict[str, Any], call: Call | None) -> list[HeldBlock]:
    """Blocks alive now that an earlier call of the step allocated (the step's code is on their
    allocation stack, before this call began) and that this call cannot reach: not held by the
    step's local variables (its arguments included), not a parameter, buffer, gradient or optimizer
    state, nor a cuBLAS workspace (kept by PyTorch for every later matmul). Needs a history
    (allocation stacks and times); empty otherwise."""
    code = None if call is None else call.code
    if code is None or not snapshot["device_traces"] or not snapshot["device_traces"][-1]:
        return []
    allocated_us: dict[int, int] = {}
    for entry in snapshot["device_traces"][-1]:
        if entry["action"] == "alloc":
            allocated_us[entry["addr"]] = entry["time_us"]
    frame = _step_frame(code)
    roots = list(frame.f_locals.values()) if frame is not None else [*call.args, *call.kwargs.values()]
    del frame
    needed = {tracker.block_address(t) for t in live_tensors(roots)}
    for tensor in live_tensors():  # parameters and gradients of models the step reaches through globals
        if tensor.requires_grad and tensor.is_leaf:
            needed.add(tracker.block_address(tensor))
            if tensor.grad is not None:
                needed.add(tracker.block_address(tensor.grad))
    held = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated" or block["address"] in needed:
                continue
            if (
                block["category"] in _NOT_HELD
                or allocated_us.get(block["address"], call.started_us) >= call.started_us
            ):
                continue
            if _in_code(block["frames"], code):
                held.append(
                    HeldBlock(block["address"], block["size"], block["category"], _place(block["frames"]))
                )
    return held


def kept_blocks(call: Call | None, address: Callable[[torch.Tensor], int | None]) -> dict[int, int]:
    """``id(storage) -> block address`` (``address(tensor)``; ``None``: not in a block) of the
    storages held by ``call``'s arguments and by the objects its function names (a global model
    and optimizer): the memory that outlives the failing call, whatever it allocated."""
    if call is None:
        return {}
    from memlab.estimate.copies import named_objects

    roots = [*call.args, *call.kwargs.values(), *named_objects(call.func)]
    kept: dict[int, int] = {}
    for tensor in live_tensors(roots):
        storages = storages_of(tensor)
        found = address(tensor) if storages else None  # the block of its first storage
        if found is not None:
            kept[id(storages[0])] = found
    return kept


def capture_tracker_oom(
    tracker: Any,
    storage: torch.UntypedStorage,
    nbytes: int,
    error: torch.OutOfMemoryError,
    call: Call | None,
) -> OOMCapture:
    """The state of ``tracker``'s allocator for ``storage``'s device when its ``nbytes`` bytes did
    not fit (called from the tracker before ``error`` leaves the op)."""
    device = storage.device
    allocator = tracker._allocator_for(device)
    stats = dict(allocator.memory_stats())
    config = getattr(allocator, "config", None)
    block_size = round_size(nbytes, config) if config is not None else nbytes
    segments = allocator.snapshot()
    capture = OOMCapture(
        error_id=id(error),
        message=str(error),
        device=str(device),
        source="tracker",
        stack=capture_stack(),
        requested=nbytes,
        block_size=block_size,
        segment_size=allocation_size(block_size) if config is not None else nbytes,
        capacity=allocator.capacity or 0,
        stats=stats,
        largest_free_block=_largest_free_block(segments),
        config="" if config is None else config.source,
        call=call,
        gpu=tracker.gpu if tracker.workspaces is not None else None,
        workspaces=tracker_workspaces(tracker, device),
    )
    _modules_at_oom(capture, tracker, device)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        device_model = "cuda" if tracker.allocator == "cuda" else None
        capture.culprits = culprits(device, call, tracker, device_model, storage)
        history = allocator.history
        if history is not None:
            capture.snapshot = tracker.snapshot(device)
            capture.trace_complete = history.recorded == len(history)
            capture.held = _held_across_calls(tracker, capture.snapshot, call)
            capture.kept = kept_blocks(call, tracker.block_address)
    finally:
        if was_enabled:
            gc.enable()
    return capture


def _modules_at_oom(capture: OOMCapture, tracker: Any, device: torch.device) -> None:
    """The module running and the one holding the most activations on ``device``, where
    ``tracker`` records memory per module."""
    recorder = None if tracker is None else tracker.module_recorder
    if recorder is not None and recorder.active:
        capture.module = recorder.running()
        capture.activations = recorder.most_activations(device)


def capture_cuda_oom(
    device: int, alloc: int, device_allocated: int, device_free: int, call: Call | None
) -> OOMCapture:
    """The state of CUDA device ``device`` when PyTorch's allocator failed to allocate ``alloc``
    bytes (PyTorch's out-of-memory observer's arguments): ``torch.cuda.memory_stats``, the
    memory snapshot (with its trace when ``torch.cuda.memory._record_memory_history`` is on) and
    the largest live tensors."""
    stats = dict(torch.cuda.memory_stats(device))
    snapshot = torch.cuda.memory._snapshot()
    segments = [s for s in snapshot["segments"] if s["device"] == device]
    traces = snapshot.get("device_traces", [])
    reserved = stats.get("reserved_bytes.all.current", 0)
    capture = OOMCapture(
        error_id=0,
        message="",
        device=f"cuda:{device}",
        source="cuda",
        stack=capture_stack(),
        requested=alloc,
        block_size=alloc,
        segment_size=alloc,
        capacity=reserved + device_free,
        stats=stats,
        largest_free_block=_largest_free_block(segments),
        config=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")),
        snapshot=snapshot,
        trace_complete=bool(traces and device < len(traces) and traces[device]),  # checked by a replay
        call=call,
    )
    _modules_at_oom(capture, active_tracker(), torch.device("cuda", device))
    capture.culprits = culprits(torch.device("cuda", device), call, None, None)
    if capture.trace_complete:
        capture.kept = kept_blocks(call, lambda t: _cuda_block(t, device))
    return capture


def _cuda_block(tensor: torch.Tensor, device: int) -> int | None:
    """The address of the CUDA caching allocator's block that holds ``tensor``'s storage: where the
    storage's data starts (a block is handed out from its start)."""
    if tensor.device != torch.device("cuda", device):
        return None
    return tensor.untyped_storage().data_ptr() or None


def failing_frame(stack: Stack) -> Frame | None:
    """The innermost frame of ``stack`` (innermost first) in the user's code: outside torch,
    memlab and every installed package (:func:`memlab._user_code.user_frame`); where all are
    libraries', the innermost outside torch and memlab."""
    own = [frame for frame in stack if not is_own_file(frame[0])]
    return user_frame(own)


def traceback_stack(error: BaseException) -> Stack:
    """The frames of ``error``'s traceback outside torch and memlab, innermost first."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_own_file(code.co_filename):
            frames.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return tuple(reversed(frames))


def now_us() -> int:
    """Microseconds since the epoch, the clock of the history's trace entries."""
    return time.time_ns() // 1000
