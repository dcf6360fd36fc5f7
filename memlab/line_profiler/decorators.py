"""Decorators over one process-wide profiler: ``@profile``, ``@profile_every`` and their settings.

Decorating only registers code objects: nothing is traced, no CUDA is initialised and nothing is
printed until a decorated function runs. The tracer is installed only while a decorated function
runs, so the rest of the program keeps full speed. ``MEMLAB_PROFILE=0`` turns the decorators into
no-ops that return the function unchanged.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from memlab.line_profiler.profiler import LineProfiler, Target
from memlab.line_profiler.records import DEFAULT_COLUMNS, validate_columns
from memlab.line_profiler.workers import WorkerCalls, in_dataloader_worker, worker_calls_lines

__all__ = [
    "GlobalLineProfiler",
    "clear_global_line_profiler",
    "global_line_profiler",
    "profile",
    "profile_every",
    "set_target_gpu",
]

F = TypeVar("F", bound=Callable[..., Any])
_OFF_VALUES = ("0", "false", "no", "off")


class GlobalLineProfiler(LineProfiler):
    """The decorators' profiler: prints the ``@profile`` functions at exit once any of them ran.

    ``at_exit`` maps each ``@profile`` function to the columns of its exit report; a tool that
    prints a function's table itself (``memlab run``) removes it there. ``leftovers`` maps each
    ``@profile_every`` function to the function that prints its calls not reported yet (called
    at exit, after the ``@profile`` tables).
    """

    def __init__(self) -> None:
        super().__init__()
        self.at_exit: dict[Any, tuple[str, ...]] = {}
        self.leftovers: dict[Any, Callable[[], None]] = {}
        self._exit_registered = False
        self._worker_calls = WorkerCalls()

    def enable_by_count(self) -> None:
        if in_dataloader_worker():  # counted for the parent's report, run unprofiled (see .workers)
            self._worker_calls.count(_called_name(sys._getframe(1)))
            return
        if not self._exit_registered:
            self._exit_registered = True
            atexit.register(self.print_at_exit)
        super().enable_by_count()

    def print_at_exit(self) -> None:
        """Print the statistics of every ``@profile`` function to ``sys.stdout``, then those of the
        ``@profile_every`` calls not reported yet (each group once: printing again prints nothing
        new)."""
        tables = []
        for func, columns in self.at_exit.items():
            stats = self.display(func, columns)
            stats.source = None  # said once, above all tables
            tables.append(repr(stats))
        head = self.source_line()
        sys.stdout.write((f"{head}\n\n" if head and tables else "") + "\n\n".join(tables))
        for print_rest in list(self.leftovers.values()):
            print_rest()


def _called_name(wrapper: Any) -> str:
    """The name of the profiled function whose wrapper is the frame ``wrapper`` (its ``func``)."""
    func = wrapper.f_locals.get("func")
    return getattr(func, "__qualname__", None) or "a @memlab.profile function"


def print_worker_calls() -> None:
    """Print to ``sys.stdout`` the line of each ``@profile`` function whose calls ran in this
    process's DataLoader workers and were not collected (:mod:`memlab.line_profiler.workers`)."""
    for line in worker_calls_lines():
        sys.stdout.write(f"\n{line}\n")


_global: GlobalLineProfiler | None = None
_global_lock = threading.Lock()


def global_line_profiler() -> GlobalLineProfiler:
    """The profiler behind ``@profile`` and ``@profile_every`` (created on first use)."""
    global _global
    with _global_lock:
        if _global is None:
            _global = GlobalLineProfiler()
        return _global


def _profiling_off() -> bool:
    return os.environ.get("MEMLAB_PROFILE", "").strip().lower() in _OFF_VALUES


