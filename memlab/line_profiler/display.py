"""Renderers of line records for people: text (pytorch_memlab's layout) and HTML.

Every renderer reads the same :class:`FunctionTable` list; none of them computes statistics.
The DataFrame, JSON, CSV and plain-data forms are in :mod:`memlab.line_profiler.export`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from memlab._units import format_size
from memlab.line_profiler.records import DELTA, TIME, FunctionTable, where

__all__ = ["LineStats"]

# Seaborn's "muted" palette, as pytorch_memlab uses for its bars.
_COLORS = ("#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4", "#8c613c", "#dc7ec0", "#797979")
_NEVER_RAN = "registered, but never called while profiling"
_CODE_STYLE = "text-align: left; white-space: pre; font-family: monospace"


def _is_bytes(column: str) -> bool:
    return "bytes" in column or column == DELTA


def format_time(nanoseconds: int) -> str:
    """A duration in nanoseconds as people read it: ``850ns``, ``12.30us``, ``4.56ms``, ``1.20s``."""
    if nanoseconds < 1000:
        return f"{nanoseconds}ns"
    for unit, scale in (("us", 1e3), ("ms", 1e6)):
        if nanoseconds < scale * 1000:
            return f"{nanoseconds / scale:.2f}{unit}"
    return f"{nanoseconds / 1e9:.2f}s"


def _format(column: str, value: int | None) -> str:
    if value is None:
        return ""
    if column == TIME:
        return format_time(value)
    return format_size(value) if _is_bytes(column) else str(value)


def _header(column: str) -> tuple[str, str, str]:
    """The three header cells (stat, pool, metric) of a column, whatever its number of parts."""
    parts = column.split(".")
    if len(parts) == 1:
        return parts[0], "", ""
    if len(parts) == 2:
        return parts[0], "", parts[1]
    return parts[0], ".".join(parts[1:-1]), parts[-1]


def _header_rows(columns: Sequence[str]) -> list[tuple[str, ...]]:
    """The header of a table of ``columns``, one tuple of cells per header line: the stat, pool and
    metric lines (``active_bytes`` / ``all`` / ``peak``), less the lines no column has a word on, so
    that one-word columns (``hits``, ``delta``, ``time``) take one line. The first line is kept
    (the ``line`` and ``code`` headers go on it)."""
    levels = list(zip(*(_header(c) for c in columns), strict=True)) if columns else [(), (), ()]
    return [cells for level, cells in enumerate(levels) if level == 0 or any(cells)]


def title(table: FunctionTable) -> str:
    """The heading of a function's table: its name, then where it is defined (:func:`where`),
    e.g. ``outer  (example.py:8)``; once only when the name already says it (two registered
    functions with one name)."""
    place = f"({where(table.filename, table.first_line)})"
    return table.name if place in table.name else f"{table.name}  {place}"


def render_text(table: FunctionTable, columns: Sequence[str]) -> str:
    """One function as text: ``## name  (file:line)``, three header rows, then one row per source
    line (docstring lines excepted)."""
    if not table.calls:
        return f"## {title(table)}\n\n{_NEVER_RAN}\n"
    cells = [[_format(c, None if v is None else v[c]) for c in columns] for _, _, v in table.lines]
    headers = _header_rows(columns)
    widths = [
        max(len(part) for part in [*(h[i] for h in headers), *(row[i] for row in cells)])
        for i in range(len(columns))
    ]
    line_width = max(4, *(len(str(n)) for n, _, _ in table.lines))
    out = []
    for level, head_cells in enumerate(headers):
        head = [h.rjust(w) for h, w in zip(head_cells, widths, strict=True)]
        last = "code" if level == 0 else ""
        out.append(" ".join([*head, ("line" if level == 0 else "").rjust(line_width)]) + "  " + last)
    for (number, code, _), row in zip(table.lines, cells, strict=True):
        numbers = [cell.rjust(w) for cell, w in zip(row, widths, strict=True)]
        out.append(" ".join([*numbers, str(number).rjust(line_width)]) + "  " + code)
    return f"## {title(table)}\n\n" + "\n".join(line.rstrip() for line in out) + "\n"


def render_html(tables: Sequence[FunctionTable], columns: Sequence[str]) -> str:
    """All functions as HTML tables with a bar per numeric column, scaled to the column's largest
    absolute value over the shown functions."""
    scale = {c: 0 for c in columns}
    for table in tables:
        for _, _, values in table.lines:
            if values is not None:
                for c in columns:
                    scale[c] = max(scale[c], abs(values[c]))
    parts = []
    for table in tables:
        heading = f'<h3><span style="font-family: monospace">{html.escape(title(table))}</span></h3>'
        if not table.calls:
            parts.append(f"{heading}<p>{_NEVER_RAN}</p>")
            continue
        head = []
        for level, head_cells in enumerate(_header_rows(columns)):
            cells = "".join(f"<th>{html.escape(h)}</th>" for h in head_cells)
            extra = "<th>line</th><th>code</th>" if level == 0 else "<th></th><th></th>"
            head.append(f"<tr>{cells}{extra}</tr>")
        body = []
        for number, code, values in table.lines:
            cells = []
            for i, c in enumerate(columns):
                value = None if values is None else values[c]
                style = "text-align: right; font-family: monospace"
                if value and scale[c]:
                    width = 100 * abs(value) / scale[c]
                    color = _COLORS[i % len(_COLORS)]
                    stop = f"{width:.1f}%"
                    style += f"; background: linear-gradient(90deg, {color} {stop}, transparent {stop})"
                cells.append(f'<td style="{style}">{_format(c, value)}</td>')
            code_cell = f'<td style="{_CODE_STYLE}">{html.escape(code)}</td>'
            body.append(f"<tr>{''.join(cells)}<td>{number}</td>{code_cell}</tr>")
        parts.append(
            f'{heading}<div><table><thead style="text-align: left">{"".join(head)}</thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>"
        )
    return "\n".join(parts)


class LineStats:
    """The result of ``LineProfiler.display()``: text as its ``repr``, HTML in notebooks.

    ``source`` is the line that says where the numbers come from (``None`` before any profiling);
    it heads the text and the HTML."""

    def __init__(
        self, tables: Sequence[FunctionTable], columns: Sequence[str], source: str | None = None
    ) -> None:
        self.tables = list(tables)
        self.columns = tuple(columns)
        self.source = source

    def __repr__(self) -> str:
        if not self.tables:
            return "No functions registered\n"
        head = f"{self.source}\n\n" if self.source else ""
        return head + "\n\n".join(render_text(t, self.columns) for t in self.tables)

    __str__ = __repr__

    def _repr_html_(self) -> str:
        if not self.tables:
            return "<p>No functions registered</p>"
        head = f"<p>{html.escape(self.source)}</p>\n" if self.source else ""
        return head + render_html(self.tables, self.columns)
