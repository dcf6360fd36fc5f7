"""The allocator a remedy meets: the process's allocator right after the failure, rebuilt from the
recorded history, so that a remedy is estimated from there and not from an empty allocator.

Right after an out-of-memory error the process still holds its cached segments (those the
allocator's retry path could not release) and the blocks of every tensor that outlives the failing
call: the model, its gradients, the optimizer state, the inputs, and whatever was alive before the
call began. The blocks the failing call allocated for itself (activations, temporaries) are freed
as its frames go, and stay cached. :func:`failure_state` replays the history into a
:class:`~memlab.sources.allocator.CachingAllocatorModel` under the same capacity and configuration,
fails the same request, checks that the replay ends where the allocator was, and frees those
blocks; an estimate then starts there (:meth:`AllocatorState.starter`), each copy of a live tensor
in its original's block. :func:`state_before_call` is the state the failing call found, replayed
under other allocator settings (what restarting with them would give).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memlab._tensors import storages_of
from memlab.history import categories
from memlab.history.recorder import History, capture_stack
from memlab.oom.capture import OOMCapture
from memlab.oom.postmortem import Event, trace_events
from memlab.sources.allocator import CachingAllocatorModel

__all__ = ["AllocatorState", "failure_state", "state_before_call"]


class AllocatorState:
    """An allocator state that remedies are estimated from, rebuilt from a recorded history.

    ``events`` (the trace's allocations and frees, :func:`memlab.oom.postmortem.trace_events`)
    are replayed with ``config`` under ``capacity`` bytes; then, where ``requested`` is given, the
    failing request of that many bytes (which runs the retry path and fails, as it did), and
    where ``started_us`` is given, the blocks allocated from then on (the failing call's) are
    freed, except those of ``kept`` (``id(storage) -> block address``: the storages that the
    call's arguments and names hold, which outlive the failure) and the cuBLAS workspaces
    (``workspaces``: their block addresses; allocated for the process's life, see
    :mod:`memlab.sources.workspaces`).
    """

    def __init__(
        self,
        events: list[Event],
        config: str,
        capacity: int,
        kept: dict[int, int],
        requested: int | None = None,
        started_us: int | None = None,
        workspaces: frozenset[int] = frozenset(),
    ) -> None:
        self.events = events
        self.config = config
        self.capacity = capacity
        self.kept = kept
        self.requested = requested
        self.started_us = started_us
        self.workspaces = workspaces

    def replay(self) -> tuple[CachingAllocatorModel, dict[int, int], dict[int, int]]:
        """``(model, handles, allocated_us)``: the model after the events (and the failing
        request), the handle and allocation time of each live block by trace address.
        ``ValueError`` when the request does not fail there."""
        history = History()  # no stacks while replaying; the estimate records its own
        history.free_category = categories.category_code(categories.TEMPORARY)
        model = CachingAllocatorModel(capacity=self.capacity, config=self.config, history=history)
        handles: dict[int, int] = {}
        allocated_us: dict[int, int] = {}
        for action, addr, size, time_us in self.events:
            if action == "alloc":
                handles[addr] = model.malloc(size)
                allocated_us[addr] = time_us
            else:
                handle = handles.pop(addr, None)
                if handle is not None:
                    model.free(handle)
        if self.requested is None:
            return model, handles, allocated_us
        try:
            model.malloc(self.requested)
        except torch.OutOfMemoryError:
            return model, handles, allocated_us
        raise ValueError("the replayed allocator serves the request that failed")

    def build(self, capacity: int | None) -> tuple[CachingAllocatorModel, dict[int, int]]:
        """A new model in this state, its peaks reset, measured under ``capacity`` from then on
        (``None``: no limit), and the handle of each live block by its trace address."""
        model, handles, allocated_us = self.replay()
        if self.started_us is not None:
            kept = set(self.kept.values()) | self.workspaces
            for addr in [a for a, us in allocated_us.items() if a in handles and us >= self.started_us]:
                if addr not in kept:
                    model.free(handles.pop(addr))
        model.set_capacity(capacity)
        model.reset_peak_memory_stats()
        assert model.history is not None
        model.history.stack = capture_stack
        return model, handles

    def starter(self, capacity: int | None) -> Callable[[Any, Any], None]:
        """The ``start`` of :func:`memlab.estimate.estimate.run_estimate` that begins the estimate
        from a new :meth:`build` of this state: the copy of each tensor whose storage ``kept``
        names occupies its original's block instead of being allocated anew, and the first ops
        that need a cuBLAS workspace use the state's."""

        def start(tracker: Any, copier: Any) -> None:
            model, handles = self.build(capacity)
            blocks: list[tuple[torch.UntypedStorage, int]] = []
            used: set[int] = set()  # handles placed
            placed: set[int] = set()  # ids of the storages placed (several copies may share one)
            for original, copy in zip(copier.originals, copier.copies, strict=True):
                storages, copied = storages_of(original), storages_of(copy)
                handle = handles.get(self.kept.get(id(storages[0]), -1)) if storages and copied else None
                if handle is None or handle in used or id(copied[0]) in placed:
                    continue
                blocks.append((copied[0], handle))
                used.add(handle)
                placed.add(id(copied[0]))
            workspaces = sum(1 for addr in self.workspaces if addr in handles)
            tracker.resume(model, blocks, workspaces=workspaces)

        return start


def failure_state(capture: OOMCapture) -> AllocatorState | str:
    """The allocator right after the failure of a capture with a watched call: its history
    replayed, the failing request failed again, the call's own blocks freed (see
    :class:`AllocatorState`); or why it is unknown: no recorded history (a ``TensorTracker``
    without ``history``, a GPU without ``torch.cuda.memory._record_memory_history()``), a history
    that does not reach back to the allocator's start (a ring buffer that dropped entries, a
    history switched on late), or a replay that does not end where the allocator was
    (``empty_cache()`` called, say)."""
    snapshot = capture.snapshot
    traces = [] if snapshot is None else snapshot.get("device_traces") or []
    device = _trace_index(capture)
    if device is None or not -len(traces) <= device < len(traces) or not traces[device]:
        return "no history"
    if not capture.trace_complete or capture.call is None or capture.capacity <= 0:
        return "the history does not reach back to the allocator's start"
    state = AllocatorState(
        trace_events(snapshot, device),  # type: ignore[arg-type]
        capture.config,
        capture.capacity,
        capture.kept,
        capture.requested,
        capture.call.started_us,
        _workspaces(snapshot, device),  # type: ignore[arg-type]
    )
    try:
        model, _, _ = state.replay()
    except ValueError:
        return "its replay does not fail where the allocator did"
    stats = model.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current"):
        if stats[key] != capture.stats.get(key):
            return "its replay does not end where the allocator was"
    return state


def state_before_call(capture: OOMCapture, config: str) -> AllocatorState:
    """The allocator as the failing call found it had the process run with allocator settings
    ``config`` from its start: the history before the call replayed under them (a capture with a
    watched call and a complete trace)."""
    assert capture.call is not None and capture.snapshot is not None
    started = capture.call.started_us
    events = trace_events(capture.snapshot, _trace_index(capture))
    allocated_us = {addr: time_us for action, addr, _, time_us in events if action == "alloc"}
    # only what existed when the call began has a block there (a gradient the call made has none)
    kept = {key: addr for key, addr in capture.kept.items() if allocated_us.get(addr, started) < started}
    before = [event for event in events if event[3] < started]
    workspaces = _workspaces(capture.snapshot, _trace_index(capture), started)
    return AllocatorState(before, config, capture.capacity, kept, workspaces=workspaces)


def _workspaces(snapshot: dict[str, Any], device: int | None, before_us: int | None = None) -> frozenset[int]:
    """The addresses of the cuBLAS workspaces among the trace's allocations (allocated before
    ``before_us``, where given): ``alloc`` entries of category ``workspace``, which a tracker's
    history marks (never freed: each is live at the end of the trace). A GPU's own trace does not
    mark them."""
    traces = snapshot.get("device_traces") or [[]]
    return frozenset(
        entry["addr"]
        for entry in traces[-1 if device is None else device]
        if entry["action"] == "alloc"
        and entry.get("category") == categories.WORKSPACE
        and (before_us is None or entry.get("time_us", 0) < before_us)
    )


def _trace_index(capture: OOMCapture) -> int | None:
    """The index of the capture's device among the snapshot's traces (a tracker's one: -1)."""
    return torch.device(capture.device).index if capture.source == "cuda" else -1