@overload
def profile(func: F, *, columns: str | Iterable[str] = ...) -> F: ...
@overload
def profile(func: None = None, *, columns: str | Iterable[str] = ...) -> Callable[[F], F]: ...
def profile(func: Any = None, *, columns: str | Iterable[str] = DEFAULT_COLUMNS) -> Any:
    """Profile the memory of ``func`` line by line and print the table when the interpreter exits.

    Use bare (``@memlab.profile``) or with columns (``@memlab.profile(columns=(...))``) on
    functions, methods, generators, coroutines, properties and class/static methods. Numbers are
    those of :class:`memlab.LineProfiler` on the device set by :func:`set_target_gpu` (default 0;
    without a GPU, the default device through a tensor tracker that models the CUDA caching
    allocator). The exit report is registered when a profiled function first runs, and only then.
    With ``MEMLAB_PROFILE=0`` the function is returned unchanged.

    In DataLoader worker processes (``num_workers > 0``, fork or spawn) the function runs
    unprofiled: its calls there are counted, and the process that made the DataLoader prints one
    line at exit after its tables, e.g. ``12 calls of make ran in 2 DataLoader worker processes
    and were not collected`` (:mod:`memlab.line_profiler.workers`).
    """
    columns = validate_columns(columns)
    if func is None:
        return functools.partial(profile, columns=columns)
    if _profiling_off():
        return func
    profiler = global_line_profiler()
    profiler.add_function(func)
    profiler.add_columns(columns)
    profiler.at_exit[func] = columns
    _say_worker_calls_at_exit()
    return profiler.wrap_callable(func)


@functools.cache
def _say_worker_calls_at_exit() -> None:
    """Register :func:`print_worker_calls` at exit, once: it runs after the tables (registered
    later, at the first call) and also when every call ran in workers (none here)."""
    atexit.register(print_worker_calls)


def profile_every(
    output_interval: int = 1, enable: bool = True, columns: str | Iterable[str] = DEFAULT_COLUMNS
) -> Callable[[F], F]:
    """Profile a function line by line and print its statistics every ``output_interval`` calls.

    Each report covers only the calls since the previous one and is headed with their range,
    e.g. ``## step (calls 3-4)``; the calls left over when the interpreter exits (the fifth of
    five with ``output_interval=2``) are printed then, once, as ``## step (call 5)``. A call of a generator
    or coroutine function ends when it is exhausted or awaited. ``enable=False`` (or
    ``MEMLAB_PROFILE=0``) returns the function unchanged, so the decorator can stay in the code.
    Numbers are those of :class:`memlab.LineProfiler`, written to ``sys.stdout`` as it is at the
    time of the report.
    """
    if isinstance(output_interval, bool) or not isinstance(output_interval, int):
        raise TypeError(f"output_interval must be a positive int, got {output_interval!r}")
    if output_interval < 1:
        raise ValueError(f"output_interval must be a positive int, got {output_interval}")
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be True or False, got {type(enable).__name__} {enable!r:.80}")
    columns = validate_columns(columns)

    def decorator(func: F) -> F:
        if not enable or _profiling_off():
            return func
        profiler = global_line_profiler()
        profiler.add_function(func)
        profiler.add_columns(columns)
        profiled = profiler.wrap_callable(func)
        calls = reported = 0

        def print_calls() -> None:
            """Print the calls since the last report, if any (and not cleared), and start a new group."""
            nonlocal reported
            if calls == reported:
                return
            stats = profiler.display(func, columns)
            first, reported = reported + 1, calls
            if not any(table.calls for table in stats.tables):
                return  # clear_global_line_profiler() forgot them
            for table in stats.tables:
                table.name += f" (calls {first}-{calls})" if first != calls else f" (call {calls})"
            sys.stdout.write(repr(stats) + "\n")  # a blank line between consecutive reports
            profiler.clear(func)

        profiler.leftovers[func] = print_calls

        def report() -> None:
            nonlocal calls
            calls += 1
            if calls % output_interval == 0:
                print_calls()

        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def run_generator(*args: Any, **kwargs: Any) -> Any:
                try:
                    return (yield from profiled(*args, **kwargs))
                finally:
                    report()

            return run_generator  # type: ignore[return-value]

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await profiled(*args, **kwargs)
                finally:
                    report()

            return run_async  # type: ignore[return-value]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return profiled(*args, **kwargs)
            finally:
                report()

        return run  # type: ignore[return-value]

    return decorator


def set_target_gpu(gpu_id_or_device: Target) -> None:
    """Choose the device the decorators measure: an ``int`` GPU index, ``"cuda:1"``, ``"cpu"``,
    ``"meta"`` or a ``torch.device``. Callable anywhere, also inside profiled code; it applies
    from the next outermost call of a profiled function. Raises ``TypeError``/``ValueError``
    listing the valid forms for anything else, and ``ValueError`` for a GPU that does not exist
    here (``0``, the default, stands for the default device on a machine without a GPU)."""
    global_line_profiler().target_gpu = gpu_id_or_device


def clear_global_line_profiler() -> None:
    """Forget the statistics recorded by the decorators; decorated functions stay profiled."""
    global_line_profiler().clear()
