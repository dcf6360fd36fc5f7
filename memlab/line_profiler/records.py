"""Per-line aggregates: what the tracer records for each line of each profiled function.

Records are kept online: one fixed-size row per (code object, line), updated in place at every
interval the tracer closes, so memory never grows with the number of line events. Renderers
(text, HTML, DataFrame, JSON, CSV) read :meth:`LineRecords.table`; nothing else touches rows.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

from memlab.sources.stats import COUNTERS, STAT_KEYS

__all__ = [
    "DEFAULT_COLUMNS",
    "DELTA",
    "ENTRY",
    "EXTRA_COLUMNS",
    "HITS",
    "TIME",
    "ColumnLayout",
    "FunctionRecord",
    "FunctionTable",
    "LineRecords",
    "validate_columns",
    "where",
]

#: The columns shown when none are asked for, as in pytorch_memlab.
DEFAULT_COLUMNS: tuple[str, ...] = ("active_bytes.all.peak", "reserved_bytes.all.peak")
#: Number of times a line started executing (for the ``def`` line: number of calls).
HITS = "hits"
#: Net change of ``allocated_bytes.all.current`` over the line's intervals, summed over hits.
DELTA = "delta"
EXTRA_COLUMNS = (HITS, DELTA)
#: Wall time of the line's intervals in nanoseconds, summed over hits (recorded only on request).
TIME = "time"
#: Row key of the state at function entry, shown on the ``def`` line.
ENTRY = 0

_DELTA_KEY = "allocated_bytes.all.current"
_SUMMED_COUNTERS = frozenset(COUNTERS) - {"max_split_size"}


def _kind(key: str) -> str:
    """How a statistic aggregates over an interval: ``peak`` (max), ``sum`` (difference of a
    running total) or ``current`` (value at the end)."""
    if key.endswith(".peak"):
        return "peak"
    if key.endswith((".allocated", ".freed")) or key in _SUMMED_COUNTERS:
        return "sum"
    return "current"


def validate_columns(columns: str | Iterable[str], *, extra: bool = True) -> tuple[str, ...]:
    """Return ``columns`` as a tuple after checking every name.

    Valid names are the keys of ``torch.cuda.memory_stats()`` (:data:`memlab.STAT_KEYS`),
    ``"time"`` and, when ``extra``, ``"hits"`` and ``"delta"``. Raises ``TypeError`` for a
    non-string name and ``ValueError`` listing the valid names for an unknown one.
    """
    if isinstance(columns, str):
        columns = (columns,)
    try:
        columns = tuple(columns)
    except TypeError:
        raise TypeError(
            f"columns must be a sequence of statistic names, got {type(columns).__name__} {columns!r}"
        ) from None
    valid = (*EXTRA_COLUMNS, TIME, *STAT_KEYS) if extra else (TIME, *STAT_KEYS)
    for name in columns:
        if not isinstance(name, str):
            raise TypeError(f"column names must be strings, got {type(name).__name__} {name!r}")
        if name not in valid:
            raise ValueError(
                f"unknown column {name!r}; valid columns are the keys of torch.cuda.memory_stats() "
                f"plus time{', hits and delta' if extra else ''}: {', '.join(valid)}"
            )
    return columns


class ColumnLayout:
    """Which statistics are sampled, in which order, and where each lands in a row.

    A sample (the tuple a source's sampler returns) is ordered peaks, sums, currents, then
    ``allocated_bytes.all.current`` for ``delta`` if not already sampled. A row is
    ``[hits, *peaks, *sums, *currents, delta]``, then ``time`` if it is recorded.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = keys = tuple(dict.fromkeys(validate_columns(keys, extra=False)))
        self.timed = TIME in keys
        keys = tuple(k for k in keys if k != TIME)
        self.peaks = tuple(k for k in keys if _kind(k) == "peak")
        self.sums = tuple(k for k in keys if _kind(k) == "sum")
        self.currents = tuple(k for k in keys if _kind(k) == "current")
        ordered = self.peaks + self.sums + self.currents
        self.sample_keys = ordered if _DELTA_KEY in ordered else (*ordered, _DELTA_KEY)
        self.delta_index = self.sample_keys.index(_DELTA_KEY)
        # At entry a peak reads as the statistic's current value.
        self.entry_keys = tuple(k.rsplit(".", 1)[0] + ".current" for k in self.peaks)
        self.row_index = {HITS: 0, **{k: i + 1 for i, k in enumerate(ordered)}, DELTA: len(ordered) + 1}
        if self.timed:
            self.row_index[TIME] = len(ordered) + 2
        self.row_length = len(self.row_index)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ColumnLayout) and other.keys == self.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def new_row(self) -> list[int]:
        """A row for a line that has not run yet: all zeros."""
        return [0] * self.row_length

    def entry_row_update(self, row: list[int], sample: Sequence[int], entry: Sequence[int]) -> None:
        """Fold the state at one function entry into the ``def`` row: peaks are the current values
        at entry, sums zero, currents as sampled."""
        row[0] += 1
        for i, value in enumerate(entry):
            if value > row[1 + i]:
                row[1 + i] = value
        start = 1 + len(self.peaks) + len(self.sums)
        offset = len(self.peaks) + len(self.sums)
        for i in range(len(self.currents)):
            row[start + i] = sample[offset + i]

    def merge_entry(self, entry: list[int], body: list[int]) -> list[int]:
        """The row of a line that is both the ``def`` line and a body line (a function written on
        one line): the body's row, whose interval starts at the entry, with the peaks at entry
        folded in (the higher of the two)."""
        merged = list(body)
        for i in range(1, 1 + len(self.peaks)):
            if entry[i] > merged[i]:
                merged[i] = entry[i]
        return merged

    def convert(self, row: list[int], old: ColumnLayout) -> list[int]:
        """``row`` recorded under ``old`` rearranged for this layout; new statistics read 0."""
        new = self.new_row()
        for key, index in old.row_index.items():
            if key in self.row_index:
                new[self.row_index[key]] = row[index]
        return new


