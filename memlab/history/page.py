"""A memory snapshot as one self-contained HTML page, drawn by memlab: the timeline of allocated
and reserved bytes (inline SVG, :mod:`memlab.history.timeline_svg`) and the largest allocations
alive at the peak with their stacks. The page references nothing outside itself (no URL, no
external script, style or font), so it opens offline; the same snapshot gives the same bytes.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from typing import Any

from memlab._units import check_count, format_size
from memlab._user_code import is_library_file
from memlab.history.categories import WORKSPACE
from memlab.history.series import Allocation, MemorySeries, memory_series
from memlab.history.timeline_svg import PALETTE, Band, sample_events, timeline_svg

__all__ = ["BANDS", "STACKS", "memory_page"]

#: How ``memory_page`` stacks allocated bytes: by each block's category, or the largest blocks
#: each in a band of its own (as PyTorch's Active Memory Timeline draws every block) over the rest.
STACKS = ("category", "largest")
#: The largest allocations drawn as bands of their own with ``stack="largest"``.
BANDS = 9
#: Frames shown per stack, the user's first; the rest are counted.
_FRAMES = 40

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #1f1f1f; }
svg.timeline { width: 100%; max-width: 1200px; font-size: 12px; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.3em; vertical-align: -0.1em; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #cccccc; padding: 0.25em 0.5em; vertical-align: top; text-align: left; }
td.bytes { text-align: right; white-space: nowrap; }
ol.stack { margin: 0; padding-left: 1.5em; font-family: monospace; }
ol.stack li.library { color: #777777; }
#readout { font-family: monospace; min-height: 1.2em; }
"""

# Hover readout: the drawn event nearest the pointer, its allocated and reserved bytes. The page
# shows everything without it.
_SCRIPT = """
(function () {
  var svg = document.querySelector("svg.timeline"), data = JSON.parse(
    document.getElementById("memlab-points").textContent);
  var cursor = document.getElementById("cursor"), out = document.getElementById("readout");
  var plot = svg.querySelector("rect.plot"), total = +svg.getAttribute("data-events");
  function size(n) {
    var units = ["B", "K", "M", "G", "T"], i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return n.toFixed(2) + units[i];
  }
  svg.addEventListener("mousemove", function (e) {
    var p = svg.createSVGPoint(); p.x = e.clientX; p.y = e.clientY;
    p = p.matrixTransform(svg.getScreenCTM().inverse());
    var left = +plot.getAttribute("x"), width = +plot.getAttribute("width");
    var event = (p.x - left) / width * total, lo = 0, hi = data.events.length - 1;
    while (lo < hi) {
      var mid = (lo + hi + 1) >> 1;
      if (data.events[mid] <= event) lo = mid; else hi = mid - 1;
    }
    var x = left + width * data.events[lo] / total;
    cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
    out.textContent = "event " + data.events[lo] + ": allocated " + size(data.allocated[lo]) +
      ", reserved " + size(data.reserved[lo]);
  });
})();
"""


def _is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's: a Python file (or a notebook cell) that is not a
    library's here (:func:`memlab._user_code.is_library_file`) nor under an installed package's
    folder on the machine that recorded it; C++ frames of a GPU snapshot are libraries'."""
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    return (filename.endswith(".py") or filename.startswith("<")) and not is_library_file(filename)


def _stack_html(frames: Sequence[dict[str, Any]]) -> str:
    """An allocation's stack as a list, the user's frames first (innermost first within each
    group), at most :data:`_FRAMES` shown; ``(no stack recorded)`` for none."""
    if not frames:
        return "<em>(no stack recorded)</em>"
    user = [f for f in frames if _is_user_file(str(f.get("filename", "")))]
    library = [f for f in frames if not _is_user_file(str(f.get("filename", "")))]
    items = [("user", f) for f in user] + [("library", f) for f in library]
    rows = [f'<li class="{kind}">{html.escape(_frame_text(frame))}</li>' for kind, frame in items[:_FRAMES]]
    if len(items) > _FRAMES:
        rows.append(f"<li>... {len(items) - _FRAMES} more frames</li>")
    return f'<ol class="stack">{"".join(rows)}</ol>'


