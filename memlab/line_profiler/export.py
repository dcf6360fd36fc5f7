"""Line records outside the process: a versioned plain-data form, a DataFrame, JSON and CSV files.

:func:`records_to_data` / :func:`records_from_data` turn :class:`FunctionTable` lists into a dict of
plain values (JSON-able, picklable) and back, exactly; the DataFrame, JSON and CSV functions are
what ``LineProfiler.to_dataframe`` / ``to_json`` / ``to_csv`` and :func:`read_json` / :func:`read_csv`
use.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memlab._outputs import check_text_output, write_text
from memlab.line_profiler.records import FunctionTable

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "FORMAT",
    "VERSION",
    "read_csv",
    "read_json",
    "records_from_data",
    "records_to_data",
    "to_dataframe",
    "write_csv",
    "write_json",
]

#: The ``format`` and ``version`` of :func:`records_to_data`'s dicts.
FORMAT = "memlab.line_records"
VERSION = 1
_EXPECTED = f"format {FORMAT!r} version {VERSION}"
_INDEX = ["function", "line"]
_JSON_FORMAT = "memlab.line_profiler/1"


# -- plain data -----------------------------------------------------------------------------------
def records_to_data(
    tables: Sequence[FunctionTable], columns: Sequence[str], source: str | None = None
) -> dict[str, Any]:
    """``tables`` as plain data that ``json.dumps`` and ``pickle`` take and another process reads
    with :func:`records_from_data`::

        {"format": "memlab.line_records", "version": 1, "source": line or None,
         "columns": [column, ...],
         "functions": [{"name", "filename", "calls", "first_line",
                        "lines": [[line number, source text, [value per column] or None], ...]}]}

    Values are what the tables hold for ``columns`` (bytes for ``*_bytes.*`` and ``delta``,
    nanoseconds for ``time``, counts otherwise); ``None`` for a line that never ran. ``source`` is
    the line that says where the numbers come from (``LineProfiler.source_line()``).
    """
    columns = list(columns)
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": source,
        "columns": columns,
        "functions": [
            {
                "name": table.name,
                "filename": table.filename,
                "calls": table.calls,
                "first_line": table.first_line,
                "lines": [
                    [number, code, None if values is None else [values[c] for c in columns]]
                    for number, code, values in table.lines
                ],
            }
            for table in tables
        ],
    }


def records_from_data(data: dict[str, Any]) -> list[FunctionTable]:
    """The tables :func:`records_to_data` turned into ``data``, rendered with ``data["columns"]``.

    Raises ``TypeError`` when ``data`` is not a dict and ``ValueError`` when it has another
    ``format``, a newer ``version`` or a malformed body; the message names the expected format and
    version.
    """
    if not isinstance(data, dict):
        raise TypeError(f"expected a dict of {_EXPECTED}, got {type(data).__name__}")
    found, version = data.get("format"), data.get("version")
    if found != FORMAT:
        raise ValueError(f"not memlab line records: expected {_EXPECTED}, got format {found!r}")
    if version != VERSION:
        newer = isinstance(version, int) and version > VERSION
        why = "newer than this memlab reads; upgrade memlab" if newer else "not a known version"
        raise ValueError(f"memlab line records version {version!r} is {why} (expected {_EXPECTED})")
    try:
        columns = list(data["columns"])
        return [_table(function, columns) for function in data["functions"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"malformed memlab line records ({_EXPECTED}): {error!r}") from None


def _table(function: dict[str, Any], columns: list[str]) -> FunctionTable:
    lines = [
        (int(number), str(code), None if values is None else dict(zip(columns, values, strict=True)))
        for number, code, values in function["lines"]
    ]
    first_line = int(function.get("first_line", 0))  # records written before it was kept: unknown
    return FunctionTable(
        str(function["name"]), str(function["filename"]), int(function["calls"]), lines, first_line
    )


# -- DataFrame ------------------------------------------------------------------------------------
def _frame(rows: list[list[Any]], columns: Sequence[str], source: str | None = None) -> pd.DataFrame:
    """The public DataFrame from ``[function, line, *values, code]`` rows."""
    import pandas as pd  # only when asked for a DataFrame: importing memlab stays light

    index = pd.MultiIndex.from_arrays(
        [pd.Index([r[0] for r in rows], dtype=object), pd.Index([r[1] for r in rows], dtype="int64")],
        names=_INDEX,
    )
    data: dict[str, Any] = {}
    for i, column in enumerate(columns):
        data[column] = pd.array([r[2 + i] for r in rows], dtype="Int64")
    data["code"] = pd.array([r[-1] for r in rows], dtype=object)
    frame = pd.DataFrame(data, index=index, columns=pd.Index([*columns, "code"], dtype=object))
    frame.attrs["source"] = source
    return frame


def to_dataframe(
    tables: Sequence[FunctionTable], columns: Sequence[str], source: str | None = None
) -> pd.DataFrame:
    """One row per source line of each function, indexed by (function, line); ``attrs["source"]``
    is the line that says where the numbers come from."""
    rows = [
        [t.name, number, *(None if v is None else v[c] for c in columns), code]
        for t in tables
        for number, code, v in t.lines
    ]
    return _frame(rows, columns, source)


def _rows(frame: pd.DataFrame) -> tuple[list[str], list[list[Any]]]:
    import pandas as pd

    columns = [c for c in frame.columns if c != "code"]
    rows = []
    for (function, line), record in zip(frame.index, frame.itertuples(index=False), strict=True):
        values = [None if pd.isna(v) else int(v) for v in record[:-1]]
        rows.append([function, int(line), *values, record[-1]])
    return columns, rows


# -- files ----------------------------------------------------------------------------------------
def _write(text: str, path_or_buf: Any) -> str | None:
    check_text_output(path_or_buf)
    if path_or_buf is None:
        return text
    if hasattr(path_or_buf, "write"):
        path_or_buf.write(text)
    else:
        write_text(path_or_buf, text, newline="")
    return None


def _read(path_or_buf: Any, is_text: bool) -> str:
    """The exported text: read from a file object, given as ``path_or_buf`` itself when
    ``is_text`` says so, otherwise read from the path (``FileNotFoundError`` if there is none)."""
    if hasattr(path_or_buf, "read"):
        return str(path_or_buf.read())
    if isinstance(path_or_buf, str) and is_text:
        return path_or_buf
    if isinstance(path_or_buf, (str, os.PathLike)):
        with open(path_or_buf, encoding="utf-8", newline="") as file:
            return file.read()
    raise TypeError(
        f"path_or_buf must be a path, a file object or the exported text, got {type(path_or_buf).__name__} "
        f"{path_or_buf!r:.80}"
    )


def write_json(frame: pd.DataFrame, path_or_buf: Any = None) -> str | None:
    """Write a line-records DataFrame as JSON (``None`` for values of lines that never ran), with
    the line that says where its numbers come from (``frame.attrs["source"]``)."""
    columns, rows = _rows(frame)
    data = {"format": _JSON_FORMAT, "source": frame.attrs.get("source"), "columns": columns, "rows": rows}
    return _write(json.dumps(data), path_or_buf)


def read_json(path_or_buf: Any) -> pd.DataFrame:
    """Read what ``LineProfiler.to_json`` wrote back into the DataFrame ``LineProfiler.to_dataframe``
    returned.

    ``path_or_buf`` is a file object, the JSON text itself (a ``str`` whose first non-blank
    character is ``{``), or else a path (``str`` or ``os.PathLike``): a missing file raises
    ``FileNotFoundError``. Raises ``ValueError`` for JSON that is not a memlab line profile.
    """
    is_text = isinstance(path_or_buf, str) and path_or_buf.lstrip().startswith("{")
    try:
        data = json.loads(_read(path_or_buf, is_text))
    except ValueError as error:  # not JSON (a CSV), or not text at all (a pickle)
        raise ValueError(
            f"path_or_buf {_shown(path_or_buf)} is not a memlab line profile: expected the JSON "
            f"LineProfiler.to_json writes ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
        raise ValueError(
            f"path_or_buf {_shown(path_or_buf)} is not a memlab line profile (expected JSON of format "
            f"{_JSON_FORMAT!r})"
        )
    return _frame(data["rows"], data["columns"], data.get("source"))


def _shown(path_or_buf: Any) -> str:
    """``path_or_buf`` as an error message shows it: a path, or what kind of object it is."""
    if isinstance(path_or_buf, os.PathLike) or (isinstance(path_or_buf, str) and "\n" not in path_or_buf):
        return repr(os.fspath(path_or_buf))[:200]
    return f"({type(path_or_buf).__name__})"


def write_csv(frame: pd.DataFrame, path_or_buf: Any = None) -> str | None:
    """Write a line-records DataFrame as CSV (an empty cell where a line never ran)."""
    columns, rows = _rows(frame)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*_INDEX, *columns, "code"])
    writer.writerows([["" if v is None else v for v in row] for row in rows])
    return _write(buffer.getvalue(), path_or_buf)


def read_csv(path_or_buf: Any) -> pd.DataFrame:
    """Read what ``LineProfiler.to_csv`` wrote back into the DataFrame ``LineProfiler.to_dataframe``
    returned.

    ``path_or_buf`` is a file object, the CSV text itself (a ``str`` containing a newline, as every
    exported CSV does), or else a path (``str`` or ``os.PathLike``): a missing file raises
    ``FileNotFoundError``. Raises ``ValueError`` for a CSV that is not a memlab line profile.
    """
    is_text = isinstance(path_or_buf, str) and "\n" in path_or_buf
    try:
        reader = csv.reader(io.StringIO(_read(path_or_buf, is_text)))
        header = next(reader, [])
    except (ValueError, csv.Error) as error:  # not text (a pickle)
        raise ValueError(
            f"path_or_buf {_shown(path_or_buf)} is not a memlab line profile CSV ({type(error).__name__}: "
            f"{error})"
        ) from None
    if header[:2] != _INDEX or header[-1:] != ["code"]:
        raise ValueError(
            f"path_or_buf {_shown(path_or_buf)} is not a memlab line profile CSV (expected columns "
            f"{_INDEX} ... code)"
        )
    rows = [[r[0], int(r[1]), *(int(v) if v else None for v in r[2:-1]), r[-1]] for r in reader]
    return _frame(rows, header[2:-1])
