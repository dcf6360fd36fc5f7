"""Memory over time and per line, as matplotlib figures: :func:`plot_memory` draws a run's
allocated and reserved bytes from its memory snapshot, :func:`plot_lines` a profiler's per-line bars.

The series are computed once (:func:`memory_series`, no matplotlib needed) and then drawn.
matplotlib is imported only when a figure is drawn, so ``import memlab`` never imports it.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memlab.sources.allocator.config import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size

if TYPE_CHECKING:
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure

    from memlab.line_profiler.records import FunctionTable

__all__ = [
    "MemorySeries",
    "binary_size",
    "check_byte_column",
    "memory_series",
    "peak_label",
    "plot_lines",
    "plot_memory",
]

_INSTALL = "plotting needs matplotlib, an optional extra of memlab: pip install 'memlab[plot]'"
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_CODE_WIDTH = 40  # characters of source shown in a bar's label
# Seaborn's "muted" palette, as the text and HTML renderers use.
_COLORS = ("#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4", "#8c613c", "#dc7ec0", "#797979")


@dataclass
class MemorySeries:
    """A run's memory after each allocator event (an ``alloc``, a ``free_completed``, or a
    ``segment_free``/``segment_unmap`` on its own, e.g. by ``empty_cache()``), in bytes.

    ``allocated[i]`` and ``reserved[i]`` are ``allocated_bytes.all.current`` and
    ``reserved_bytes.all.current`` after event ``i``; ``by_category[name][i]`` the allocated bytes
    of blocks of that category (their sum is ``allocated[i]``). ``peak`` is the first event at
    which ``allocated`` is highest and ``peak_frame`` the innermost frame of the allocation
    there, as ``(filename, line, name)`` (``None`` when none was recorded).
    """

    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    by_category: dict[str, list[int]] = field(default_factory=dict)
    peak: int = 0
    peak_frame: tuple[str, int, str] | None = None


class _Segments:
    """The segments of a replayed trace and the live blocks in each, to find the bytes a block
    was granted: the free range it was carved from, unless the allocator split that range."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted segment addresses
        self.sizes: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}  # segment address -> sorted live block addresses

    def add(self, addr: int, size: int) -> None:
        bisect.insort(self.starts, addr)
        self.sizes[addr] = size
        self.blocks[addr] = []

    def remove(self, addr: int) -> None:
        self.starts.remove(addr)
        del self.sizes[addr], self.blocks[addr]

    def _segment(self, addr: int) -> int | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.starts[i] + self.sizes[self.starts[i]]:
            return None
        return self.starts[i]

    def allocate(self, addr: int, requested: int) -> int:
        """Record a block at ``addr`` and return the bytes it was granted (as the caching
        allocator grants them: the rounded request, or the whole free range when the remainder
        is too small to split off; the request itself outside any known segment)."""
        segment = self._segment(addr)
        if segment is None:
            return requested
        blocks = self.blocks[segment]
        i = bisect.bisect_right(blocks, addr)
        end = blocks[i] if i < len(blocks) else segment + self.sizes[segment]
        blocks.insert(i, addr)
        free = end - addr
        rounded = round_size(requested)
        remainder = free - rounded
        if remainder <= 0:
            return free
        split = remainder >= K_MIN_BLOCK_SIZE if rounded <= K_SMALL_SIZE else remainder > K_SMALL_SIZE
        return rounded if split else free

    def release(self, addr: int) -> None:
        segment = self._segment(addr)
        if segment is not None and addr in self.blocks[segment]:
            self.blocks[segment].remove(addr)


def _trace(snapshot: dict[str, Any], device: int | None) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces", [])
    if device is None:
        recorded = [i for i, trace in enumerate(traces) if trace]
        if len(recorded) > 1:
            raise ValueError(f"the snapshot has traces for devices {recorded}: pass device= one of them")
        device = recorded[0] if recorded else len(traces) - 1
    if not 0 <= device < len(traces) or not traces[device]:
        raise ValueError(
            f"the snapshot has no trace entries for device {device}: record them with "
            "memlab.TensorTracker(history=True) (or torch.cuda.memory._record_memory_history() "
            f"on a GPU); devices with entries: {[i for i, t in enumerate(traces) if t] or 'none'}"
        )
    return traces[device]


