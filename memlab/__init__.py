"""memlab: where does my PyTorch memory go, line by line, and will it fit?

Importing memlab has no side effects: it does not initialise CUDA, install a trace function or print.
The public names load their modules (and torch) on first use, so that ``import memlab`` and the
pytest plugin (``memlab.pytest_plugin``, loaded by every pytest run where memlab is installed) cost
nothing until something is used. It also wires the layers together where a lower one takes a
higher one's behaviour as a callback: profiled calls explain their out-of-memory errors
(:data:`memlab._call_watches.CALL_WATCHES`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from memlab import _call_watches, _torch_version

_torch_version.check_supported()

if TYPE_CHECKING:
    import os

    from matplotlib.figure import Figure

    from memlab.courtesy import Courtesy
    from memlab.estimate import Estimate, EstimateError, autobatch, max_batch_size
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
    from memlab.plan import Plan
    from memlab.reporter import MemReporter
    from memlab.sources.allocator import CachingAllocatorModel
    from memlab.sources.stats import STAT_KEYS
    from memlab.sources.tracker import TensorTracker

__version__ = "0.1.0"

# Public name -> the module that defines it, imported at the first access (PEP 562).
_LAZY = {
    "Courtesy": "memlab.courtesy",
    "Estimate": "memlab.estimate.estimate",
    "EstimateError": "memlab.estimate.estimate",
    "max_batch_size": "memlab.estimate.fit",
    "autobatch": "memlab.estimate.microbatch",
    "dump_snapshot": "memlab.history.export",
    "DEFAULT_COLUMNS": "memlab.line_profiler",
    "LineProfiler": "memlab.line_profiler",
    "clear_global_line_profiler": "memlab.line_profiler",
    "profile": "memlab.line_profiler",
    "profile_every": "memlab.line_profiler",
    "set_target_gpu": "memlab.line_profiler",
    "explain_oom": "memlab.oom",
    "Plan": "memlab.plan.planner",
    "MemReporter": "memlab.reporter",
    "CachingAllocatorModel": "memlab.sources.allocator",
    "STAT_KEYS": "memlab.sources.stats",
    "TensorTracker": "memlab.sources.tracker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "estimate", "plan"})


def _function_over_subpackage(name: str, module: str) -> property:
    """``memlab.<name>``, the function ``module`` defines, which is also the name of the subpackage
    that holds it: importing the subpackage (``from memlab.estimate import max_batch_size``) makes
    Python set the package's attribute to the subpackage; this property keeps the function (the
    subpackage stays in ``sys.modules``), imported at the first use."""

    def get(self: types.ModuleType) -> Any:
        return getattr(importlib.import_module(module), name)

    def record(self: types.ModuleType, value: Any) -> None:
        pass  # the import system recording the subpackage: the name stays the function

    return property(get, record, doc=f":func:`{module}.{name}`, imported at the first use.")


class _Package(types.ModuleType):
    """memlab's module type, for the names that are both a function and the subpackage defining it."""

    estimate = _function_over_subpackage("estimate", "memlab.estimate.estimate")
    plan = _function_over_subpackage("plan", "memlab.plan.planner")


sys.modules[__name__].__class__ = _Package


def _explain_oom_watch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The :func:`explain_oom` watch of one profiled call (``func=None``: a ``with lp:`` block).
    The line profiler enters it without importing :mod:`memlab.oom` (a higher layer), which is
    imported at the first profiled call."""
    from memlab.oom.watch import watching

    return watching(func, args, kwargs)


_call_watches.CALL_WATCHES.append(_explain_oom_watch)  # profiled calls explain their OOMs


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
    "Plan",
    "TensorTracker",
    "__version__",
    "autobatch",
    "clear_global_line_profiler",
    "dump_snapshot",
    "estimate",
    "explain_oom",
    "load_ipython_extension",
    "max_batch_size",
    "plan",
    "plot_memory",
    "profile",
    "profile_every",
    "set_target_gpu",
]
