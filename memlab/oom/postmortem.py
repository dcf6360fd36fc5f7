"""From a capture to a verdict and remedies: fragmentation or shortage, and what would fit.

Each remedy is a function of the capture that returns a :class:`~memlab.oom.report.Remedy` with a
computed peak, or ``None`` where it does not apply or cannot be computed (no history, no step to
estimate): a remedy is never shown without its number. Allocator remedies replay the recorded
allocations through :class:`memlab.CachingAllocatorModel` with another setting, and estimate the
watched step from the state the failing call would have found under it; step remedies
(:mod:`memlab.oom.step`) estimate the failing step under the change without running it, from the
allocator state right after the failure (:mod:`memlab.oom.state`).
"""

from __future__ import annotations

import linecache
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from memlab._progress import Progress
from memlab._units import format_size
from memlab.oom.capture import OOMCapture, failing_frame, traceback_stack
from memlab.oom.report import FRAGMENTATION, SHORTAGE, OOMReport, Place, Remedy
from memlab.sources.allocator import CachingAllocatorModel
from memlab.sources.allocator.config import K_LARGE_BUFFER, parse_alloc_conf
from memlab.sources.workspace_note import workspaces_note

__all__ = [
    "ALLOCATOR_REMEDIES",
    "MAX_SPLIT_CANDIDATES_MB",
    "build_report",
    "not_estimated",
    "replay_peak",
    "trace_events",
    "verdict",
]

#: The ``max_split_size_mb`` values the replay tries (PyTorch needs more than 20).
MAX_SPLIT_CANDIDATES_MB = (32, 64, 128, 256, 512, 1024)
_MIB = 1 << 20

Event = tuple[str, int, int, int]  # (action, address, size, time_us)


def verdict(capture: OOMCapture) -> str:
    """:data:`FRAGMENTATION` when the free bytes in all (the device's unreserved bytes plus cached
    free blocks, i.e. capacity minus allocated) would hold the requested block, yet no free block
    or new segment could; :data:`SHORTAGE` when even all of it together is too small."""
    allocated = capture.stats.get("allocated_bytes.all.current", 0)
    return FRAGMENTATION if capture.capacity - allocated >= capture.block_size else SHORTAGE


def trace_events(snapshot: dict[str, Any], device: int = -1) -> list[Event]:
    """The allocations and releases of one device's trace in a memory snapshot, oldest first, as
    ``(action, address, size, time_us)`` with action ``"alloc"`` or ``"free"`` (a release as it
    completed; sizes are the trace's: requested bytes in memlab's traces)."""
    traces = snapshot.get("device_traces") or [[]]
    events = []
    for entry in traces[device]:
        action = entry["action"]
        if action == "alloc":
            events.append(("alloc", entry["addr"], entry["size"], entry.get("time_us", 0)))
        elif action == "free_completed":
            events.append(("free", entry["addr"], entry["size"], entry.get("time_us", 0)))
    return events


def replay_peak(
    events: Iterable[Event],
    config: str,
    request: int,
    release: Iterable[int] = (),
    release_at_us: int | None = None,
) -> int:
    """Peak reserved bytes of replaying ``events`` (see :func:`trace_events`) and then one more
    allocation of ``request`` bytes through ``CachingAllocatorModel(config=config)`` with no
    capacity. ``release`` are addresses of blocks live at the end that are freed instead at the
    first event at or after ``release_at_us`` (or before the request): what freeing them at that
    moment would have changed."""
    model = CachingAllocatorModel(config=config)
    handles: dict[int, int] = {}
    pending = set(release)
    for action, addr, size, time_us in events:
        if pending and release_at_us is not None and time_us >= release_at_us:
            _release(model, handles, pending)
        if action == "alloc":
            handles[addr] = model.malloc(size)
        else:
            handle = handles.pop(addr, None)
            if handle is not None:
                model.free(handle)
    if pending:
        _release(model, handles, pending)
    model.malloc(request)
    return model.memory_stats()["reserved_bytes.all.peak"]


def _release(model: CachingAllocatorModel, handles: dict[int, int], addresses: set[int]) -> None:
    for addr in addresses:
        handle = handles.pop(addr, None)
        if handle is not None:
            model.free(handle)
    addresses.clear()


def _with_option(config: str, option: str) -> str:
    return f"{config},{option}" if config.strip() else option


def _replayable(capture: OOMCapture) -> bool:
    """Whether the capture's trace can be replayed: it holds every event since the allocator began
    (a ring buffer that dropped entries, or PyTorch's history switched on late, would replay a
    different run), checked by replaying it as it was: the allocated bytes must come out equal."""
    if capture.snapshot is None or not capture.trace_complete or capture.capacity <= 0:
        return False
    if capture.trace_checked is None:
        model = CachingAllocatorModel(config=capture.config)
        handles: dict[int, int] = {}
        for action, addr, size, _ in trace_events(capture.snapshot):
            if action == "alloc":
                handles[addr] = model.malloc(size)
            elif addr in handles:
                model.free(handles.pop(addr))
        allocated = model.memory_stats()["allocated_bytes.all.current"]
        capture.trace_checked = allocated == capture.stats.get("allocated_bytes.all.current")
    return capture.trace_checked