def _frame_text(frame: dict[str, Any]) -> str:
    """``file:line in function`` of a snapshot's frame dict."""
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def _where(frames: Sequence[dict[str, Any]]) -> str:
    """``file:line`` (base name) of an allocation's innermost user frame, else its innermost one."""
    frame = next(
        (f for f in frames if _is_user_file(str(f.get("filename", "")))), frames[0] if frames else None
    )
    if frame is None:
        return "no stack recorded"
    return f"{os.path.basename(str(frame.get('filename', '?')))}:{frame.get('line', '?')}"


def _bands(series: MemorySeries, events: list[int], stack: str) -> list[Band]:
    """The stacked bands, bottom first: each category (the one reaching the most bytes lowest), or
    the rest of the allocations below the :data:`BANDS` largest (in the order they were made)."""
    if stack == "category":
        names = sorted(series.by_category, key=lambda name: (-max(series.by_category[name]), name))
        return [
            Band(
                f"allocated: {name}",
                PALETTE[i % (len(PALETTE) - 1)],
                [series.by_category[name][e] for e in events],
            )
            for i, name in enumerate(names)
        ]
    largest = sorted(
        sorted(series.allocations, key=lambda a: (-a.granted, a.start))[:BANDS], key=lambda a: a.start
    )

    def alive(block: Allocation, event: int) -> bool:
        return block.start <= event and (block.end is None or event < block.end)

    values = [[block.granted if alive(block, e) else 0 for e in events] for block in largest]
    rest = (
        [
            series.allocated[e] - sum(column)
            for e, column in zip(events, zip(*values, strict=True), strict=True)
        ]
        if values
        else [series.allocated[e] for e in events]
    )
    bands = [Band("allocated: every other block", PALETTE[-1], rest)]
    for i, (block, column) in enumerate(zip(largest, values, strict=True)):
        title = (
            f"{format_size(block.granted)} ({block.granted:,} B, {block.category}) allocated at event "
            f"{block.start:,}, {_where(block.frames)}"
        )
        bands.append(Band(title, PALETTE[i % (len(PALETTE) - 1)], column))
    return bands


def _alive_at_peak(series: MemorySeries) -> list[Allocation]:
    """The allocations alive right after the peak event, the largest (granted bytes) first, then
    the earliest."""
    peak = series.peak
    alive = [a for a in series.allocations if a.start <= peak and (a.end is None or peak < a.end)]
    return sorted(alive, key=lambda a: (-a.granted, a.start))


def _workspaces(alive: Sequence[Allocation]) -> str:
    """``, of which 64.00M (67,108,864 B) are 2 cuBLAS workspaces`` when workspace blocks are
    among ``alive`` (memlab's trackers model them on runs without a GPU), else nothing."""
    blocks = [a.granted for a in alive if a.category == WORKSPACE]
    if not blocks:
        return ""
    plural = "s" if len(blocks) > 1 else ""
    return (
        f", of which {format_size(sum(blocks))} ({sum(blocks):,} B) in {len(blocks)} cuBLAS workspace{plural}"
    )


def _peak_table(series: MemorySeries, alive: list[Allocation], top: int) -> str:
    """The ``top`` largest of ``alive`` (the allocations alive at the peak, largest first), and a
    last row that sums the others."""
    peak = series.peak
    rows = []
    for rank, block in enumerate(alive[:top], 1):
        rows.append(
            f'<tr><td class="bytes">{rank}</td>'
            f'<td class="bytes">{format_size(block.granted)}<br>{block.granted:,} B</td>'
            f'<td class="bytes">{block.requested:,} B</td><td>{html.escape(block.category)}</td>'
            f'<td class="bytes">{block.start:,}</td><td>{_stack_html(block.frames)}</td></tr>'
        )
    if len(alive) > top:
        rest = sum(a.granted for a in alive[top:])
        rows.append(
            f'<tr><td></td><td class="bytes">{format_size(rest)}<br>{rest:,} B</td>'
            f'<td colspan="4">the other {len(alive) - top:,} allocations alive at the peak</td></tr>'
        )
    total = sum(a.granted for a in alive)
    return (
        f"<table><caption>{len(alive):,} allocations alive after event {peak:,}, {format_size(total)} "
        f"({total:,} B) granted; the {min(top, len(alive)):,} largest, each with its stack (your frames "
        "first, innermost first; library frames grey)</caption>\n<thead><tr><th>#</th><th>granted</th>"
        "<th>requested</th><th>category</th><th>allocated at event</th><th>stack</th></tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody></table>"
    )


