"""``memlab run``: run a script or module under the line profiler and print its table, like
``kernprof``.

Profiles the functions decorated with ``@memlab.profile`` and those named with ``-f``. A named
function is registered as soon as it exists: functions the program defines before it runs (by
code object), ``module:qualname`` when ``module`` is imported, a name the program imports with
``from module import name`` at that import.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from memlab._arguments import (
    BY_MODULE_OPTION,
    COLUMN_OPTION,
    FUNCTION_OPTION,
    GPU_OPTION,
    NO_DEFAULT_COLUMNS_OPTION,
    OUTPUT_OPTION,
    PLOT_OPTION,
    SNAPSHOT_OPTION,
    check_plot_path,
    check_snapshot_path,
    check_table_path,
    columns_shown,
)
from memlab._devices import cuda_device_exists
from memlab._function_lookup import FunctionWatch
from memlab._outputs import write_text
from memlab.commands._command import CommandError
from memlab.commands._program import MainProgram
from memlab.commands._ranks import gather_ranks, rank_environment, write_merged
from memlab.commands._signals import os_exit_reported, signals_raised
from memlab.history.recording import collect_unwritten, snapshot_recorded
from memlab.line_profiler import DEFAULT_COLUMNS, LineProfiler, global_line_profiler
from memlab.line_profiler.workers import worker_calls_lines
from memlab.oom import explain_oom
from memlab.sources.select import check_target, measured_device
from memlab.sources.tracker import TensorTracker

__all__ = ["RunCommand", "profile_program"]


def _output_format(path: str | None) -> str | None:
    """The ending of ``-o`` (``.txt``, ``.json`` or ``.csv``), checked before anything runs."""
    if path is None:
        return None
    try:
        check_table_path(path)
    except (TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    return os.path.splitext(path)[1].lower()


def _check_paths(snapshot: str | None, plot: str | None) -> None:
    try:
        if snapshot is not None:
            check_snapshot_path(snapshot)
        if plot is not None:
            check_plot_path(plot)
    except (TypeError, ValueError) as error:
        raise CommandError(str(error)) from None


def _print_and_write(
    profiler: LineProfiler, shown: list[Any], columns: Sequence[str], output: str | None
) -> list[str]:
    """Print the table of ``shown`` to stdout and write it to ``output`` in its format; return
    what could not be written (``["-o FILE: why"]``), the table printed all the same."""
    stats = profiler.display(shown, columns)
    sys.stdout.write(repr(stats))
    sys.stdout.flush()
    extension = _output_format(output)
    try:
        if extension == ".txt":
            write_text(output, repr(stats))  # type: ignore[arg-type]
        elif extension == ".json":
            profiler.to_json(output, shown, columns)
        elif extension == ".csv":
            profiler.to_csv(output, shown, columns)
    except (OSError, ValueError) as error:
        return [f"-o {output}: {error}"]
    return []


def _report_unwritten(unwritten: list[str], status: int) -> int:
    """Say on stderr which files could not be written (after the table, which is printed all the
    same) and return the exit status: the program's, or 1 when it succeeded but a file is missing."""
    for what in unwritten:
        print(f"memlab run: could not write {what}", file=sys.stderr)
    return 1 if unwritten and status == 0 else status


