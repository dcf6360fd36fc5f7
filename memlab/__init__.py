"""memlab: where does my PyTorch memory go, line by line, and will it fit?

Importing memlab has no side effects: it does not initialise CUDA, install a trace function or print.
"""

from __future__ import annotations

from memlab.courtesy import Courtesy
from memlab.history.export import dump_snapshot
from memlab.line_profiler import (
    DEFAULT_COLUMNS,
    LineProfiler,
    clear_global_line_profiler,
    profile,
    profile_every,
    set_target_gpu,
)
from memlab.reporter import MemReporter
from memlab.sources.allocator import CachingAllocatorModel
from memlab.sources.stats import STAT_KEYS
from memlab.sources.tracker import TensorTracker

__version__ = "0.1.0"


def load_ipython_extension(ipython: object) -> None:
    """Register memlab's magics (``%mlrun``, ``%%mlrun``, ``%memreport``): ``%load_ext memlab``.

    IPython is imported only here, so importing memlab never imports it."""
    from memlab.extension import load_ipython_extension as load

    load(ipython)


__all__ = [
    "DEFAULT_COLUMNS",
    "STAT_KEYS",
    "CachingAllocatorModel",
    "Courtesy",
    "LineProfiler",
    "MemReporter",
    "TensorTracker",
    "__version__",
    "clear_global_line_profiler",
    "dump_snapshot",
    "load_ipython_extension",
    "profile",
    "profile_every",
    "set_target_gpu",
]