def memory_page(
    snapshot: dict[str, Any],
    *,
    device: int | None = None,
    stack: str = "category",
    points: int = 2000,
    top: int = 20,
    title: str = "memory snapshot",
) -> str:
    """The HTML page of ``snapshot`` (a ``torch.cuda.memory._snapshot()`` dict; ``device`` as for
    :func:`memlab.history.series.memory_series`), as a string.

    It draws allocated bytes after each allocator event (the replay of
    :func:`~memlab.history.series.memory_series`, in bytes, y axis in memlab's units: ``2.00M`` is
    2 MiB), stacked by ``stack`` (one of :data:`STACKS`), and reserved bytes as a line, over at
    most ``points`` (>= 16) drawn events (:func:`~memlab.history.timeline_svg.sample_events`:
    each run's highest and lowest allocated and highest reserved event, and the peak, at their
    true values); then the ``top`` (>= 1) largest allocations alive at the peak (the first event
    where allocated bytes are highest) with their granted and requested bytes, category and stack.
    ``title`` (HTML-escaped, as every text from the snapshot) heads the page. The picture needs no
    script; a small inline one shows the bytes under the pointer. What it cannot show: time
    (events are evenly spaced), what a trace did not record (bytes live before a ring buffer's
    first entry), allocations between drawn events that are no run's extreme. Raises
    ``ValueError`` for a snapshot without trace entries to draw, an unknown ``stack`` or a count
    out of range, ``TypeError`` for a count that is not an int.
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {', '.join(STACKS)}; got {stack!r}")
    check_count(points, "points", 16)
    check_count(top, "top", 1)
    series = memory_series(snapshot, device, allocations=True)
    if not series.allocated:
        raise ValueError("the snapshot's trace has no allocation, free or segment release to draw")
    total = len(series.allocated)
    events = sample_events(series.allocated, series.reserved, points, series.peak)
    peak_bytes = series.allocated[series.peak]
    where = "no Python frame recorded"
    peak_block = next((a for a in series.allocations if a.start == series.peak), None)
    if peak_block is not None and peak_block.frames:
        where = f"at {_where(peak_block.frames)}"
    label = f"peak {format_size(peak_bytes)} " + (where if where.startswith("at ") else f"({where})")
    bands = _bands(series, events, stack)
    svg = timeline_svg(
        events, total, bands, [series.reserved[e] for e in events], (series.peak, peak_bytes, label)
    )
    legend = "".join(
        f'<span><i style="background:{band.color}"></i>{html.escape(band.title)}</span>' for band in bands
    )
    points_json = json.dumps(
        {
            "events": events,
            "allocated": [series.allocated[e] for e in events],
            "reserved": [series.reserved[e] for e in events],
        },
        separators=(",", ":"),
    )
    drawn = (
        f"all {total:,} events drawn"
        if len(events) == total
        else (
            f"{len(events):,} of {total:,} events drawn (each run's highest and lowest allocated and highest "
            "reserved, and the peak)"
        )
    )
    alive = _alive_at_peak(series)
    summary = (
        f"Peak allocated {format_size(peak_bytes)} ({peak_bytes:,} B) after event {series.peak:,} of "
        f"{total:,} ({html.escape(where)}){_workspaces(alive)}; peak reserved "
        f"{format_size(max(series.reserved))} ({max(series.reserved):,} B). {drawn}; allocated stacked "
        f"by {stack}."
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>memlab: {html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>Memory of {html.escape(title)}</h1>\n<p>{summary}</p>\n{svg}\n"
        f'<p id="readout"></p>\n<p class="legend">{legend}</p>\n'
        f"<h2>Largest allocations alive at the peak</h2>\n{_peak_table(series, alive, top)}\n"
        f'<script type="application/json" id="memlab-points">{points_json}</script>\n'
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )
