"""LineProfiler: which functions to trace, where the numbers come from, and access to the results.

A profiler owns its registered functions, their per-line records and a memory source. Tracing is
on while the profiler is enabled (``enable()``/``disable()``, ``with lp:``, or the wrappers returned
by ``lp(func)``, which enable it only while the wrapped function runs).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from collections.abc import Iterable, Sequence
from typing import IO, TYPE_CHECKING, Any

import torch
from line_profiler.profiler_mixin import ByCountProfilerMixin

from memlab._call_watches import WatchedCall
from memlab._outputs import check_stream
from memlab.line_profiler import display as _display
from memlab.line_profiler import export as _export
from memlab.line_profiler.local_tracer import samplers
from memlab.line_profiler.records import (
    DEFAULT_COLUMNS,
    EXTRA_COLUMNS,
    ColumnLayout,
    LineRecords,
    validate_columns,
)
from memlab.line_profiler.tracer import Tracer
from memlab.sources.base import MemorySource
from memlab.sources.select import Selection, SourceSelector, check_target

if TYPE_CHECKING:
    import os

    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["LineProfiler"]

Target = torch.device | str | int


def _code_objects(func: Any) -> list[types.CodeType]:
    """The code objects to trace for ``func`` (function, method, property, partial, class...)."""
    if not callable(func) and not isinstance(func, (property, classmethod, staticmethod)):
        raise TypeError(
            "add_function() needs a Python function, method, property, partial, class or a callable "
            f"object defined in Python; got {type(func).__name__} {func!r}, which is not callable"
        )
    if isinstance(func, types.FunctionType):
        func = inspect.unwrap(func)
    try:
        functions = ByCountProfilerMixin.get_underlying_functions(func)
    except TypeError as error:
        raise TypeError(f"cannot profile {func!r}: {error}") from None
    # Decorated functions (ours included) are traced through to the function they wrap.
    functions = [inspect.unwrap(f) for f in functions]
    codes = list(dict.fromkeys(f.__code__ for f in functions if isinstance(f, types.FunctionType)))
    if not codes:
        raise TypeError(
            f"cannot profile {func!r}: it has no Python code to trace (builtins and C extensions "
            "have none); pass a function, method, property, partial or class defined in Python"
        )
    return codes


class LineProfiler(ByCountProfilerMixin):
    """Memory statistics of registered functions, line by line.

    ``LineProfiler(*functions, target_gpu=0, source=None, columns=DEFAULT_COLUMNS)`` traces the
    given functions while enabled. Each line's row describes the interval from the moment the line
    starts to the moment the next line of the same frame starts (or the frame returns): ``*.peak``
    columns are the highest value in the interval (absolute bytes, not a delta), ``*.allocated`` /
    ``*.freed`` and event counters what happened inside it, ``*.current`` the value at its end.
    Calls made on the line, profiled or not, are inside it. Over several executions peaks take
    the max, sums add up and currents keep the last value; ``hits`` counts executions and
    ``delta`` the net change of ``allocated_bytes.all.current``. Sums count each allocation once
    per line of the frame that made it or contains the call that made it: a recursive frame on a
    line that an enclosing frame of the same function is also on adds nothing to it again. The
    ``def`` line shows the state at entry (peaks read the current value then; a function written
    on one line shows its body's row there, with the peaks at entry folded in).

    ``columns`` are the statistics recorded (any key of ``torch.cuda.memory_stats()``, see
    :data:`memlab.STAT_KEYS`, and ``"time"``: wall time in nanoseconds summed over hits, memlab's
    own overhead of about a microsecond per line included). Only recorded statistics can be
    displayed: each one recorded costs time on every profiled line, so they are chosen up front
    (here, ``@memlab.profile(columns=...)``, ``memlab run -c``, ``%mlrun -c``) or added with
    :meth:`add_columns` before the next session. :meth:`display` and :meth:`print_stats` show the
    columns asked for (``hits`` and ``delta`` included), in the order given.

    ``source`` says where the numbers come from (:mod:`memlab.sources.select`): ``None``/``"auto"``
    reads the GPU through ``CudaSource`` when ``target_gpu`` names a CUDA device that exists;
    otherwise a :class:`memlab.TensorTracker` (CUDA caching allocator model): the tracker the user
    entered, or the profiler's own, entered while it is enabled and kept between sessions, which
    first adopts the tensors that already exist (the model, optimizer state, the batch), as a GPU's
    numbers would include them. ``"cuda"`` and ``"tracker"`` force one; a ``MemorySource`` is used
    as it is. An ``int`` target is a GPU index: ``0`` on a machine without a GPU measures the
    default device (``torch.get_default_device()``); a GPU that does not exist (``7``,
    ``"cuda:7"``) is a ``ValueError``. Every table starts with one line that says where its
    numbers come from (and, where no tensor was made on the measured device, says so).

    What it cannot see: memory allocated outside PyTorch (and, with the tracker, what a tracker
    cannot see: cuDNN workspaces, the CUDA context, NCCL buffers; it models cuBLAS's, as the GPU
    it models allocates them: see :class:`memlab.TensorTracker`; at adoption, autograd's saved
    tensors of a graph alive at entry and tensors held only by C++); with ``CudaSource``, each
    sample resets CUDA's peak counters. Threads: with a tracker, every thread that runs a profiled
    function enters it, and threads started while profiling are counted too; threads that were
    already running and never run a profiled function (a thread pool made before) are not, and
    the line that says where numbers come from names them. Several threads profiled at once
    share one sampling window, so their peaks mix.
    """

    def __init__(
        self,
        *functions: Any,
        target_gpu: Target = 0,
        source: str | MemorySource | None = None,
        columns: str | Iterable[str] = DEFAULT_COLUMNS,
    ) -> None:
        self._selector = SourceSelector(source)
        self._target = check_target(target_gpu)
        asked = tuple(dict.fromkeys(validate_columns(columns)))
        recorded = [c for c in asked if c not in EXTRA_COLUMNS]
        self._records = LineRecords(ColumnLayout(recorded or DEFAULT_COLUMNS))
        self._shown = asked or DEFAULT_COLUMNS  # what display() shows by default: what was asked for
        self._wanted = self._records.layout
        self._tracer = Tracer(self._records.functions, self._records.co_names)
        self._lock = threading.RLock()
        self._threads = threading.local()
        self._sessions = 0
        self._selection: Selection | None = None
        self._block_watches: list[WatchedCall] = []  # watches of `with lp:` blocks, innermost last
        for func in functions:
            self.add_function(func)

    # -- what to trace ----------------------------------------------------------------------------
    @property
    def target_gpu(self) -> torch.device | int:
        """The device measured: an ``int`` CUDA index or a ``torch.device``. Setting it takes effect
        at the next time the profiler is enabled from the disabled state."""
        return self._target

    @target_gpu.setter
    def target_gpu(self, target: Target) -> None:
        self._target = check_target(target)

    @property
    def source(self) -> str | MemorySource | None:
        """Where numbers come from: ``None``/``"auto"``, ``"cuda"``, ``"tracker"`` or a
        ``MemorySource``; setting it takes effect at the next session."""
        return self._selector.source

    @source.setter
    def source(self, source: str | MemorySource | None) -> None:
        self._selector = SourceSelector(source)

    @property
    def columns(self) -> tuple[str, ...]:
        """The statistics recorded (plus ``hits`` and ``delta``, always available)."""
        return self._records.layout.keys

    def add_columns(self, columns: str | Iterable[str]) -> None:
        """Record ``columns`` too: at once while the profiler is disabled, otherwise from the next
        time it is enabled (rows recorded before read 0 for them). :meth:`display` then shows them
        by default, after the columns asked for before."""
        asked = validate_columns(columns)
        new = [c for c in asked if c not in EXTRA_COLUMNS]
        with self._lock:
            self._shown = tuple(dict.fromkeys((*self._shown, *asked)))
            self._wanted = ColumnLayout((*self._wanted.keys, *new))
            if not self.enabled:
                self._records.relayout(self._wanted)

    def add_function(self, func: Any) -> None:
        """Register ``func`` for tracing: a function, method, property, ``functools.partial``,
        class (all its methods) or callable object defined in Python. Functions are keyed by code
        object, so two methods with the same name and body in different classes stay separate.
        Raises ``TypeError`` for anything without Python code."""
        for code in _code_objects(func):
            self._records.add(code)

    @property
    def functions(self) -> list[str]:
        """The qualified names of the registered code objects, in registration order."""
        return [record.qualname for record in self._records.functions.values()]

    def __call__(self, func: Any) -> Any:
        """Decorator: register ``func`` and return a wrapper that enables the profiler only while
        ``func`` runs (generators and coroutines: while they run, not while suspended)."""
        self.add_function(func)
        return self.wrap_callable(func)

    # -- enabling ---------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether a profiling session is running (in any thread)."""
        return self._sessions > 0

    def enable_by_count(self) -> None:
        """Enable tracing in the calling thread; calls nest and :meth:`disable_by_count` undoes
        one. The first one starts the session (memory source, thread hook); the first one of each
        thread makes the memory source see that thread (a tracker is entered in it)."""
        depth = getattr(self._threads, "depth", 0)
        if depth == 0:
            with self._lock:
                if self._sessions == 0:
                    self._start_session()
                self._sessions += 1
                selection = self._selection
            try:
                assert selection is not None
                self._threads.leave = selection.enter_thread()
                try:
                    self._threads.token = self._tracer.install()
                except BaseException:
                    self._threads.leave()
                    raise
            except BaseException:
                self._end_thread()
                raise
        self._threads.depth = depth + 1

    def disable_by_count(self) -> None:
        """Undo one :meth:`enable_by_count` of the calling thread (no-op when not enabled)."""
        depth = getattr(self._threads, "depth", 0)
        if depth == 0:
            return
        self._threads.depth = depth - 1
        if depth == 1:
            try:
                self._tracer.uninstall(self._threads.token)
                self._threads.token = None
                self._threads.leave()
            finally:
                self._end_thread()

    def _end_thread(self) -> None:
        with self._lock:
            self._sessions -= 1
            if self._sessions == 0:
                self._stop_session()

    enable = enable_by_count
    disable = disable_by_count

    def __enter__(self) -> LineProfiler:
        watch = WatchedCall()
        watch.__enter__()
        self._block_watches.append(watch)
        try:
            self.enable()
        except BaseException:
            self._block_watches.pop().__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.disable()
        finally:
            self._block_watches.pop().__exit__(exc_type, exc, tb)

    def wrap_function(self, func: Any) -> Any:
        """Wrap ``func`` so that each call enables the profiler while it runs and explains an
        out-of-memory error raised inside it (:func:`memlab.explain_oom`, with its arguments as
        the step: ``import memlab`` registers that watch in :data:`memlab._call_watches.CALL_WATCHES`,
        which the profiler enters around each call and each ``with lp:`` block)."""
        if self._already_a_wrapper(func):
            return func

        @functools.wraps(func)
        def wrapper(*args: Any, **kwds: Any) -> Any:
            with WatchedCall(func, args, kwds):
                self.enable_by_count()
                try:
                    return func(*args, **kwds)
                finally:
                    self.disable_by_count()

        return self._mark_wrapper(wrapper)

    def _start_session(self) -> None:
        if self._wanted != self._records.layout:
            self._records.relayout(self._wanted)
        layout = self._records.layout
        selection = self._selector.open(self._target)
        source, device = selection.source, selection.device
        sample, entry_sample, counting = samplers(lambda keys: source.sampler(keys, device), layout)
        self._tracer.start(layout, sample, entry_sample, selection.on_call, counting)
        self._selection = self._records.source = selection

    def _stop_session(self) -> None:
        self._tracer.stop()
        self._selection = None

    # -- results ----------------------------------------------------------------------------------
    def _codes(self, func: Any) -> list[types.CodeType]:
        """Registered code objects selected by ``func``: None (all), a qualified name, a callable,
        or a list of those."""
        registered = self._records.functions
        if func is None:
            return list(registered)
        selectors = func if isinstance(func, (list, tuple)) else [func]
        codes: list[types.CodeType] = []
        for selector in selectors:
            if isinstance(selector, str):
                found = [c for c, r in registered.items() if r.qualname == selector]
            else:
                found = [c for c in _code_objects(selector) if c in registered]
            if not found:
                names = ", ".join(r.qualname for r in registered.values()) or "none"
                raise ValueError(f"{selector!r} is not a registered function; registered: {names}")
            codes += [c for c in found if c not in codes]
        return codes

    def _tables(self, func: Any, columns: Sequence[str]) -> list[Any]:
        recorded = set(self._records.layout.keys) | set(EXTRA_COLUMNS)
        missing = [c for c in columns if c not in recorded]
        if missing:
            raise ValueError(
                f"column {missing[0]!r} was not recorded: memlab records only the columns chosen "
                "before profiling, since each one costs time on every profiled line; recorded: "
                f"{', '.join((*EXTRA_COLUMNS, *self._records.layout.keys))}. Choose it up front with "
                f"LineProfiler(columns=[..., {missing[0]!r}]), @memlab.profile(columns=...), "
                f"memlab run -c {missing[0]} or %mlrun -c {missing[0]}, or call "
                "add_columns() before the next session"
            )
        return self._records.tables(self._codes(func), columns)

    def display(self, func: Any = None, columns: str | Iterable[str] | None = None) -> _display.LineStats:
        """The per-line statistics of ``func`` (default: every registered function) for ``columns``
        (default: the columns asked for, in their order: ``LineProfiler(columns=...)`` then
        :meth:`add_columns`, ``hits`` and ``delta`` included; :data:`DEFAULT_COLUMNS` unless chosen
        otherwise), as an object that prints as text (``repr``) and renders as HTML in notebooks.
        Byte columns print as 1024-based sizes (``40.00K``); lines that never ran are blank."""
        columns = self._shown if columns is None else validate_columns(columns)
        return _display.LineStats(self._tables(func, columns), columns, self.source_line())

    def source_line(self) -> str | None:
        """The line that says where the numbers come from, e.g. ``measured on cuda:0
        (torch.cuda.memory_stats)`` or ``modelled: CUDA caching allocator replayed from cpu
        tensors (memlab.TensorTracker); 2 tensor storages (40.50K) existed before profiling``;
        ``None`` before the first session."""
        source = self._records.source
        return None if source is None else source.describe()

    def print_stats(
        self,
        func: Any = None,
        columns: str | Iterable[str] | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        """Write :meth:`display` as text to ``stream`` (``None``: ``sys.stdout`` as it is now;
        ``TypeError`` for an object without ``write()``)."""
        check_stream(stream)
        text = repr(self.display(func, columns))
        (sys.stdout if stream is None else stream).write(text)

    def to_dataframe(self, func: Any = None, columns: str | Iterable[str] | None = None) -> pd.DataFrame:
        """The records as a DataFrame indexed by (``function``, ``line``), one row per source line.

        Columns: ``hits`` then the statistics (default: all recorded, then ``delta``), in bytes for
        ``*_bytes.*`` keys and ``delta``, nanoseconds for ``time``, counts otherwise, as nullable
        integers (``<NA>`` where a line never ran), then ``code``. ``attrs["source"]`` is
        :meth:`source_line` (JSON keeps it; CSV has no place for it).
        """
        columns = self._all_columns() if columns is None else validate_columns(columns)
        return _export.to_dataframe(self._tables(func, columns), columns, self.source_line())

    def to_json(self, path_or_buf: Any = None, func: Any = None, columns: Any = None) -> str | None:
        """:meth:`to_dataframe` as JSON (returned as a string when ``path_or_buf`` is None, written
        to a file object as it is, to a path whole or not at all: a full disk leaves the previous
        file); :func:`memlab.line_profiler.read_json` reads it back into the same DataFrame."""
        return _export.write_json(self.to_dataframe(func, columns), path_or_buf)

    def to_csv(self, path_or_buf: Any = None, func: Any = None, columns: Any = None) -> str | None:
        """:meth:`to_dataframe` as CSV (returned as a string when ``path_or_buf`` is None, written
        to a file object as it is, to a path whole or not at all: a full disk leaves the previous
        file); :func:`memlab.line_profiler.read_csv` reads it back into the same DataFrame."""
        return _export.write_csv(self.to_dataframe(func, columns), path_or_buf)

    def plot(
        self,
        func: Any = None,
        column: str = "active_bytes.all.peak",
        path: str | os.PathLike[str] | None = None,
    ) -> Figure:
        """A bar chart of ``column`` (a recorded byte statistic, e.g. ``active_bytes.all.peak`` or
        ``delta``) with one bar per source line of ``func`` (default: every registered function)
        that ran, labelled ``function:line: code``; x axis in bytes with KiB / MiB / GiB ticks.
        Lines that never ran have no bar. Saved to ``path`` when given (format from the
        extension, one matplotlib saves, checked before anything is drawn; written whole or not at
        all); returns the matplotlib ``Figure``. Needs matplotlib (``pip install 'memlab[plot]'``;
        ``ImportError`` otherwise)."""
        from memlab.history.plot import check_byte_column, plot_lines

        check_byte_column(column)
        return plot_lines(self._tables(func, [column]), column, self.source_line(), path)

    def _all_columns(self) -> tuple[str, ...]:
        return ("hits", *self._records.layout.keys, "delta")

    def clear(self, func: Any = None) -> None:
        """Forget the recorded rows of ``func`` (default: all); functions stay registered."""
        self._records.clear(None if func is None else self._codes(func))
