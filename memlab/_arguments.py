"""What users type to the magics and the ``memlab`` command: the options they share, and the
columns and devices given to them, checked.

Columns are checked by :func:`memlab.line_profiler.records.validate_columns`, as in the Python
API; this module adds the command-line wording. (Devices are read by :mod:`memlab._devices` and
targets checked by :func:`memlab.sources.select.check_target`, also as in the Python API.) Errors are
``ValueError`` with a one-line message that says what would have been valid; the callers turn them
into an IPython ``UsageError`` or a command-line error.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Iterable
from typing import Any

from memlab._outputs import check_output_path
from memlab.line_profiler import DEFAULT_COLUMNS
from memlab.line_profiler.records import EXTRA_COLUMNS, TIME, validate_columns
from memlab.sources.stats import STAT_KEYS

__all__ = [
    "BY_MODULE_OPTION",
    "COLUMN_OPTION",
    "FUNCTION_OPTION",
    "GPU_OPTION",
    "NO_DEFAULT_COLUMNS_OPTION",
    "OUTPUT_OPTION",
    "PLOT_OPTION",
    "SNAPSHOT_OPTION",
    "TABLE_EXTENSIONS",
    "check_plot_path",
    "check_snapshot_path",
    "check_table_path",
    "columns_shown",
]

#: File endings accepted for a memory snapshot pickle.
SNAPSHOT_EXTENSIONS = (".pickle", ".pkl")
#: File endings accepted for a plot (matplotlib writes each by its ending).
PLOT_EXTENSIONS = (".png", ".svg", ".pdf")
#: File endings accepted for a table (``-o``): text, JSON or CSV, by the ending.
TABLE_EXTENSIONS = (".txt", ".json", ".csv")

# Keyword arguments of the options that `memlab run`, `memlab demo` and %mlrun share, for argparse's
# add_argument and IPython's @argument alike (argparse copies an append action's default list).
FUNCTION_OPTION: dict[str, Any] = {
    "metavar": "FUNC",
    "action": "append",
    "default": [],
    "help": "a function to profile: name, Class.method or module:qualname, also one the code itself "
    "defines; repeat for several",
}
COLUMN_OPTION: dict[str, Any] = {
    "metavar": "COL",
    "action": "append",
    "default": [],
    "help": f"a statistic to show besides {', '.join(DEFAULT_COLUMNS)}: any key of "
    "torch.cuda.memory_stats(), hits, delta or time; repeat for several",
}
BY_MODULE_OPTION: dict[str, Any] = {
    "action": "store_true",
    "help": "also show the memory per module of every model the code calls (forward and backward peaks, "
    "parameters, gradients, optimizer state, activations), highest peak first",
}
NO_DEFAULT_COLUMNS_OPTION: dict[str, Any] = {"action": "store_true", "help": "hide the default columns"}
GPU_OPTION: dict[str, Any] = {
    "metavar": "DEVICE",
    "help": "device to measure: a CUDA index or cpu, cuda:1, ... (default 0; without a GPU, the "
    "default device, with the numbers a CUDA GPU would show)",
}
OUTPUT_OPTION: dict[str, Any] = {
    "metavar": "FILE",
    "help": "also write the table to FILE (.txt, .json, .csv)",
}

PLOT_OPTION: dict[str, Any] = {
    "metavar": "FILE",
    "help": "also plot the run's allocated and reserved memory over its allocator events to FILE "
    "(.png, .svg, .pdf), the peak marked with its file:line; needs matplotlib: pip install 'memlab[plot]'",
}
SNAPSHOT_OPTION: dict[str, Any] = {
    "metavar": "FILE",
    "help": "also write the run's memory snapshot to FILE (.pickle), in the format of "
    "torch.cuda.memory._snapshot(): PyTorch's own on a CUDA GPU, the tracker's model without one; "
    "view it with memlab viz, python -m torch.cuda._memory_viz or pytorch.org/memory_viz",
}


def check_snapshot_path(path: str, name: str = "--snapshot") -> str:
    """``path`` if a snapshot pickle can be written there, before anything runs.

    Raises ``ValueError`` (one line, naming the option ``name``) when ``path`` does not end in
    ``.pickle`` or ``.pkl``, is a folder, or its folder does not exist or may not be written
    (:func:`memlab._outputs.check_output_path`).
    """
    check_output_path(path, name, SNAPSHOT_EXTENSIONS)
    return path


def check_plot_path(path: str, name: str = "--plot") -> str:
    """``path`` if a plot can be written there, before anything runs: it ends in ``.png``,
    ``.svg`` or ``.pdf``, can be written (:func:`memlab._outputs.check_output_path`) and matplotlib
    is installed; else ``ValueError`` naming the option ``name``."""
    check_output_path(path, name, PLOT_EXTENSIONS)
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{name} {path}: plotting needs matplotlib: pip install 'memlab[plot]'")
    return path


def check_table_path(path: str, name: str = "-o") -> str:
    """``path`` if the table can be written there, before anything runs: it ends in ``.txt``,
    ``.json`` or ``.csv`` (:data:`TABLE_EXTENSIONS`) and can be written
    (:func:`memlab._outputs.check_output_path`); else ``ValueError`` naming the option ``name``."""
    check_output_path(path, name, TABLE_EXTENSIONS)
    return path


def _valid_columns() -> str:
    """The valid column names, summarised: ``<stat>.<pool>.<metric>`` plus the other keys."""
    families = {k.split(".")[0]: None for k in STAT_KEYS if k.count(".") == 2}
    others = [k for k in STAT_KEYS if k.count(".") != 2]
    pools = {k.split(".")[1]: None for k in STAT_KEYS if k.count(".") == 2}
    metrics = {k.split(".")[2]: None for k in STAT_KEYS if k.count(".") == 2}
    return (
        f"{', '.join((*EXTRA_COLUMNS, TIME))}; <stat>.<pool>.<metric> with stat {'/'.join(families)}, "
        f"pool {'/'.join(pools)}, metric {'/'.join(metrics)}; or {', '.join(others)}"
    )


def columns_shown(no_defaults: bool, extra: Iterable[str]) -> tuple[str, ...]:
    """The columns to show: the defaults (unless ``no_defaults``) then ``extra``, each once.

    Accepts what :func:`~memlab.line_profiler.records.validate_columns` accepts (the keys of
    ``torch.cuda.memory_stats()``, ``hits``, ``delta`` and ``time``). Raises ``ValueError`` for an
    unknown name (suggesting the closest valid one) or for no column.
    """
    columns = tuple(dict.fromkeys([*(() if no_defaults else DEFAULT_COLUMNS), *extra]))
    if not columns:
        raise ValueError("-D hides the default columns: name at least one column with -c COL")
    for column in columns:
        try:
            validate_columns(column)
        except ValueError:
            close = difflib.get_close_matches(column, (*EXTRA_COLUMNS, TIME, *STAT_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown column {column!r}{hint}; valid columns: {_valid_columns()}") from None
    return columns