def where(filename: str, line: int) -> str:
    """``file:line`` as a person finds it: the file relative to the working directory when it is
    under it, else as the code names it (``<stdin>``, a notebook's cell file); the file alone
    when ``line`` is 0 (unknown)."""
    if os.path.isabs(filename):
        cwd = os.getcwd()
        try:
            if os.path.commonpath([cwd, filename]) == cwd:
                filename = os.path.relpath(filename, cwd)
        except ValueError:  # another drive (Windows)
            pass
    return f"{filename}:{line}" if line else filename


_Def = ast.FunctionDef | ast.AsyncFunctionDef
#: (line offset, ``def`` node) of a function: the node's line numbers plus the offset are the file's.
_Found = tuple[int, _Def] | None


def _def_of(nodes: Iterable[ast.AST], code: CodeType, first: int) -> _Def | None:
    """The ``def`` of ``code`` among ``nodes``: its name, and its first line (decorators included)
    ``first`` in the parsed text's numbering."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            if min([node.lineno, *(d.lineno for d in node.decorator_list)]) == first:
                return node
    return None


def _function_node(code: CodeType) -> _Found:
    """(line offset, ``def`` node) of ``code`` parsed from its source, the node's line numbers plus
    the offset being the file's; ``None`` for a lambda or where the source cannot be parsed.

    The whole file is parsed when it can be (a nested function whose docstring starts a line at
    column 0 cannot be dedented alone); otherwise the function's own block."""
    first = code.co_firstlineno
    try:
        lines, _ = inspect.findsource(code)
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        tree = None
    node = None if tree is None else _def_of(ast.walk(tree), code, first)
    if node is not None:
        return 0, node
    try:
        block = ast.parse(textwrap.dedent("".join(inspect.getblock(lines[first - 1 :]))))
    except (SyntaxError, ValueError, IndexError):
        return None
    node = _def_of(block.body, code, 1)
    return None if node is None else (first - 1, node)


def _def_line(code: CodeType, found: _Found) -> int:
    """The line of the ``def`` statement of ``code`` (``co_firstlineno`` is the first decorator)."""
    if found is None:
        return code.co_firstlineno
    offset, node = found
    return offset + node.lineno


def _docstring_lines(found: _Found) -> set[int]:
    """The lines that hold only the function's docstring (never executed, so never a row): the
    docstring's span less the ``def`` line and a line a following statement shares."""
    if found is None:
        return set()
    offset, node = found
    body = node.body
    doc = body[0]
    if not (
        isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    ):
        return set()
    end = doc.end_lineno or doc.lineno
    if len(body) > 1 and body[1].lineno == end:
        end -= 1
    return {offset + n for n in range(doc.lineno, end + 1) if n != node.lineno}


@dataclass
class FunctionTable:
    """The rows of one function ready to render: every source line, with or without numbers.

    ``lines`` holds ``(line number, source text, row or None)``; a row maps column names to
    values (``None`` where the line never ran). ``calls`` is the number of recorded calls.
    """

    name: str
    filename: str
    calls: int
    lines: list[tuple[int, str, dict[str, int] | None]]
    #: The line of the ``def`` statement (of the first line for a lambda); 0 where unknown.
    first_line: int = 0


