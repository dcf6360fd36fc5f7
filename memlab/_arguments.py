"""What users type to the magics and the ``memlab`` command, checked: columns and devices.

Errors are ``ValueError`` with a one-line message that says what would have been valid; the
callers turn them into an IPython ``UsageError`` or a command-line error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from memlab.line_profiler import DEFAULT_COLUMNS
from memlab.line_profiler.records import EXTRA_COLUMNS
from memlab.sources.stats import STAT_KEYS

__all__ = ["columns_shown", "device_argument"]


def _valid_columns() -> str:
    """The valid column names, summarised: ``<stat>.<pool>.<metric>`` plus the other keys."""
    families = {k.split(".")[0]: None for k in STAT_KEYS if k.count(".") == 2}
    others = [k for k in STAT_KEYS if k.count(".") != 2]
    pools = {k.split(".")[1]: None for k in STAT_KEYS if k.count(".") == 2}
    metrics = {k.split(".")[2]: None for k in STAT_KEYS if k.count(".") == 2}
    return (
        f"{', '.join(EXTRA_COLUMNS)}; <stat>.<pool>.<metric> with stat {'/'.join(families)}, "
        f"pool {'/'.join(pools)}, metric {'/'.join(metrics)}; or {', '.join(others)}"
    )


def columns_shown(no_defaults: bool, extra: Iterable[str]) -> tuple[str, ...]:
    """The columns to show: the defaults (unless ``no_defaults``) then ``extra``, each once.

    Raises ``ValueError`` for an unknown name (suggesting the closest valid one) or for no column.
    """
    columns = tuple(dict.fromkeys([*(() if no_defaults else DEFAULT_COLUMNS), *extra]))
    if not columns:
        raise ValueError("-D hides the default columns: name at least one column with -c COL")
    valid = (*EXTRA_COLUMNS, *STAT_KEYS)
    for column in columns:
        if column not in valid:
            close = difflib.get_close_matches(column, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown column {column!r}{hint}; valid columns: {_valid_columns()}")
    return columns


def device_argument(text: str) -> int | str:
    """A device as typed: a CUDA index (``"0"`` -> ``0``) or a device string (``cpu``, ``cuda:1``)."""
    return int(text) if text.isdigit() else text
