"""Memory per module as plain data, and its renderers: a pandas DataFrame, text and HTML.

:class:`ModuleTable` holds one :class:`ModuleRow` per module path (recorded by
:mod:`memlab.sources.modules`); every renderer reads the same rows and none computes anything but
their order (text and HTML sort by peak, the DataFrame keeps the modules' order).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memlab._units import format_size

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "ModuleRow", "ModuleTable"]

#: The DataFrame's columns, in order (the index is ``module``, the path).
COLUMNS = (
    "type",
    "calls",
    "forward_peak",
    "backward_peak",
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
)
_PEAKS = ("forward_peak", "backward_peak")
_BYTES = ("forward_peak", "backward_peak", "parameter", "gradient", "optimizer_state", "activation")
_ROOT = "(root)"
_HEADERS = (
    "module",
    "type",
    "calls",
    "forward",
    "backward",
    "parameter",
    "gradient",
    "optimizer",
    "activation",
)
#: What the columns mean, as the renderings say it under their title.
ABOUT = (
    "forward, backward: highest allocated bytes while the module's forward / backward ran, all alive counted",
    "parameter, gradient, optimizer: of its own parameters; activation: most bytes its own ops saved at once",
)


@dataclass(frozen=True)
class ModuleRow:
    """One module: its ``path`` (``""`` for the root), class name, forward ``calls``, the highest
    allocated bytes during its forward and its backward (``None``: none ran), and the bytes of its
    own parameters, their gradients and optimizer state, and of the activations it saved."""

    path: str
    type: str
    calls: int
    forward_peak: int | None
    backward_peak: int | None
    parameter: int
    gradient: int
    optimizer_state: int
    activation: int

    @property
    def peak(self) -> int | None:
        """The higher of ``forward_peak`` and ``backward_peak`` (``None`` when neither ran)."""
        peaks = [p for p in (self.forward_peak, self.backward_peak) if p is not None]
        return max(peaks) if peaks else None


@dataclass(frozen=True)
class ModuleTable:
    """The rows of one device's memory per module (bytes as its allocator model counts them), in
    the modules' order (``named_modules()`` of each model)."""

    device: str
    rows: tuple[ModuleRow, ...]

    def to_dataframe(self) -> pd.DataFrame:
        """A DataFrame indexed by ``module`` (the path; the root is ``""``) with :data:`COLUMNS`:
        ``forward_peak`` and ``backward_peak`` are nullable integers (``<NA>`` where none ran),
        every other number an int64; bytes throughout."""
        import pandas as pd

        frame = pd.DataFrame(
            [[getattr(row, column) for column in COLUMNS] for row in self.rows],
            index=pd.Index([row.path for row in self.rows], name="module", dtype=object),
            columns=list(COLUMNS),
        )
        types = {column: "Int64" if column in _PEAKS else "int64" for column in COLUMNS if column != "type"}
        return frame.astype(types)

    def by_peak(self) -> list[ModuleRow]:
        """The rows, highest peak first (ties in module order; modules that never ran last)."""
        order = {row.path: i for i, row in enumerate(self.rows)}
        return sorted(self.rows, key=lambda row: (row.peak is None, -(row.peak or 0), order[row.path]))

    def _cells(self) -> list[list[str]]:
        return [
            [
                row.path or _ROOT,
                row.type,
                str(row.calls),
                *("-" if getattr(row, c) is None else format_size(getattr(row, c)) for c in _BYTES),
            ]
            for row in self.by_peak()
        ]

    def title(self) -> str:
        """The line that heads both renderings."""
        return f"memory per module on {self.device}, highest peak first"

    def text(self) -> str:
        """The table as text, highest peak first, sizes 1024-based (``40.00K``), ``-`` where a
        module's forward or backward never ran."""
        if not self.rows:
            return f"{self.title()}: no module recorded\n"
        headers = _HEADERS
        cells = self._cells()
        widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
        lines = [self.title(), *ABOUT]
        for row in [headers, *cells]:
            lines.append(
                "  ".join(
                    cell.ljust(width) if i < 2 else cell.rjust(width)
                    for i, (cell, width) in enumerate(zip(row, widths, strict=True))
                ).rstrip()
            )
        return "\n".join(lines) + "\n"

    def html(self) -> str:
        """The table as HTML, highest peak first (what a notebook shows)."""
        head = "".join(f"<th>{html.escape(h)}</th>" for h in _HEADERS)
        body = "".join(
            "<tr>"
            + "".join(
                f'<td style="text-align: {"left" if i < 2 else "right"}; font-family: monospace">'
                f"{html.escape(cell)}</td>"
                for i, cell in enumerate(row)
            )
            + "</tr>"
            for row in self._cells()
        )
        return (
            f"<p>{html.escape(self.title())}</p><p>{html.escape(' '.join(ABOUT))}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )

    def __repr__(self) -> str:
        return self.text().rstrip("\n")

    def _repr_html_(self) -> str:
        return self.html()