class FunctionRecord:
    """The rows of one code object: ``rows[line]`` for body lines, ``rows[ENTRY]`` for entry."""

    def __init__(self, code: CodeType, layout: ColumnLayout) -> None:
        self.code = code
        self.qualname = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        self.rows: dict[int, list[int]] = {}
        self.layout = layout

    @property
    def calls(self) -> int:
        """Number of calls recorded (generator and coroutine resumptions are not calls)."""
        entry = self.rows.get(ENTRY)
        return entry[0] if entry else 0

    def source_lines(self) -> tuple[int, list[str]]:
        """(first line number, source lines) of the function, decorators included."""
        code = self.code
        try:
            lines, first = inspect.getsourcelines(code)
        except (OSError, TypeError):
            first = code.co_firstlineno
            last = max((line for _, _, line in code.co_lines() if line is not None), default=first)
            lines = [linecache.getline(code.co_filename, n) for n in range(first, last + 1)]
        return max(first, 1), [line.rstrip("\r\n") for line in lines]

    def table(self, name: str, columns: Sequence[str]) -> FunctionTable:
        """The rows for ``columns`` (already validated and recorded), on every source line but
        those of the docstring."""
        index = self.layout.row_index
        rows = {**self.rows}
        found = _function_node(self.code)
        def_line = _def_line(self.code, found)
        if ENTRY in rows:
            entry = rows.pop(ENTRY)
            body = rows.get(def_line)  # a one-line function: its body runs on the def line
            rows[def_line] = entry if body is None else self.layout.merge_entry(entry, body)
        docstring = _docstring_lines(found)
        first, source = self.source_lines()
        lines = []
        for offset, text in enumerate(source):
            if first + offset in docstring:
                continue
            row = rows.get(first + offset)
            values = None if row is None else {c: row[index[c]] for c in columns}
            lines.append((first + offset, text, values))
        return FunctionTable(name, self.code.co_filename, self.calls, lines, def_line)


class LineRecords:
    """Per-line aggregates of every registered function, under one :class:`ColumnLayout`."""

    def __init__(self, layout: ColumnLayout) -> None:
        self.layout = layout
        self.functions: dict[CodeType, FunctionRecord] = {}
        #: The ``co_name`` of every registered code object: the tracer's first test at each new
        #: frame (a code object hashes its bytecode and constants at every lookup, a name once).
        self.co_names: set[str] = set()
        #: The memory source of the latest session: its ``describe()`` says where numbers come from.
        self.source: Any = None

    def add(self, code: CodeType) -> FunctionRecord:
        """Register ``code`` (idempotent) and return its record."""
        record = self.functions.get(code)
        if record is None:
            record = self.functions[code] = FunctionRecord(code, self.layout)
            self.co_names.add(code.co_name)
        return record

    def relayout(self, layout: ColumnLayout) -> None:
        """Switch to ``layout``, converting recorded rows (new statistics start from 0).

        Each record gets a fresh ``rows`` dict, so a suspended generator still holding the old
        dict writes to a detached copy instead of mixing layouts.
        """
        old, self.layout = self.layout, layout
        for record in self.functions.values():
            record.rows = {line: layout.convert(row, old) for line, row in record.rows.items()}
            record.layout = layout

    def clear(self, codes: Iterable[CodeType] | None = None) -> None:
        """Forget the rows of ``codes`` (default: all); the functions stay registered."""
        for code in self.functions if codes is None else codes:
            record = self.functions.get(code)
            if record is not None:
                record.rows = {}

    def names(self) -> dict[CodeType, str]:
        """A display name per code object: the qualified name, plus ``(file:line)`` of the ``def``
        (:func:`where`) when two registered functions share it."""
        counts: dict[str, int] = {}
        for record in self.functions.values():
            counts[record.qualname] = counts.get(record.qualname, 0) + 1
        names = {}
        for code, record in self.functions.items():
            name = record.qualname
            if counts[name] > 1:
                name = f"{name} ({where(code.co_filename, _def_line(code, _function_node(code)))})"
            names[code] = name
        return names

    def tables(self, codes: Iterable[CodeType], columns: Sequence[str]) -> list[FunctionTable]:
        """One :class:`FunctionTable` per code object in ``codes``, in the given order."""
        names = self.names()
        return [self.functions[code].table(names[code], columns) for code in codes]