def _setting_peak(capture: OOMCapture, config: str, replayed: int) -> tuple[int, str | None]:
    """``(peak reserved, unsure)`` of allocator settings ``config``: with a watched step that keeps
    nothing across calls, the step estimated for whole steps from the history before the failing
    call replayed under ``config`` (what a restart with it meets); otherwise ``replayed``, the peak
    of the replay up to the failing request, which says nothing of the rest of the step."""
    if capture.call is None:
        return replayed, "replayed up to the failing request only, with no watched step to estimate the rest"
    if capture.held:
        return replayed, f"replayed up to the failing request only: {_KEEPS}"
    from memlab.oom.state import state_before_call
    from memlab.oom.step import step_peak

    return step_peak(capture, state_before_call(capture, config)), None


_KEEPS = "a step that keeps tensors across calls is not estimated again"


def expandable_segments_remedy(capture: OOMCapture) -> Remedy | None:
    """``expandable_segments:True`` (only for fragmentation, when it is off): see
    :func:`_setting_peak`."""
    if not _replayable(capture) or verdict(capture) != FRAGMENTATION:
        return None
    if parse_alloc_conf(capture.config).expandable_segments:
        return None
    config = _with_option(capture.config, "expandable_segments:True")
    replayed = replay_peak(trace_events(capture.snapshot), config, capture.requested)  # type: ignore[arg-type]
    peak, unsure = _setting_peak(capture, config, replayed)
    return Remedy(
        "expandable_segments",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        peak,
        capture.capacity,
        unsure=unsure,
    )


def max_split_size_remedy(capture: OOMCapture) -> Remedy | None:
    """Replay with each of :data:`MAX_SPLIT_CANDIDATES_MB` as ``max_split_size_mb``, keep the
    lowest peak (the largest value among equal peaks) and predict it as :func:`_setting_peak`
    does. Only for fragmentation without expandable segments and without a ``max_split_size_mb``
    already at least as small."""
    if not _replayable(capture) or verdict(capture) != FRAGMENTATION:
        return None
    current = parse_alloc_conf(capture.config)
    if current.expandable_segments:
        return None
    events = trace_events(capture.snapshot)  # type: ignore[arg-type]
    best: tuple[int, int] | None = None
    for megabytes in MAX_SPLIT_CANDIDATES_MB:
        if megabytes * _MIB >= current.max_split_size or megabytes * _MIB <= K_LARGE_BUFFER:
            continue
        peak = replay_peak(
            events, _with_option(capture.config, f"max_split_size_mb:{megabytes}"), capture.requested
        )
        if best is None or peak <= best[0]:
            best = (peak, megabytes)
    if best is None:
        return None
    replayed, megabytes = best
    peak, unsure = _setting_peak(
        capture, _with_option(capture.config, f"max_split_size_mb:{megabytes}"), replayed
    )
    return Remedy(
        "max_split_size_mb",
        f"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{megabytes}",
        peak,
        capture.capacity,
        {"max_split_size_mb": megabytes},
        unsure=unsure,
    )


def free_held_remedy(capture: OOMCapture) -> Remedy | None:
    """Free the tensors an earlier call of the step left alive and this call cannot reach
    (:attr:`OOMCapture.held`) before the call: the bytes it frees, and the peak of the replay with
    those blocks released when the call began, up to the failing request (the step, which keeps
    tensors, is not estimated again: the prediction is a margin, see ``Remedy.unsure``)."""
    if not capture.held or capture.call is None or not _replayable(capture):
        return None
    frees = sum(block.size for block in capture.held)
    places = sorted({block.allocated_at for block in capture.held if block.allocated_at})
    peak = replay_peak(
        trace_events(capture.snapshot),  # type: ignore[arg-type]
        capture.config,
        capture.requested,
        release=[block.address for block in capture.held],
        release_at_us=capture.call.started_us,
    )
    count = len(capture.held)
    where = f", from {', '.join(os.path.basename(place) for place in places[:2])}" if places else ""
    return Remedy(
        "free_held",
        f"free {count} tensor{'s' if count > 1 else ''} held across calls ({format_size(frees)}{where})",
        peak,
        capture.capacity,
        {"frees": frees, "tensors": count, "allocated_at": places},
        unsure=f"replayed up to the failing request only: {_KEEPS}",
    )


#: The allocator remedies, in the order they are listed.
ALLOCATOR_REMEDIES: tuple[Callable[[OOMCapture], Remedy | None], ...] = (
    expandable_segments_remedy,
    max_split_size_remedy,
    free_held_remedy,
)


def _place(stack: tuple[tuple[str, int, str], ...]) -> Place | None:
    frame = failing_frame(stack)
    if frame is None:
        return None
    filename, line, function = frame
    return Place(filename, line, function, linecache.getline(filename, line).strip())


