"""Each rank's report, and their gathering onto one rank with ``torch.distributed``'s object
collectives (``gather_object``: any backend; gloo on CPU, NCCL on GPUs).

``torch.distributed`` is imported when :func:`gather` runs, never at import.
"""

from __future__ import annotations

import sys
from typing import Any

from memlab.distributed.merge import FORMAT, LINES, STATS, MergedLines, MergedStats, merge_reports

__all__ = ["gather", "rank_report"]


def _error_text(error: BaseException | str) -> str:
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


def rank_report(source: Any, error: BaseException | str | None = None, func: Any = None) -> dict[str, Any]:
    """This rank's report on ``source``, as plain data (picklable, JSON-able; see
    :mod:`memlab.distributed.merge`).

    ``source`` is a :class:`memlab.LineProfiler` (its line records: ``hits``, the recorded
    statistics and ``delta`` of every registered function; status ``"empty"`` when no profiled
    call ran), a :class:`memlab.TensorTracker` (allocated and reserved peaks and current bytes of
    the device it measures, as :meth:`~memlab.TensorTracker.memory_stats` reads ``device=None``,
    and, with ``history`` on, when its allocated bytes first peaked) or ``None`` (this rank
    profiled nothing). ``func`` selects a line profiler's functions as
    :meth:`memlab.LineProfiler.display` does (default: all). ``error`` (an exception or a message)
    makes it an ``"error"`` report that still carries what was recorded. Raises ``TypeError`` for
    another ``source``.
    """
    from memlab.line_profiler import LineProfiler
    from memlab.sources.tracker import TensorTracker

    report: dict[str, Any] = {
        "format": FORMAT,
        "kind": None,
        "status": "empty",
        "error": None,
        "source": None,
    }
    if isinstance(source, LineProfiler):
        columns = ("hits", *source.columns, "delta")
        tables = source._tables(func, columns)
        from memlab.line_profiler.export import records_to_data

        report.update(kind=LINES, source=source.source_line())
        if any(table.calls for table in tables):
            report.update(status="profiled", data=records_to_data(tables, columns, source.source_line()))
    elif isinstance(source, TensorTracker):
        report.update(kind=STATS)
        if source.devices:
            report.update(status="profiled", **_tracker_report(source))
    elif source is not None:
        raise TypeError(
            f"source must be a memlab.LineProfiler, a memlab.TensorTracker or None (this rank profiled "
            f"nothing); got {type(source).__name__}"
        )
    if error is not None:
        report.update(status="error", error=_error_text(error))
    return report


def _tracker_report(tracker: Any) -> dict[str, Any]:
    from memlab.history.series import memory_series
    from memlab.sources.select import describe_source

    stats = tracker.memory_stats()
    device = next(d for d in tracker.devices if tracker.memory_stats(d) == stats)
    data = {
        "allocated_peak": stats["allocated_bytes.all.peak"],
        "reserved_peak": stats["reserved_bytes.all.peak"],
        "allocated_current": stats["allocated_bytes.all.current"],
        "reserved_current": stats["reserved_bytes.all.current"],
        "peak_time_us": None,
    }
    if tracker.history:
        snapshot = tracker.snapshot()
        trace = [t for t in snapshot["device_traces"] if t]
        if trace:
            # memory_series has one value per alloc, free_completed, segment_free/unmap entry
            counted = [
                e
                for e in trace[0]
                if e["action"] in ("alloc", "free_completed", "segment_free", "segment_unmap")
            ]
            series = memory_series(snapshot)
            if counted and series.allocated:
                data["peak_time_us"] = counted[series.peak]["time_us"]
    return {"source": describe_source(tracker, device), "data": data}


def gather(
    source: Any, dst: int = 0, group: Any = None, error: BaseException | str | None = None, func: Any = None
) -> MergedLines | MergedStats | None:
    """Collect every rank's report on ``source`` (see :func:`rank_report`) on rank ``dst`` and
    return them merged there (``None`` on the other ranks): a
    :class:`~memlab.distributed.merge.MergedLines` (per line: each rank's values, max and min with
    their ranks, skew) for line profilers (``func``: which functions, as for
    :meth:`memlab.LineProfiler.display`), a :class:`~memlab.distributed.merge.MergedStats` (per
    rank peaks, which rank peaked first) for tensor trackers.

    A collective: every rank of ``group`` (default: the whole job) must call it, with the same
    ``dst`` (a global rank), after ``torch.distributed.init_process_group``; it waits at most
    the group's timeout (``init_process_group(timeout=...)``). Call it in a ``finally`` block so
    that a rank that raised still takes part: ``error`` defaults to the exception being handled
    or propagating (``sys.exc_info()``), and the merged table says which ranks raised and which
    profiled nothing. A bad ``source`` still takes part (as an error) before raising
    ``TypeError`` on its rank, so no rank waits for it. Objects travel pickled through
    ``torch.distributed.gather_object``; with NCCL, each rank's current CUDA device must be set
    (``torch.cuda.set_device``), as PyTorch requires. Numbers are what each rank's profiler or
    tracker measured on its own device (see them for what they cannot see).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "gather() needs torch.distributed's default process group: call "
            "torch.distributed.init_process_group(...) on every rank first (torchrun sets its environment)"
        )
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < dist.get_world_size():
        raise ValueError(f"dst must be a rank from 0 to {dist.get_world_size() - 1}, got {dst!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "group must be None (the whole job) or a torch.distributed ProcessGroup "
            f"(torch.distributed.new_group(...)), got {type(group).__name__} {group!r:.80}"
        )
    if error is None:
        error = sys.exc_info()[1]
    problem: TypeError | None = None
    try:
        report = rank_report(source, error, func)
    except TypeError as raised:
        problem = raised
        report = rank_report(None, raised)
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(report, gathered, dst=dst, group=group)
    if problem is not None:
        raise problem
    return None if gathered is None else merge_reports(gathered)
