"""Line-by-line memory profiling of PyTorch code: ``LineProfiler``, ``@profile``, ``@profile_every``.

``tracer`` turns line events into per-line aggregates (``records``); ``display`` renders them as
text and HTML, ``export`` as a DataFrame, JSON, CSV and versioned plain data; ``decorators`` holds
the decorators and their global profiler.
"""

from __future__ import annotations

from memlab.line_profiler.decorators import (
    clear_global_line_profiler,
    global_line_profiler,
    profile,
    profile_every,
    set_target_gpu,
)
from memlab.line_profiler.display import LineStats
from memlab.line_profiler.export import read_csv, read_json
from memlab.line_profiler.profiler import LineProfiler
from memlab.line_profiler.records import DEFAULT_COLUMNS

__all__ = [
    "DEFAULT_COLUMNS",
    "LineProfiler",
    "LineStats",
    "clear_global_line_profiler",
    "global_line_profiler",
    "profile",
    "profile_every",
    "read_csv",
    "read_json",
    "set_target_gpu",
]
