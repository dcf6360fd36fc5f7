"""Memory over time and per line, as matplotlib figures: :func:`plot_memory` draws a run's
allocated and reserved bytes from its memory snapshot, :func:`plot_lines` a profiler's per-line bars.

The series are computed once (:func:`memlab.history.series.memory_series`, no matplotlib needed)
and then drawn.
matplotlib is imported only when a figure is drawn, so ``import memlab`` never imports it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memlab._outputs import check_output_path, replacing_path
from memlab.history.series import memory_series
from memlab.sources.workspace_note import snapshot_workspaces, workspaces_note

if TYPE_CHECKING:
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure

    from memlab.line_profiler.records import FunctionTable

__all__ = [
    "binary_size",
    "check_byte_column",
    "figure_extensions",
    "peak_label",
    "plot_lines",
    "plot_memory",
]

_INSTALL = "plotting needs matplotlib, an optional extra of memlab: pip install 'memlab[plot]'"
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_CODE_WIDTH = 40  # characters of source shown in a bar's label
# Seaborn's "muted" palette, as the text and HTML renderers use.
_COLORS = ("#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4", "#8c613c", "#dc7ec0", "#797979", "#d5bb67")


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


def figure_extensions() -> tuple[str, ...]:
    """The file extensions matplotlib can save a figure as (``.png``, ``.svg``, ``.pdf``, ...:
    ``FigureCanvasBase.get_supported_filetypes()``), sorted; ``ImportError`` without matplotlib."""
    _matplotlib_figure()
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(sorted(f".{extension}" for extension in FigureCanvasBase.get_supported_filetypes()))


def _check_path(path: str | os.PathLike[str] | None) -> None:
    """``path`` (``None``: nothing is saved) checked before anything is drawn: a file that can be
    written, ending in an extension matplotlib saves (:func:`figure_extensions`)."""
    if path is not None:
        check_output_path(path, "path", figure_extensions())


def _save(figure: Figure, path: str | os.PathLike[str] | None) -> Figure:
    """Save ``figure`` to ``path`` (``None``: not saved) whole or not at all
    (:func:`memlab._outputs.replacing_path`), in the format its extension names."""
    if path is not None:
        extension = os.path.splitext(os.fspath(path))[1][1:].lower()
        with replacing_path(path) as temporary:
            figure.savefig(temporary, format=extension, dpi=100, bbox_inches="tight")
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
    ``gradient``, ``workspace``, ... as each block's entry carries it; ``unknown`` where none is
    known), and
    the peak of allocated bytes marked with the ``file:line`` of the allocation that reached it.
    Where the run modelled cuBLAS workspaces (a tracker's snapshot: category ``workspace``), the
    title says how many and their bytes (``includes 2 modelled cuBLAS workspaces of the H100:
    64.00M``; the GPU is named for a tracker, a snapshot does not say it);
    ``CUBLAS_WORKSPACE_CONFIG=:0:0`` turns them off.

    ``source``: a ``memlab.TensorTracker`` entered with ``history=True`` (its :meth:`snapshot`
    of ``device``), a snapshot dict in ``torch.cuda.memory._snapshot()`` format (from
    ``tracker.snapshot()``, a loaded pickle), or the path of a snapshot pickle (written by
    ``memlab.dump_snapshot``, ``memlab run --snapshot`` or by PyTorch on a GPU; read with
    :func:`memlab.history.export.read_snapshot`, which runs nothing the pickle names); for a dict
    or a path ``device`` is an index into its
    ``device_traces``. With ``path``, the figure is also saved there (format from the
    extension, e.g. ``.png``, ``.svg``, ``.pdf``, one of :func:`figure_extensions`; checked before
    anything is drawn; written whole or not at all, a failure leaves the previous file). Returns the
    matplotlib ``Figure`` (not registered with pyplot: it needs no display and renders with Agg;
    notebooks show it inline).

    What it cannot show: time (events are evenly spaced however long apart they were), what a
    trace does not record (see :func:`memory_series`: bytes live before a ring buffer's first
    entry, memory outside PyTorch's allocator), and which tensor a category's bytes belong to
    (``memlab viz --stack largest`` draws the largest blocks, ``memlab viz --viewer pytorch`` each
    block). Raises ``ImportError`` naming
    ``pip install 'memlab[plot]'`` without matplotlib, ``ValueError`` for a snapshot without
    trace entries, a file that is not a snapshot pickle (or one that names a Python object to
    load, which is refused unread) or a ``path`` that cannot be written or has another extension,
    ``FileNotFoundError`` for a missing pickle, ``TypeError`` for another kind of ``source``.
    """
    from memlab.sources.tracker import TensorTracker

    _check_path(path)
    gpu = None  # a snapshot does not name the GPU its tracker modelled
    if isinstance(source, TensorTracker):
        snapshot = source.snapshot(device)
        gpu = None if source.gpu is None else source.gpu.name
        device = None
    elif isinstance(source, dict):
        snapshot = source
    elif isinstance(source, (str, os.PathLike)):
        from memlab.history.export import read_snapshot

        snapshot = read_snapshot(source, name="source")
    else:
        raise TypeError(
            "source must be a memlab.TensorTracker (entered with history=True), a memory snapshot dict "
            "(tracker.snapshot(), a loaded snapshot pickle) or the path of a snapshot pickle; got "
            f"{type(source).__name__} {source!r:.80}"
        )
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        error = ValueError if isinstance(device, int) and not isinstance(device, bool) else TypeError
        raise error(
            "device must be None or an index into the snapshot's device_traces (an int >= 0), got "
            f"{type(device).__name__} {device!r:.80}"
        )
    series = memory_series(snapshot, device)
    workspaces = snapshot_workspaces(snapshot, device)
    if workspaces is not None and gpu is not None:
        workspaces = dataclasses.replace(workspaces, gpu=gpu)
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
    title = "Memory over the run: allocated (stacked by category) and reserved"
    note = workspaces_note(workspaces)
    ax.set_title(title if note is None else f"{title}\n{note}")
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
    ``path`` when given (checked before anything is drawn)."""
    _check_path(path)
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