def memory_series(snapshot: dict[str, Any], device: int | None = None) -> MemorySeries:
    """Replay the trace of ``device`` (an index into ``snapshot["device_traces"]``; ``None``: the
    one device with entries) of a ``torch.cuda.memory._snapshot()``-format dict.

    Trace entries carry requested bytes; the bytes each block was granted are found from the
    segments' layout with the caching allocator's default rules (512 B rounding, splits of the
    small pool from 512 B on and of the large pool above 1 MiB). Not modelled: a configured
    ``roundup_power2_divisions`` or ``max_split_size_mb`` and expandable segments, where a
    block's granted bytes may then differ. A trace that a ring buffer cut short starts from
    zero at its first entry: what was live before is not in it, and frees of blocks and
    segments it does not know change nothing (a block allocated in such a segment counts its
    requested bytes).
    """
    segments = _Segments()
    live: dict[int, tuple[int, str]] = {}  # block address -> (granted bytes, category)
    series = MemorySeries()
    totals: dict[str, int] = {}
    allocated = reserved = 0
    peak_entry: dict[str, Any] | None = None
    for entry in _trace(snapshot, device):
        action, addr = entry["action"], entry.get("addr", 0)
        if action in ("segment_alloc", "segment_map"):
            segments.add(addr, entry["size"])
            reserved += entry["size"]
            continue
        if action == "alloc":
            category = entry.get("category") or "unknown"
            granted = segments.allocate(addr, entry["size"])
            live[addr] = (granted, category)
            allocated += granted
            totals[category] = totals.get(category, 0) + granted
        elif action == "free_completed":
            if addr in live:  # not when a ring buffer dropped its allocation
                granted, category = live.pop(addr)
                segments.release(addr)
                allocated -= granted
                totals[category] -= granted
        elif action in ("segment_free", "segment_unmap"):
            if addr in segments.sizes:
                segments.remove(addr)
                reserved -= entry["size"]
        else:
            continue
        for name in totals.keys() - series.by_category.keys():
            series.by_category[name] = [0] * len(series.allocated)
        for name, values in series.by_category.items():
            values.append(totals[name])
        if action == "alloc" and (peak_entry is None or allocated > series.allocated[series.peak]):
            series.peak, peak_entry = len(series.allocated), entry
        series.allocated.append(allocated)
        series.reserved.append(reserved)
    if peak_entry is not None and peak_entry.get("frames"):
        frame = peak_entry["frames"][0]
        series.peak_frame = (frame["filename"], frame["line"], frame["name"])
    return series


def _matplotlib_figure() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(_INSTALL) from error
    return Figure


def _binary_axis(axis: Axis, top: int) -> None:
    """Ticks at round binary sizes (1, 2, 4, 8... of one unit) labelled ``512 KiB``, ``1.5 MiB``."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    unit, scale = next((u for u in _UNITS if top >= u[1]), _UNITS[-1])
    step = scale
    while top / step > 8:
        step *= 2
    while step > 1 and top / step < 3:
        step //= 2
    axis.set_major_locator(MultipleLocator(step))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value / scale:g} {unit}"))


def _alignment(fraction: float) -> str:
    """Where a label at ``fraction`` of the axis width sits, so that it stays inside the axes."""
    return "left" if fraction < 0.2 else "right" if fraction > 0.8 else "center"


def binary_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it reaches, two decimals: ``39.50 KiB``, ``2.00 MiB``."""
    unit, scale = next((u for u in _UNITS if abs(nbytes) >= u[1]), _UNITS[-1])
    return f"{nbytes / scale:.2f} {unit}"


def _save(figure: Figure, path: str | os.PathLike[str] | None) -> Figure:
    if path is not None:
        figure.savefig(path, dpi=100, bbox_inches="tight")
    return figure


def peak_label(nbytes: int, frame: tuple[str, int, str] | None) -> str:
    """The text that marks a peak: its bytes and the ``file:line`` (the file's base name) of the
    allocation that reached it, e.g. ``peak 53.64 MiB at train.py:12``."""
    if frame is None:
        return f"peak {binary_size(nbytes)} (no Python frame recorded)"
    return f"peak {binary_size(nbytes)} at {os.path.basename(frame[0])}:{frame[1]}"


