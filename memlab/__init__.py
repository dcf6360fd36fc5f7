"""memlab: where does my PyTorch memory go, line by line, and will it fit?

Importing memlab has no side effects: it does not initialise CUDA, install a trace function or print.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memlab.courtesy import Courtesy
from memlab.estimate import Estimate, EstimateError, autobatch, estimate, max_batch_size
from memlab.history.export import dump_snapshot
from memlab.line_profiler import (
    DEFAULT_COLUMNS,
    LineProfiler,
    clear_global_line_profiler,
    profile,
    profile_every,
    set_target_gpu,
)
from memlab.oom import explain_oom
from memlab.reporter import MemReporter
from memlab.sources.allocator import CachingAllocatorModel
from memlab.sources.stats import STAT_KEYS
from memlab.sources.tracker import TensorTracker

if TYPE_CHECKING:
    import os

    from matplotlib.figure import Figure

__version__ = "0.1.0"


def plot_memory(
    source: object, path: str | os.PathLike[str] | None = None, device: int | None = None
) -> Figure:
    """Plot allocated and reserved bytes over a run's allocator events, the allocated bytes stacked
    by category and the peak marked with the ``file:line`` that reached it: see
    :func:`memlab.history.plot.plot_memory`. matplotlib (``pip install 'memlab[plot]'``) is
    imported only here, so importing memlab never imports it."""
    from memlab.history.plot import plot_memory as plot

    return plot(source, path, device)


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
    "Estimate",
    "EstimateError",
    "LineProfiler",
    "MemReporter",
    "TensorTracker",
    "__version__",
    "autobatch",
    "clear_global_line_profiler",
    "dump_snapshot",
    "estimate",
    "explain_oom",
    "load_ipython_extension",
    "max_batch_size",
    "plot_memory",
    "profile",
    "profile_every",
    "set_target_gpu",
]