def _remedies(capture: OOMCapture, notes: list[str]) -> tuple[Remedy, ...]:
    """The remedies of ``capture`` that apply, each estimated in turn (the progress of which a
    terminal shows: :mod:`memlab._progress`); ``notes`` gets one line per remedy left out."""
    from memlab.oom.state import failure_state
    from memlab.oom.step import STEP_REMEDIES

    step = not capture.held and capture.call is not None
    todo = [*ALLOCATOR_REMEDIES, *(STEP_REMEDIES if step else ())]
    found: list[Remedy | None] = []
    start: Any = None  # the state the step remedies start from, made before the first of them
    with Progress("explain_oom") as shown:
        for index, remedy in enumerate(todo, 1):
            if remedy is STEP_REMEDIES[0]:
                start = failure_state(capture)
            label = _label(remedy.__name__)
            shown.update(f"estimating {label} ({index} of {len(todo)})", logging.DEBUG)
            arguments = (capture, start) if remedy in STEP_REMEDIES else (capture,)
            found.append(_attempt(remedy, notes, *arguments))
        listed = [remedy for remedy in found if remedy is not None]
        shown.done(f"{len(listed)} remed{'y' if len(listed) == 1 else 'ies'} estimated of {len(todo)} tried")
    if capture.held:
        # An estimate starts from the step's arguments: memory held elsewhere would be missing from
        # its "fits", and the rerun would add fake tensors to whatever holds them.
        notes.append(
            "step remedies left out: tensors held across calls are outside the step's arguments, "
            "where estimates cannot see them; free them first"
        )
    return tuple(listed)


def _label(name: str) -> str:
    """A remedy function's name as the report says it: ``max_split_size_remedy`` -> ``max split size``."""
    return name.removesuffix("_remedy").replace("_", " ")


def _attempt(remedy: Callable[..., Remedy | None], notes: list[str], *args: Any) -> Remedy | None:
    try:
        return remedy(*args)
    except Exception as error:  # a remedy that cannot be computed is left out, with a note
        notes.append(not_estimated(remedy.__name__, error))
        return None


#: The longest note a remedy that could not be estimated leaves (one line of the report).
NOTE_WIDTH = 200


def not_estimated(name: str, error: BaseException) -> str:
    """The one-line note of remedy function ``name`` (``checkpointing_remedy``) that raised
    ``error``: ``checkpointing: not estimated: CheckpointError: <the message's first line>``,
    cut to :data:`NOTE_WIDTH` characters."""
    label = _label(name)
    lines = str(error).strip().splitlines()
    note = f"{label}: not estimated: {type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return note if len(note) <= NOTE_WIDTH else note[: NOTE_WIDTH - 1] + "…"


def build_report(
    capture: OOMCapture | None,
    error: BaseException | None,
    caught: bool = False,
    snapshot_path: str | None = None,
    remedies: bool = True,
) -> OOMReport:
    """The :class:`OOMReport` of ``capture`` (the state at the failure; ``None`` when none was
    captured: then only the error and the failing line from its traceback) for ``error`` (the
    exception that left the watched block, or ``None`` when it was swallowed inside).
    ``remedies=False`` leaves out the remedies (no replay, no estimate)."""
    message = str(error) if error is not None else capture.message if capture is not None else ""
    error_type = type(error).__name__ if error is not None else "OutOfMemoryError"
    if capture is None or capture.device == "?":  # nothing captured, or the capture itself failed
        stack = traceback_stack(error) if error is not None else ()
        notes = () if capture is None or capture.note is None else (capture.note,)
        return OOMReport(error_type, message, _place(stack), caught=caught, notes=notes)
    stack = capture.stack or (traceback_stack(error) if error is not None else ())
    notes: list[str] = [] if capture.note is None else [capture.note]
    found = _remedies(capture, notes) if remedies else ()
    stats = capture.stats
    reserved = stats.get("reserved_bytes.all.current", 0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    source = "measured (torch.cuda)" if capture.source == "cuda" else "modelled CUDA caching allocator"
    return OOMReport(
        error_type=error_type,
        message=message,
        place=_place(stack),
        device=capture.device,
        source=source,
        requested=capture.requested,
        block_size=capture.block_size,
        segment_size=capture.segment_size,
        capacity=capture.capacity,
        reserved=reserved,
        allocated=allocated,
        free=capture.capacity - reserved,
        cached_free=reserved - allocated,
        largest_free_block=capture.largest_free_block,
        inactive_split_bytes=stats.get("inactive_split_bytes.all.current", 0),
        verdict=verdict(capture),
        culprits=tuple(capture.culprits),
        remedies=found,
        snapshot_path=snapshot_path,
        caught=caught,
        notes=tuple(notes),
        module=capture.module,
        activations=capture.activations,
        workspaces=workspaces_note(capture.workspaces),
    )