def plot_memory(source: Any, path: str | os.PathLike[str] | None = None, device: int | None = None) -> Figure:
    """Plot a run's memory over its allocator events: allocated and reserved bytes after each
    event (x: event index, one per allocation, free, or segment released on its own; y: bytes,
    ticks in KiB / MiB / GiB), the allocated bytes stacked by category (``parameter``,
    ``gradient``, ... as each block's entry carries it; ``unknown`` where none is known), and
    the peak of allocated bytes marked with the ``file:line`` of the allocation that reached it.

    ``source``: a ``memlab.TensorTracker`` entered with ``history=True`` (its :meth:`snapshot`
    of ``device``), or a snapshot dict in ``torch.cuda.memory._snapshot()`` format (from
    ``tracker.snapshot()``, a pickle written by ``memlab.dump_snapshot`` or by PyTorch on a GPU;
    ``device`` is then an index into its ``device_traces``). With ``path``, the figure is also
    saved there (format from the extension, e.g. ``.png``, ``.svg``, ``.pdf``). Returns the
    matplotlib ``Figure`` (not registered with pyplot: it needs no display and renders with Agg;
    notebooks show it inline).

    What it cannot show: time (events are evenly spaced however long apart they were), what a
    trace does not record (see :func:`memory_series`: bytes live before a ring buffer's first
    entry, memory outside PyTorch's allocator), and which tensor a category's bytes belong to
    (PyTorch's viewer, ``memlab viz``, shows each block). Raises ``ImportError`` naming
    ``pip install 'memlab[plot]'`` without matplotlib, ``ValueError`` for a snapshot without
    trace entries, ``TypeError`` for another kind of ``source``.
    """
    from memlab.sources.tracker import TensorTracker

    if isinstance(source, TensorTracker):
        snapshot = source.snapshot(device)
        device = None
    elif isinstance(source, dict):
        snapshot = source
    else:
        raise TypeError(
            "plot_memory() takes a memlab.TensorTracker (entered with history=True) or a memory "
            f"snapshot dict (tracker.snapshot(), a loaded snapshot pickle); got {type(source).__name__}"
        )
    series = memory_series(snapshot, device)
    figure = _matplotlib_figure()(figsize=(10, 5), layout="constrained")
    ax = figure.add_subplot()
    x = range(len(series.allocated))
    names = sorted(series.by_category, key=lambda n: -max(series.by_category[n]))
    ax.stackplot(
        x,
        *(series.by_category[n] for n in names),
        labels=[f"allocated: {n}" for n in names],
        colors=_COLORS[2:] + _COLORS[:2],
        step="mid",
        alpha=0.6,
    )
    ax.plot(x, series.reserved, drawstyle="steps-mid", color=_COLORS[1], label="reserved")
    ax.plot(x, series.allocated, drawstyle="steps-mid", color=_COLORS[0], label="allocated")
    peak_bytes = series.allocated[series.peak]
    ax.scatter([series.peak], [peak_bytes], color=_COLORS[3], zorder=3)
    ax.annotate(
        peak_label(peak_bytes, series.peak_frame),
        (series.peak, peak_bytes),
        xytext=(0, 12),
        textcoords="offset points",
        ha=_alignment(series.peak / max(len(x) - 1, 1)),
        color=_COLORS[3],
    )
    _binary_axis(ax.yaxis, max(max(series.reserved), peak_bytes, 1))
    ax.set_ylim(0, max(max(series.reserved), peak_bytes, 1) * 1.15)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_xlabel("allocator event (allocation, free or segment release), in order")
    ax.set_ylabel("memory (bytes, binary units)")
    ax.set_title("Memory over the run: allocated (stacked by category) and reserved")
    handles, labels = ax.get_legend_handles_labels()
    order = [labels.index("allocated"), labels.index("reserved"), *range(len(names))]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return _save(figure, path)


def check_byte_column(column: Any) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``column`` names a statistic in bytes: a
    ``*_bytes.*`` key of :data:`memlab.STAT_KEYS` or ``"delta"``."""
    from memlab.sources.stats import STAT_KEYS

    if not isinstance(column, str):
        raise TypeError(f"column must be one statistic name (a str), got {type(column).__name__} {column!r}")
    byte_columns = [key for key in STAT_KEYS if "_bytes." in key]
    if column != "delta" and column not in byte_columns:
        raise ValueError(
            f"column {column!r} is not a statistic in bytes; valid: 'delta' or a *_bytes.* key, "
            f"e.g. {', '.join(byte_columns[:4])}, ... (memlab.STAT_KEYS)"
        )


def plot_lines(
    tables: Sequence[FunctionTable], column: str, source_line: str | None, path: str | os.PathLike[str] | None
) -> Figure:
    """A bar per source line that ran (``tables`` as ``LineProfiler`` builds them), its height
    the line's value of ``column`` in bytes (ticks in KiB / MiB / GiB, the value written at the
    bar's end), labelled ``function:line: code`` with the code cut to 40 characters; saved to
    ``path`` when given."""
    bars = [
        (f"{table.name}:{number}: {_shorten(code)}", row[column])
        for table in tables
        for number, code, row in table.lines
        if row is not None
    ]
    figure = _matplotlib_figure()(figsize=(10, max(2.5, 0.3 * len(bars) + 1.5)), layout="constrained")
    ax = figure.add_subplot()
    labels = [label for label, _ in bars]
    values = [value for _, value in bars]
    container = ax.barh(range(len(bars)), values, color=_COLORS[0], tick_label=labels)
    ax.bar_label(container, [binary_size(value) for value in values], padding=3, fontsize="small")
    ax.invert_yaxis()
    top = max(values, default=1) or 1
    _binary_axis(ax.xaxis, top)
    ax.set_xlim(min([0, *values]) * 1.2, top * 1.2)
    ax.set_xlabel(f"{column} (bytes, binary units)")
    ax.set_title(f"{column} per line" + (f"\n{source_line}" if source_line else ""), fontsize="medium")
    ax.grid(axis="x", alpha=0.3)
    return _save(figure, path)


def _shorten(code: str) -> str:
    code = code.strip()
    return code if len(code) <= _CODE_WIDTH else code[: _CODE_WIDTH - 3] + "..."
