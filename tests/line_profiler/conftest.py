"""Helpers for the line profiler tests: exact-byte trackers and rows keyed by source text."""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pandas as pd
import pytest

import memlab
from memlab.line_profiler import decorators


@pytest.fixture
def exact() -> Iterator[memlab.TensorTracker]:
    """A tracker counting exact bytes (no allocator rounding), reused by the profilers."""
    with memlab.TensorTracker(allocator=None) as tracker:
        yield tracker


@pytest.fixture
def global_profiler() -> Iterator[Any]:
    """The decorators' profiler, emptied before the test; its exit report is not left behind."""
    profiler = memlab.line_profiler.global_line_profiler()
    profiler.clear()
    profiler.at_exit.clear()
    profiler.leftovers.clear()
    trace = sys.gettrace()
    yield profiler
    atexit.unregister(profiler.print_at_exit)
    profiler._exit_registered = False
    profiler.at_exit.clear()
    profiler.leftovers.clear()
    profiler.target_gpu = 0
    assert sys.gettrace() is trace
    assert decorators._global is profiler


def _rows(lp: memlab.LineProfiler, func: Any, columns: Sequence[str]) -> list[tuple[Any, ...]]:
    frame = lp.to_dataframe(func, columns)
    out = []
    for record in frame.itertuples(index=False):
        values = tuple(None if pd.isna(v) else int(v) for v in record[:-1])
        out.append((record[-1].strip(), *values))
    return out


@pytest.fixture
def rows() -> Callable[..., list[tuple[Any, ...]]]:
    """``rows(lp, func, columns)``: ``(stripped source, *values)`` per source line of ``func``, with
    ``None`` where a line never ran, so an expected table reads like the printed profile."""
    return _rows
