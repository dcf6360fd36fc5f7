"""IPython magics: ``%mlrun`` / ``%%mlrun`` (line-by-line memory of named functions) and
``%memreport`` (every tensor ``gc`` can reach). Load with ``%load_ext memlab``.

A thin shell over the public API: :class:`memlab.LineProfiler` measures, its ``display()``
renders (HTML in a notebook, text in a terminal), :class:`memlab.MemReporter` reports.
"""

from __future__ import annotations

import ast
import contextlib
import shlex
import sys
import types
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, needs_local_scope
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from memlab._arguments import (
    BY_MODULE_OPTION,
    COLUMN_OPTION,
    FUNCTION_OPTION,
    GPU_OPTION,
    NO_DEFAULT_COLUMNS_OPTION,
    PLOT_OPTION,
    SNAPSHOT_OPTION,
    check_plot_path,
    check_snapshot_path,
    columns_shown,
)
from memlab._devices import cuda_device_exists, parse_device, require_usable
from memlab._function_lookup import MISSING, FunctionName, FunctionWatch, lookup
from memlab._outputs import check_output_path, write_text
from memlab.history.recording import collect_unwritten, snapshot_recorded
from memlab.line_profiler import LineProfiler
from memlab.reporter import MemReporter
from memlab.sources.select import check_target, measured_device
from memlab.sources.tracker import TensorTracker

__all__ = ["MemlabMagics", "load_ipython_extension"]

# Options of %mlrun that take a value: everything after the options is the statement, verbatim.
_VALUE_OPTIONS = frozenset(
    {"-f", "--function", "-c", "--column", "-g", "--gpu", "-T", "--dump-profile", "--snapshot", "--plot"}
)
_SHORT_VALUE_OPTIONS = frozenset("fcgT")


def split_statement(line: str) -> tuple[str, str]:
    """Split a ``%mlrun`` line into its options and the statement that follows them, verbatim.

    Options end at the first word that is neither an option nor an option's value, or at ``--``.
    ``ValueError`` when a quote in the options (``-f "train step``) is never closed; a quote left open
    in the statement is the statement's own (Python reads it, not shlex).
    """
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    stream = lexer.instream
    expect_value = False
    while True:
        start = stream.tell()
        try:
            token = lexer.get_token()
        except ValueError:  # an unbalanced quote: in an option or its value, or in the statement
            if expect_value or line[start:].lstrip().startswith("-"):
                raise ValueError(_unbalanced("%mlrun", line, "options")) from None
            return line[:start], line[start:].strip()
        if token is None:
            return line, ""
        if expect_value:
            expect_value = False
        elif token == "--":
            return line[:start], line[stream.tell() :].strip()
        elif not token.startswith("-") or token == "-":
            return line[:start], line[start:].strip()
        elif token in _VALUE_OPTIONS:
            expect_value = True
        elif not token.startswith("--"):
            for i, flag in enumerate(token[1:], 1):
                if flag in _SHORT_VALUE_OPTIONS:
                    expect_value = i == len(token) - 1
                    break


def _unbalanced(magic: str, line: str, where: str) -> str:
    """The message for a quote that ``line`` opens and never closes, or for a backslash that ends it:
    what shlex cannot read."""
    quote, escaped = "", False
    for char in line:
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif not quote and char in "'\"":
            quote = char
        elif char == quote:
            quote = ""
    if not quote:  # shlex's other error: a backslash that ends the line
        return f"{magic} {line.strip()}: the \\ that ends the {where} escapes nothing; remove it"
    return f"{magic} {line.strip()}: unbalanced quote ({quote}) in the {where}; close it or remove it"


def _parse(magic: Any, name: str, line: str) -> Any:
    """``parse_argstring`` with an unclosed quote as a ``UsageError`` (IPython's is a ValueError)."""
    try:
        return parse_argstring(magic, line)
    except ValueError:
        raise UsageError(_unbalanced(name, line, "arguments")) from None


def _bound_names(node: ast.AST) -> set[str]:
    """Names a top-level statement binds in the namespace (not inside functions or classes)."""
    names: set[str] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(current.name)
            todo.extend(current.decorator_list)
            continue
        if isinstance(current, ast.Lambda):
            continue
        if isinstance(current, ast.Name) and isinstance(current.ctx, (ast.Store, ast.Del)):
            names.add(current.id)
        elif isinstance(current, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in current.names)
        todo.extend(ast.iter_child_nodes(current))
    return names


class _Cell:
    """Code typed in IPython, compiled one top-level statement at a time (as IPython runs cells),
    with its source cached so that profiled functions defined in it show their lines."""

    def __init__(self, shell: Any, source: str) -> None:
        transformed = shell.transform_cell(source)
        filename = shell.compile.cache(transformed, shell.execution_count, raw_code=source)
        tree = shell.transform_ast(shell.compile.ast_parse(transformed, filename=filename))
        self.statements = [
            (shell.compile(ast.Module([node], []), filename, "exec"), _bound_names(node))
            for node in tree.body
        ]
        self.bound = set().union(*(bound for _, bound in self.statements))

    def codes(self) -> list[types.CodeType]:
        """The compiled statements, in order."""
        return [code for code, _ in self.statements]