def _program_tracker(
    profiler: LineProfiler,
    snapshot: str | None = None,
    plot: str | None = None,
    unwritten: list[str] | None = None,
    by_module: bool = False,
) -> tuple[contextlib.AbstractContextManager[Any], TensorTracker]:
    """A :class:`memlab.TensorTracker` for the whole program when ``profiler`` would measure through
    one (its target is not a CUDA GPU present here) or ``by_module`` asks for memory per module
    (the tracker then records every model the program calls), else nothing: the profiler uses
    the tracker entered, which has seen every tensor since the program's first line. Returns the
    context to run the program in and the tracker.

    With ``snapshot`` (a path), the memory snapshot of the run is written there at the end: the
    tracker's (entered even when the profiler measures otherwise, with ``history`` on), or on a
    CUDA GPU PyTorch's own, recorded for the run. With ``plot`` (a path), its plot
    (:func:`memlab.plot_memory`) is written there too. A file that cannot be written is added to
    ``unwritten`` as ``"--snapshot FILE: why"`` (without ``unwritten``: raised).
    """
    device, _ = measured_device(profiler.target_gpu)
    recording = snapshot is not None or plot is not None
    tracker = TensorTracker(history=recording, modules=True if by_module else None)
    tracker.counted_from = "the program's first line"
    if recording:
        on_error = None if unwritten is None else collect_unwritten(unwritten, snapshot, plot)
        recorded = snapshot_recorded(snapshot, device, tracker, plot, on_error=on_error)
        if by_module and cuda_device_exists(device):  # PyTorch records the snapshot; the tracker the modules
            return _both(tracker, recorded), tracker
        return recorded, tracker
    if by_module or (profiler.source in (None, "auto", "tracker") and not cuda_device_exists(device)):
        return tracker, tracker
    return contextlib.nullcontext(), tracker


