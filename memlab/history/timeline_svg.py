"""A run's memory over its allocator events as inline SVG, drawn in plain Python (no plotting
library, no script needed to see it): allocated bytes as stacked bands, reserved bytes as a line,
over at most a bounded number of sampled events that keeps every peak (:func:`sample_events`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from memlab._units import format_size

__all__ = ["PALETTE", "Band", "Plot", "byte_ticks", "event_ticks", "sample_events", "timeline_svg"]

#: Seaborn's "muted" palette (as memlab's text, HTML and matplotlib renderers use), then grey.
PALETTE = (
    "#4878d0",
    "#ee854a",
    "#6acc64",
    "#d65f5f",
    "#956cb4",
    "#8c613c",
    "#dc7ec0",
    "#d5bb67",
    "#82c6e2",
    "#b8b8b8",
)
RESERVED_COLOR = "#d65f5f"
ALLOCATED_COLOR = "#1f1f1f"


@dataclass(frozen=True)
class Plot:
    """The SVG's size and its plot area, in SVG user units (the x axis spans events ``0`` to
    ``events``: event ``i``'s value holds from ``x(i)`` to the next drawn event)."""

    width: int = 960
    height: int = 380
    left: int = 96
    top: int = 16
    right: int = 940
    bottom: int = 320

    def x(self, event: float, events: int) -> float:
        return self.left + (self.right - self.left) * event / max(events, 1)

    def y(self, nbytes: float, axis_top: int) -> float:
        return self.bottom - (self.bottom - self.top) * nbytes / axis_top


@dataclass(frozen=True)
class Band:
    """One stacked band: its hover title, colour, and its bytes at each drawn event."""

    title: str
    color: str
    values: Sequence[int]


def sample_events(allocated: Sequence[int], reserved: Sequence[int], points: int, keep: int) -> list[int]:
    """At most ``points`` (>= 7) indices into the series, in order, to draw in its place: all of
    them when there are no more; else the first, the last, ``keep`` (the peak) and, in each of
    ``(points - 3) // 3`` equal runs of events, the one with the most and the one with the least
    allocated bytes and the one with the most reserved bytes (the first of equals). Every local
    extreme that is its run's extreme is drawn at its true value; what falls between drawn
    events is not drawn (a short spike that is not its run's highest allocated is lost)."""
    count = len(allocated)
    if count <= points:
        return list(range(count))
    runs = (points - 3) // 3
    chosen = {0, count - 1, keep}
    for run in range(runs):
        start, stop = run * count // runs, (run + 1) * count // runs
        span = range(start, stop)
        chosen.add(max(span, key=allocated.__getitem__))
        chosen.add(min(span, key=allocated.__getitem__))
        chosen.add(max(span, key=reserved.__getitem__))
    return sorted(chosen)


def byte_ticks(top: int) -> tuple[int, int]:
    """``(step, axis_top)`` for a byte axis reaching ``top``: ticks every ``step`` bytes, a power
    of two times 1 B, 1 KiB, 1 MiB or 1 GiB, 3 to 8 of them; ``axis_top`` the first tick at or
    above ``top`` (one step for ``top`` 0)."""
    scale = next((s for s in (1 << 30, 1 << 20, 1 << 10) if top >= s), 1)
    step = scale
    while top / step > 8:
        step *= 2
    while step > 1 and top / step < 3:
        step //= 2
    return step, max(1, math.ceil(top / step)) * step


def event_ticks(events: int) -> list[int]:
    """Event numbers to label on an axis of ``events`` events: multiples of 1, 2 or 5 times a
    power of ten, at most 11 of them, from 0."""
    step = next(m * 10**k for k in range(20) for m in (1, 2, 5) if events <= 10 * m * 10**k)
    return list(range(0, events + 1, step))


