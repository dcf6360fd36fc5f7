"""``memlab run``: run a script or module under the line profiler and print its table, like
``kernprof``.

Profiles the functions decorated with ``@memlab.profile`` and those named with ``-f``. A named
function is registered as soon as it exists: functions the program defines before it runs (by
code object), ``module:qualname`` when ``module`` is imported, a name the program imports with
``from module import name`` at that import.
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from memlab._arguments import columns_shown, measured_device
from memlab._function_lookup import MISSING, FunctionName, code_function, codes_named, lookup
from memlab.commands._command import CommandError
from memlab.commands._program import MainProgram
from memlab.line_profiler import DEFAULT_COLUMNS, LineProfiler, global_line_profiler

__all__ = ["FunctionWatch", "RunCommand", "profile_program"]

_OUTPUTS = (".txt", ".json", ".csv")


class FunctionWatch:
    """The functions named with ``-f``, registered with ``profiler`` as soon as they exist.

    Names whose function the program defines are registered by code object before it runs;
    other names are looked up in the program's namespace and in imported modules each time the
    program imports something (``builtins.__import__`` is wrapped while the program runs, if names
    are missing when it starts). A name bound to something without Python code is an error.
    """

    def __init__(self, texts: Sequence[str], program: MainProgram, profiler: LineProfiler) -> None:
        try:
            self.names = [FunctionName.parse(text) for text in texts]
        except ValueError as error:
            raise CommandError(f"-f: {error}") from None
        self.program, self.profiler = program, profiler
        self.found: dict[FunctionName, list[Any]] = {name: [] for name in self.names}
        self.pending: list[FunctionName] = []
        self.errors: list[str] = []
        self._original_import: Any = None
        for name in self.names:
            codes = codes_named(program.code, name.qualname) if self._in_program(name) else []
            for code in codes:
                self._register(name, code_function(code))
            if not codes:
                self.pending.append(name)
        self._look_up(None, ())

    def _in_program(self, name: FunctionName) -> bool:
        return name.module in (None, "__main__", self.program.module_name)

    def _register(self, name: FunctionName, function: Any) -> None:
        try:
            self.profiler.add_function(function)
        except TypeError as error:  # reported after the import that found it, not inside the program
            self.errors.append(f"-f {name.text}: {error}")
            return
        self.found[name].append(function)

    def _look_up(self, namespace: Any, fromlist: Sequence[str], module: Any = None) -> None:
        """Register the pending names that now resolve (``module`` is what an import just returned)."""
        for name in list(self.pending):
            found = MISSING
            if name.module is None or self._in_program(name):
                if module is not None and name.root in fromlist and namespace is self.program.globals:
                    found = lookup(name, {name.root: getattr(module, name.root, MISSING)})
                if found is MISSING:
                    found = lookup(FunctionName(name.text, None, name.qualname), self.program.globals)
            else:
                found = lookup(name)
            if found is not MISSING:
                self.pending.remove(name)
                self._register(name, found)

    def __enter__(self) -> FunctionWatch:
        if self.pending:
            original = self._original_import = builtins.__import__

            def watching_import(
                name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
            ) -> Any:
                module = original(name, globals, locals, fromlist, level)
                if self.pending:
                    self._look_up(globals, fromlist or (), module)
                return module

            builtins.__import__ = watching_import
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._original_import is not None:
            builtins.__import__ = self._original_import
            self._original_import = None

    def functions(self) -> list[Any]:
        """Everything found, in the order named."""
        return [function for found in self.found.values() for function in found]


def _output_format(path: str | None) -> str | None:
    if path is None:
        return None
    extension = os.path.splitext(path)[1].lower()
    if extension not in _OUTPUTS:
        raise CommandError(f"-o {path}: write to a file ending in {', '.join(_OUTPUTS)}")
    return extension


def _print_and_write(
    profiler: LineProfiler, shown: list[Any], columns: Sequence[str], output: str | None
) -> None:
    """Print the table of ``shown`` to stdout and write it to ``output`` in its format."""
    stats = profiler.display(shown, columns)
    sys.stdout.write(repr(stats))
    sys.stdout.flush()
    extension = _output_format(output)
    if extension == ".txt":
        with open(output, "w", encoding="utf-8") as file:  # type: ignore[arg-type]
            file.write(repr(stats))
    elif extension == ".json":
        profiler.to_json(output, shown, columns)
    elif extension == ".csv":
        profiler.to_csv(output, shown, columns)


def profile_program(
    program: MainProgram,
    functions: Sequence[str] = (),
    columns: Sequence[str] = DEFAULT_COLUMNS,
    target: int | str | torch.device | None = None,
    output: str | None = None,
) -> int:
    """Run ``program`` with ``@memlab.profile`` functions and ``functions`` profiled, print their
    table to stdout (also when the program raises or exits) and return the program's exit status.

    The table has ``columns`` (checked by the caller); ``output`` (``.txt``, ``.json``, ``.csv``)
    receives the same table. The numbers are those of :class:`memlab.LineProfiler` on ``target``
    (default 0: the GPU, or without one the default device through a tensor tracker modelling the
    CUDA caching allocator, which cannot see kernel workspaces, the CUDA context or memory
    allocated outside PyTorch). A name that never appears is a :class:`CommandError` after the run.
    With ``functions``, tracing is on for the whole run (the way ``kernprof`` does it), so every
    new frame pays for a trace-function call; with decorators only, only while they run.
    """
    _output_format(output)
    profiler = global_line_profiler()
    previous_target = profiler.target_gpu
    try:
        if target is not None:
            profiler.target_gpu = target
    except (TypeError, ValueError) as error:
        raise CommandError(f"-g {target}: {error}") from None
    profiler.add_columns(columns)
    decorated = set(profiler.at_exit)
    watch = FunctionWatch(functions, program, profiler)
    if watch.errors:
        raise CommandError(watch.errors[0])
    try:
        with watch:
            if functions:
                with profiler:
                    status = program.run()
            else:
                status = program.run()
    finally:
        profiler.target_gpu = previous_target
        shown = watch.functions() + [f for f in profiler.at_exit if f not in decorated]
        for function in shown:
            profiler.at_exit.pop(function, None)  # printed here, not again at exit
    if shown:
        _print_and_write(profiler, shown, columns, output)
    if watch.errors and not status:
        raise CommandError(watch.errors[0])
    if watch.pending:
        missing = watch.pending[0].text
        if status:
            print(f"memlab run: -f {missing}: the function never appeared", file=sys.stderr)
            return status
        raise CommandError(f"-f {missing}: the program never defined or imported a function of that name")
    if not shown:
        print(
            "memlab run: nothing was profiled: decorate functions with @memlab.profile or name them with -f",
            file=sys.stderr,
        )
    return status


class RunCommand:
    """``memlab run [-f FUNC]... [-c COL]... [-D] [-g DEVICE] [-o FILE] script.py [args...]``."""

    help = "run a script (or -m module) and print the memory of its profiled functions, line by line"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Run a Python script as __main__ with its own arguments, like kernprof, and print the "
            "memory of functions decorated with @memlab.profile or named with -f, line by line, at "
            "the end (also when the script raises or exits). Exits with the script's status."
        )
        parser.epilog = (
            "Each row covers the time from the start of a line to the start of the next line of the "
            "same call; peak columns are the highest value in it, in bytes (40.00K = 40 KiB); calls "
            "made on a line count inside it. Without a GPU a tensor tracker replays the script's "
            "tensors through a model of the CUDA caching allocator: what a GPU would show, except what "
            "a tracker cannot see (kernel workspaces, the CUDA context, memory allocated outside "
            "PyTorch)."
        )
        parser.add_argument(
            "-f",
            "--function",
            metavar="FUNC",
            action="append",
            default=[],
            help="a function to profile: name, Class.method or module:qualname; repeat for several",
        )
        parser.add_argument(
            "-c",
            "--column",
            metavar="COL",
            action="append",
            default=[],
            help=f"a statistic to show besides {', '.join(DEFAULT_COLUMNS)}: any key of "
            "torch.cuda.memory_stats(), hits or delta; repeat for several",
        )
        parser.add_argument(
            "-D", "--no-default-columns", action="store_true", help="hide the default columns"
        )
        parser.add_argument(
            "-g",
            "--gpu",
            metavar="DEVICE",
            help="device to measure: a CUDA index or cpu, cuda:1, ... (default 0; without a GPU, the "
            "default device, with the numbers a CUDA GPU would show)",
        )
        parser.add_argument(
            "-o", "--output", metavar="FILE", help="also write the table to FILE (.txt, .json, .csv)"
        )
        parser.add_argument("-m", dest="as_module", action="store_true", help="run a module, like python -m")
        parser.add_argument("script", nargs="?", help="the script to run (with -m: the module)")
        parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")

    def run(self, args: argparse.Namespace) -> int:
        try:
            columns = columns_shown(args.no_default_columns, args.column)
        except ValueError as error:
            raise CommandError(str(error)) from None
        _output_format(args.output)
        if args.script is None:
            raise CommandError("name a script to run (memlab run script.py [args...]) or -m module")
        try:
            program = MainProgram(args.script, args.args, as_module=args.as_module)
        except SyntaxError as error:
            traceback.print_exception(type(error), error, None)
            return 1
        try:
            target = None if args.gpu is None else measured_device(args.gpu, "-g")
        except ValueError as error:
            raise CommandError(str(error)) from None
        return profile_program(program, args.function, columns, target, args.output)