@contextlib.contextmanager
def _both(*contexts: contextlib.AbstractContextManager[Any]) -> Any:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def profile_program(
    program: MainProgram,
    functions: Sequence[str] = (),
    columns: Sequence[str] = DEFAULT_COLUMNS,
    target: int | str | torch.device | None = None,
    output: str | None = None,
    snapshot: str | None = None,
    plot: str | None = None,
    gather: bool = False,
    by_module: bool = False,
) -> int:
    """Run ``program`` with ``@memlab.profile`` functions and ``functions`` profiled, print their
    table to stdout (also when the program raises or exits) and return the program's exit status.

    The table has ``columns`` (checked by the caller); ``output`` (``.txt``, ``.json``, ``.csv``)
    receives the same table. The numbers are those of :class:`memlab.LineProfiler` on ``target``
    (default 0: the GPU, or without one the default device through a tensor tracker modelling the
    CUDA caching allocator and the cuBLAS workspaces of the GPU it models, which cannot see cuDNN
    workspaces, the CUDA context or memory allocated outside PyTorch). That tracker is entered
    before the program's first line, so every tensor the program creates counts, also those
    created before a profiled function first runs.
    ``snapshot`` (a ``.pickle`` path) receives the memory snapshot of the run, also when the
    program raises or exits (see :func:`memlab.history.recording.snapshot_written`); an
    out-of-memory error is explained on stderr (:func:`memlab.explain_oom`); ``plot``
    (``.png``, ``.svg``, ``.pdf``) its plot (:func:`memlab.plot_memory`). A name that never
    appears is a :class:`CommandError` after the run. Every output path is checked before the
    program runs (a :class:`CommandError`); a file that still cannot be written at the end (a
    full disk) is named on stderr after the table, which is printed all the same, and the status
    is then 1 if the program succeeded.
    With ``functions``, tracing is on for the whole run (the way ``kernprof`` does it), so every
    new frame pays for a trace-function call; with decorators only, only while they run.

    Ends that do not return (:mod:`memlab.commands._signals`): SIGTERM and SIGHUP (a cluster's
    time limit or preemption) stop the program as Ctrl-C does, then everything above is printed
    and written, and the status is 143 / 129 (a handler the program installs itself runs
    instead); ``os._exit(n)`` in the program's main thread first writes it all, then exits with
    ``n``. Calls of ``@memlab.profile`` functions in DataLoader workers are one line after the
    tables (:mod:`memlab.line_profiler.workers`).

    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) each rank writes its own files, the rank
    in their names (``out.rank1.json``), and measures ``cuda:LOCAL_RANK`` by default where there
    are GPUs; with ``gather``, rank 0 also prints the table merged across ranks
    (:func:`memlab.distributed.gather`) and writes it to ``output`` itself.

    ``by_module``: also print the memory per module of every model the program calls
    (:meth:`memlab.TensorTracker.by_module`, highest peak first), measured by the program's
    tracker (also on a GPU, where it models the allocator), after the table.
    """
    _output_format(output)
    _check_paths(snapshot, plot)
    ranks = rank_environment()
    if gather and ranks is None:
        raise CommandError("--gather merges the ranks of a torchrun job, but RANK and WORLD_SIZE are not set")
    merged_output = output
    if ranks is not None:
        output, snapshot, plot = ranks.path(output), ranks.path(snapshot), ranks.path(plot)
        if target is None and torch.cuda.is_available():
            target = ranks.local_rank
    profiler = global_line_profiler()
    previous_target = profiler.target_gpu
    try:
        if target is not None:
            profiler.target_gpu = target
    except (TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    profiler.add_columns(columns)
    decorated = set(profiler.at_exit)
    try:
        watch = FunctionWatch(
            functions,
            profiler,
            program.codes,
            program.globals,
            own_modules=("__main__", program.module_name or "__main__"),
            program=program.name,
        )
    except ValueError as error:
        raise CommandError(str(error)) from None
    unwritten: list[str] = []
    context, tracker = _program_tracker(profiler, snapshot, plot, unwritten, by_module)

    def shown_functions() -> list[Any]:
        profiler.target_gpu = previous_target
        watch.look_up()  # a name bound late (by a function's `global`): found, not called while profiled
        shown = watch.functions() + [f for f in profiler.at_exit if f not in decorated]
        for function in shown:
            profiler.at_exit.pop(function, None)  # printed here, not again at exit
        return shown

    def report(status: int) -> int:
        shown = shown_functions()
        return _report(
            profiler,
            tracker,
            watch,
            shown,
            status,
            columns,
            output,
            merged_output,
            ranks,
            unwritten,
            gather,
            by_module,
        )

    def before_main() -> None:  # every definition above the main guard has run: say what is missing
        for message in watch.undefined_now(program.may_bind):
            sys.stdout.flush()  # the program's output so far comes first
            print(
                f"memlab run: error: {message}; the program runs on without it", file=sys.stderr, flush=True
            )

    stack = contextlib.ExitStack()

    def report_before_os_exit(code: int) -> None:
        stack.close()  # exits the tracker: its snapshot and plot are written
        try:
            report(code)
        except CommandError as error:
            print(f"memlab run: error: {error}", file=sys.stderr)

    try:
        with stack:
            stack.enter_context(watch.watching_imports())
            stack.enter_context(context)
            stack.enter_context(explain_oom())
            if functions:
                stack.enter_context(profiler)
            with os_exit_reported(report_before_os_exit), signals_raised():
                status = program.run(before_main)
    except BaseException:
        shown_functions()
        raise
    return report(status)


def _report(
    profiler: LineProfiler,
    tracker: TensorTracker,
    watch: FunctionWatch,
    shown: list[Any],
    status: int,
    columns: Sequence[str],
    output: str | None,
    merged_output: str | None,
    ranks: Any,
    unwritten: list[str],
    gather: bool,
    by_module: bool,
) -> int:
    """Print and write what :func:`profile_program` reports once the program ended with
    ``status`` (the tables of ``shown``, files, what is missing), and return the status
    ``memlab run`` exits with."""
    if shown:
        if ranks is not None:
            print(f"memlab run: rank {ranks.rank} of {ranks.world_size}", flush=True)
        unwritten += _print_and_write(profiler, shown, columns, output)
    if by_module:
        sys.stdout.write(("\n" if shown else "") + tracker.module_table().text())
        sys.stdout.flush()
    for line in worker_calls_lines():  # @memlab.profile calls in DataLoader workers: not collected
        sys.stdout.write(f"\n{line}\n")
        sys.stdout.flush()
    if gather:
        merged = gather_ranks(profiler, shown, status)
        if merged is not None:
            sys.stdout.write(merged.render())
            sys.stdout.flush()
            if merged_output is not None:
                try:
                    write_merged(merged, merged_output)
                except OSError as error:
                    unwritten.append(f"-o {merged_output}: {error}")
    status = _report_unwritten(unwritten, status)
    sys.stdout.flush()  # the program's own output comes before a -f error on stderr
    try:
        watch.check()
    except ValueError as error:
        if not status:
            raise CommandError(str(error)) from None
        print(f"memlab run: {error}", file=sys.stderr)  # the program's own failure comes first
        return status
    if not shown and not by_module:
        print(
            "memlab run: nothing was profiled: decorate functions with @memlab.profile or name them with -f",
            file=sys.stderr,
        )
    return status


class RunCommand:
    """``memlab run [-f FUNC]... [-c COL]... [-D] [-g DEVICE] [-o FILE] [--snapshot FILE]
    [--plot FILE] [--gather] [--by-module] script.py [args...]``."""

    help = "run a script (or -m module) and print the memory of its profiled functions, line by line"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = (
            "%(prog)s [-f FUNC]... [-c COL]... [-D] [-g DEVICE] [-o FILE] [--snapshot FILE] [--plot FILE] "
            "[--gather] [--by-module] (script.py | -m module) [args...]"
        )
        parser.description = (
            "Run a Python script as __main__ with its own arguments, like kernprof, and print the "
            "memory of functions decorated with @memlab.profile or named with -f, line by line, at "
            "the end (also when the script raises or exits). Exits with the script's status. "
            "memlab's options go before the script (or -m module): everything after it is the "
            "script's own arguments, as with python."
        )
        parser.epilog = (
            "Each row covers the time from the start of a line to the start of the next line of the "
            "same call; peak columns are the highest value in it, in bytes (40.00K = 40 KiB); calls "
            "made on a line count inside it. Without a GPU a tensor tracker, entered before the "
            "script's first line, replays its tensors through a model of the CUDA caching allocator: "
            "what a GPU would show, cuBLAS workspaces included, except what a tracker cannot see (cuDNN "
            "workspaces, the CUDA context, memory allocated outside PyTorch)."
        )
        parser.add_argument("-f", "--function", **FUNCTION_OPTION)
        parser.add_argument("-c", "--column", **COLUMN_OPTION)
        parser.add_argument("-D", "--no-default-columns", **NO_DEFAULT_COLUMNS_OPTION)
        parser.add_argument("-g", "--gpu", **GPU_OPTION)
        parser.add_argument("-o", "--output", **OUTPUT_OPTION)
        parser.add_argument("--snapshot", **SNAPSHOT_OPTION)
        parser.add_argument("--plot", **PLOT_OPTION)
        parser.add_argument(
            "--gather",
            action="store_true",
            help="under torchrun: also print on rank 0 the table merged across ranks (each rank's values, "
            "max, min, skew) and write it to -o FILE; each rank's own files get .rankN in their names",
        )
        parser.add_argument("--by-module", **BY_MODULE_OPTION)
        parser.add_argument(
            "-m", dest="as_module", action="store_true", help="run a module, like python -m (the last option)"
        )
        parser.add_argument(
            "script", nargs="?", help="the script to run (with -m: the module), after memlab's options"
        )
        parser.add_argument(
            "args", nargs=argparse.REMAINDER, help="the script's own arguments: everything after the script"
        )

    def run(self, args: argparse.Namespace) -> int:
        try:
            columns = columns_shown(args.no_default_columns, args.column)
        except ValueError as error:
            raise CommandError(str(error)) from None
        _output_format(args.output)
        _check_paths(args.snapshot, args.plot)
        if args.script is None:
            raise CommandError("name a script to run (memlab run script.py [args...]) or -m module")
        try:
            program = MainProgram(args.script, args.args, as_module=args.as_module)
        except SyntaxError as error:
            traceback.print_exception(type(error), error, None)
            return 1
        try:
            target = None if args.gpu is None else check_target(args.gpu, name="-g")
        except ValueError as error:
            raise CommandError(str(error)) from None
        return profile_program(
            program,
            args.function,
            columns,
            target,
            args.output,
            args.snapshot,
            args.plot,
            args.gather,
            args.by_module,
        )