def _num(value: float) -> str:
    """A coordinate with one decimal, ``.0`` dropped (fixed text: the same page from the same data)."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _steps(plot: Plot, events: Sequence[int], total: int, values: Sequence[int], axis_top: int) -> list[str]:
    """Path commands of a step line through ``values`` at ``events``, each value held until the
    next event and the last one until ``total``: ``M x,y`` then ``H x V y`` pairs (a value equal
    to the one before adds nothing) and a last ``H``, all absolute."""
    commands = []
    last = None
    for event, value in zip(events, values, strict=True):
        if value != last:
            x, y = _num(plot.x(event, total)), _num(plot.y(value, axis_top))
            commands.append(f"M{x},{y}" if last is None else f"H{x}V{y}")
            last = value
    commands.append(f"H{_num(plot.x(total, total))}")
    return commands


def _filled(plot: Plot, events: Sequence[int], total: int, values: Sequence[int], axis_top: int) -> str:
    """A step line closed down to the x axis: the area under ``values``."""
    base = _num(plot.y(0, axis_top))
    first, *rest = _steps(plot, events, total, values, axis_top)
    x, y = first[1:].split(",")
    return f"M{x},{base}V{y}{''.join(rest)}V{base}Z"


def timeline_svg(
    events: Sequence[int],
    total: int,
    bands: Sequence[Band],
    reserved: Sequence[int],
    peak: tuple[int, int, str],
    plot: Plot | None = None,
) -> str:
    """The ``<svg>`` element of a memory timeline: ``bands`` stacked from the bottom (their values
    at the drawn ``events``, indices out of ``total`` events), their sum outlined as the
    ``allocated`` line, ``reserved`` as a line, ``peak`` (event, bytes, label) marked with a dot,
    y ticks in memlab's units (``format_size``: ``512.00K``, ``2.00M``). Hovering a band, line
    or the dot shows its title (SVG ``<title>``, no script). Every text is HTML-escaped."""
    plot = plot or Plot()
    allocated = [sum(values) for values in zip(*(band.values for band in bands), strict=True)] or [0] * len(
        events
    )
    step, axis_top = byte_ticks(max(max(reserved, default=0), max(allocated, default=0)))
    out = [
        f'<svg class="timeline" viewBox="0 0 {plot.width} {plot.height}" role="img" '
        f'data-events="{total}" data-axis-top="{axis_top}" aria-label="memory over allocator events">',
        f'<rect class="plot" x="{plot.left}" y="{plot.top}" width="{plot.right - plot.left}" '
        f'height="{plot.bottom - plot.top}" fill="#ffffff" stroke="#999999"/>',
    ]
    for tick in range(0, axis_top + 1, step):
        y = _num(plot.y(tick, axis_top))
        out.append(
            f'<line x1="{plot.left - 4}" y1="{y}" x2="{plot.right}" y2="{y}" stroke="#e4e4e4"/>'
            f'<text x="{plot.left - 8}" y="{y}" text-anchor="end" dominant-baseline="middle">'
            f"{format_size(tick)}</text>"
        )
    for tick in event_ticks(total):
        x = _num(plot.x(tick, total))
        out.append(
            f'<line x1="{x}" y1="{plot.bottom}" x2="{x}" y2="{plot.bottom + 4}" stroke="#999999"/>'
            f'<text x="{x}" y="{plot.bottom + 18}" text-anchor="middle">{tick:,}</text>'
        )
    cumulative = [0] * len(events)
    tops = []
    for band in bands:
        cumulative = [a + b for a, b in zip(cumulative, band.values, strict=True)]
        tops.append((band, cumulative))
    for band, top in reversed(tops):  # the highest first: each lower one is painted over it
        out.append(
            f'<path class="band" d="{_filled(plot, events, total, top, axis_top)}" fill="{band.color}" '
            f'fill-opacity="0.75"><title>{html.escape(band.title)}</title></path>'
        )
    for name, values, color in (
        ("reserved", reserved, RESERVED_COLOR),
        ("allocated", allocated, ALLOCATED_COLOR),
    ):
        path = "".join(_steps(plot, events, total, values, axis_top))
        out.append(
            f'<path id="{name}" d="{path}" fill="none" '
            f'stroke="{color}" stroke-width="1.5"><title>{name}</title></path>'
        )
    event, nbytes, label = peak
    x, y = _num(plot.x(event, total)), _num(plot.y(nbytes, axis_top))
    out.append(
        f'<circle id="peak" cx="{x}" cy="{y}" r="4" fill="{RESERVED_COLOR}">'
        f"<title>{html.escape(label)}</title></circle>"
        f'<text x="{x}" y="{_num(max(plot.top + 12, float(y) - 8))}" '
        f'text-anchor="{_anchor(event / max(total, 1))}" fill="{RESERVED_COLOR}">{html.escape(label)}</text>'
    )
    middle = _num((plot.top + plot.bottom) / 2)
    out += [
        f'<text x="{_num((plot.left + plot.right) / 2)}" y="{plot.bottom + 40}" text-anchor="middle">'
        "allocator event (allocation, free or segment release), in order</text>",
        f'<text transform="translate(16 {middle}) rotate(-90)" text-anchor="middle">'
        "memory (bytes; K = KiB, M = MiB, G = GiB)</text>",
        f'<line id="cursor" x1="0" y1="{plot.top}" x2="0" y2="{plot.bottom}" stroke="#555555" '
        'visibility="hidden"/>',
        "</svg>",
    ]
    return "\n".join(out)


def _anchor(fraction: float) -> str:
    """Where a label at ``fraction`` of the axis sits, so that it stays inside the plot."""
    return "start" if fraction < 0.2 else "end" if fraction > 0.8 else "middle"