def _namespace(user_ns: dict[str, Any], local_ns: dict[str, Any] | None) -> Mapping[str, Any]:
    """Where names are looked up: the magic's local scope, then the user namespace."""
    if local_ns is None or local_ns is user_ns:
        return user_ns
    return ChainMap(local_ns, user_ns)


@magics_class
class MemlabMagics(Magics):
    """``%mlrun``, ``%%mlrun`` and ``%memreport``."""

    @magic_arguments()
    @argument("-f", "--function", **FUNCTION_OPTION)
    @argument("-c", "--column", **COLUMN_OPTION)
    @argument("-D", "--no_default_columns", **NO_DEFAULT_COLUMNS_OPTION)
    @argument("-r", "--return-profiler", action="store_true", help="return the LineProfiler")
    @argument("-g", "--gpu", **GPU_OPTION, default="0")
    @argument("-q", "--quiet", action="store_true", help="show nothing and return nothing (unless -r)")
    @argument("-T", "--dump-profile", metavar="FILE", help="also write the table shown, as text, to FILE")
    @argument("--snapshot", **SNAPSHOT_OPTION)
    @argument("--plot", **PLOT_OPTION)
    @argument("--by-module", **BY_MODULE_OPTION)
    @argument("statement", nargs="*", help="code to run (line magic); in cell magic, the cell")
    @line_cell_magic
    @needs_local_scope
    def mlrun(self, line: str = "", cell: str | None = None, local_ns: dict[str, Any] | None = None) -> Any:
        """Run a statement (``%mlrun``) or a cell (``%%mlrun``) and show the memory of the
        functions named with ``-f``, line by line.

        Each row is the interval from the start of a line to the start of the next line of the
        same call: ``*.peak`` columns are the highest value in it, in bytes (``40.00K``), as
        measured by :class:`memlab.LineProfiler`; calls made on a line count inside it. Without a
        GPU the numbers come from a :class:`memlab.TensorTracker` replaying the code's tensor
        allocations through a model of the CUDA caching allocator: what a GPU would show, minus
        what a tracker cannot see (cuDNN workspaces, the CUDA context, memory allocated outside
        PyTorch). Tensors made by earlier cells count, as on a GPU: the tracker adopts what ``gc``
        can reach when the magic starts, and the table's first line says how much.
        ``--snapshot FILE`` writes the memory snapshot of the code (also when it raises) for
        ``memlab viz`` and PyTorch's viewer: the tracker's, with the Python line of each
        allocation, or on a CUDA GPU PyTorch's own, recorded while the code runs.
        Returns the table (HTML in a notebook, text in a terminal); with ``-r`` shows
        it and returns the profiler. If the code raises, the table so far is shown first.
        ``--by-module`` also shows the memory per module of every model the code calls
        (:meth:`memlab.TensorTracker.by_module`, highest peak first; ``-f`` is then optional),
        measured by a tracker that adopts what ``gc`` can reach when the magic starts.
        """
        try:
            options, statement = split_statement(line)
        except ValueError as error:
            raise UsageError(str(error)) from None
        args = _parse(self.mlrun, "%mlrun", options)
        if cell is not None:
            if statement:
                raise UsageError(f"%%mlrun takes only options on its first line, got {statement!r}")
            statement = cell
        if not statement.strip():
            raise UsageError(
                "no statement to run: write %mlrun -f FUNC statement, or %%mlrun -f FUNC over a cell"
            )
        if not args.function and not args.by_module:
            raise UsageError(
                "name the functions to profile with -f FUNC (name, Class.method or module:qualname), or "
                "show the memory per module with --by-module"
            )
        try:
            columns = columns_shown(args.no_default_columns, args.column)
        except ValueError as error:
            raise UsageError(str(error)) from None
        try:
            profiler = LineProfiler(target_gpu=check_target(args.gpu, name="-g"), columns=columns)
            if args.snapshot is not None:
                check_snapshot_path(args.snapshot)
            if args.plot is not None:
                check_plot_path(args.plot)
            if args.dump_profile is not None:
                check_output_path(args.dump_profile, "-T")
        except (TypeError, ValueError) as error:
            raise UsageError(str(error)) from None
        namespace = _namespace(self.shell.user_ns, local_ns)
        code = _Cell(self.shell, statement)
        try:
            watch = FunctionWatch(
                args.function, profiler, code.codes(), namespace, bound=code.bound, import_modules=True
            )
        except ValueError as error:
            raise UsageError(str(error)) from None
        recording = contextlib.ExitStack()
        unwritten: list[str] = []
        tracker = None
        snapshot = args.snapshot is not None or args.plot is not None
        if snapshot or args.by_module:
            device, _ = measured_device(profiler.target_gpu)
            tracker = TensorTracker(adopt=True, history=snapshot, modules=True if args.by_module else None)
            if args.by_module and (not snapshot or cuda_device_exists(device)):
                recording.enter_context(tracker)  # else snapshot_recorded enters it
            if snapshot:
                on_error = collect_unwritten(unwritten, args.snapshot, args.plot)
                recording.enter_context(
                    snapshot_recorded(args.snapshot, device, tracker, args.plot, on_error=on_error)
                )
        try:
            with recording, profiler if args.function else contextlib.nullcontext():
                for statement_code, bound in code.statements:
                    exec(statement_code, self.shell.user_ns, local_ns)
                    watch.look_up(rebound=bound)
        except BaseException:
            with contextlib.suppress(Exception):  # the code's own error matters more than the table
                self._show(profiler, watch.functions(), columns, args, unwritten=unwritten)
                self._show_modules(tracker, args)
            raise
        try:
            functions = watch.check()
        except ValueError as error:
            raise UsageError(str(error)) from None
        stats = self._show(
            profiler, functions, columns, args, returned=not args.return_profiler, unwritten=unwritten
        )
        self._show_modules(tracker, args)
        if args.return_profiler:
            return profiler
        return stats

    def _show(
        self,
        lp: LineProfiler,
        functions: list[Any],
        columns: tuple[str, ...],
        args: Any,
        returned: bool = False,
        unwritten: list[str] | None = None,
    ) -> Any:
        """Write ``-T``, then display the table unless quiet; return it instead when ``returned``.
        Files that could not be written (``unwritten``, and ``-T`` itself) are named on stderr;
        the table is shown all the same."""
        unwritten = [] if unwritten is None else unwritten
        stats = lp.display(functions, columns) if functions else None
        if args.dump_profile and stats is not None:
            try:
                write_text(args.dump_profile, repr(stats))
            except OSError as error:  # checked before the code ran: a full disk, a folder gone
                unwritten.append(f"-T {args.dump_profile}: {error}")
        for what in unwritten:
            print(f"memlab: could not write {what}", file=sys.stderr)
        unwritten.clear()
        if stats is None or args.quiet:
            return None
        if returned:
            return stats
        display(stats)
        return None

    def _show_modules(self, tracker: TensorTracker | None, args: Any) -> None:
        """Display the memory per module with ``--by-module`` (unless quiet)."""
        if tracker is not None and args.by_module and not args.quiet:
            display(tracker.module_table())

    @magic_arguments()
    @argument("-v", "--verbose", action="store_true", help="Also list tensors sharing a storage.")
    @argument("-d", "--device", metavar="DEVICE", help="Only this device (cpu, cuda, cuda:1, meta).")
    @argument(
        "model", metavar="MODEL", nargs="?", help="A torch.nn.Module in the namespace, naming its tensors."
    )
    @line_magic
    @needs_local_scope
    def memreport(self, line: str = "", local_ns: dict[str, Any] | None = None) -> None:
        """Print every tensor ``gc`` can reach, per device, each storage counted once.

        A thin shell over :class:`memlab.MemReporter`: ``MODEL`` names parameters, buffers and
        gradients; optimizers in the namespace name their state (``AdamW.weight.exp_avg``).
        Sizes are storage bytes (``nbytes``; on CUDA rounded to the allocator's 512 B blocks).
        Not visible: autograd's saved tensors, C++-held buffers, the allocator's cache.
        """
        args = _parse(self.memreport, "%memreport", line)
        namespace = _namespace(self.shell.user_ns, local_ns)
        model = None
        if args.model:
            if not all(part.isidentifier() for part in args.model.split(".")):
                raise UsageError(f"MODEL {args.model!r} is not a name; write model or model.submodule")
            model = lookup(FunctionName(args.model, None, args.model), namespace)
            if model is MISSING:
                raise UsageError(f"MODEL {args.model!r}: no such name in the namespace")
            if not isinstance(model, torch.nn.Module):
                raise UsageError(f"MODEL {args.model!r} is not a torch.nn.Module but {type(model).__name__}")
        reporter = MemReporter(model)
        for value in list(namespace.values()):
            if isinstance(value, torch.optim.Optimizer):
                reporter.add_optimizer(value)
        try:
            device = (
                None
                if args.device is None
                else require_usable(parse_device(args.device, name="-d"), name="-d")
            )
        except ValueError as error:
            raise UsageError(str(error)) from None
        reporter.report(verbose=args.verbose, device=device)


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%mlrun``, ``%%mlrun`` and ``%memreport`` (``%load_ext memlab``); ``TypeError``
    unless ``ipython`` is an IPython shell (``get_ipython()``)."""
    if not callable(getattr(ipython, "register_magics", None)):
        raise TypeError(
            "ipython must be the IPython shell (get_ipython(), or what %load_ext memlab passes), got "
            f"{type(ipython).__name__} {ipython!r:.80}"
        )
    ipython.register_magics(MemlabMagics)
