"""A Python script or module run as ``__main__``, the way ``python script.py`` / ``python -m`` would.

The code is compiled before it runs, so the functions it defines can be registered with a
profiler by code object before they exist; it runs in a fresh ``__main__`` module with its own
``sys.argv``, and its exit status is computed the way the interpreter computes it. A program with an
``if __name__ == "__main__":`` guard runs in two parts (:mod:`memlab.commands._main_guard`), so
that a caller can act once its definitions have run and before its main work.
"""

from __future__ import annotations

import builtins
import importlib.util
import linecache
import os
import sys
import traceback
import types
from collections.abc import Callable, Sequence

from memlab.commands._command import CommandError
from memlab.commands._main_guard import split_at_main_guard
from memlab.commands._signals import Terminated

__all__ = ["MainProgram"]


class MainProgram:
    """``target`` (a script path, or a module name when ``as_module``) with arguments ``args``.

    Raises :class:`CommandError` when the script does not exist, is a directory or cannot be read,
    or the module cannot be found. A script is any file python would run: a regular file,
    ``/dev/null`` (an empty script), a pipe.

    ``codes`` are the code objects run one after the other: the whole program, or the part above
    its main guard and the part from the guard on; ``may_bind`` the names the part from the guard on
    may still bind in the module (``None``: any name, or no guard); ``name`` the program as the
    user named it (``train.py``, ``module pkg.train``).
    """

    def __init__(self, target: str, args: Sequence[str], as_module: bool = False) -> None:
        self.module_name = target if as_module else None
        self.name = f"module {target}" if as_module else target
        source: str | bytes | None
        self.module = types.ModuleType("__main__")
        self.globals = self.module.__dict__
        self.globals["__builtins__"] = builtins
        if as_module:
            self.code, path, spec = _module_code(target)
            try:
                source = spec.loader.get_source(spec.name)  # type: ignore[union-attr]
            except (ImportError, OSError):
                source = None
            self.globals.update(__file__=path, __spec__=spec, __loader__=spec.loader, __package__=spec.parent)
            self.path_entry = os.getcwd()
        else:
            if os.path.isdir(target):
                raise CommandError(
                    f"{target!r} is a directory, not a script: name a .py file in it, or run a package "
                    "with -m package"
                )
            if not os.path.exists(target):
                raise CommandError(f"no such script: {target!r}")
            try:  # any file python reads: /dev/null, a pipe (<(...), /dev/stdin)
                with open(target, "rb") as file:
                    source = file.read()
            except OSError as error:
                raise CommandError(f"cannot read script {target!r}: {error.strerror or error}") from None
            path = os.path.abspath(target)
            self.code = compile(source, path, "exec", dont_inherit=True)
            if not os.path.isfile(target):  # a pipe cannot be read twice: keep its lines for the table
                text = source.decode("utf-8", "replace")
                linecache.cache[path] = (len(text), None, text.splitlines(keepends=True), path)
            self.globals.update(__file__=path, __spec__=None, __loader__=None, __package__=None)
            self.path_entry = os.path.dirname(path)
        self.argv = [path if as_module else target, *args]  # as python sets sys.argv[0]
        try:
            split = None if source is None else split_at_main_guard(source, self.code.co_filename)
        except (SyntaxError, ValueError):  # a module's source that is not what its code was built from
            split = None
        self.codes = [self.code] if split is None else [split.top, split.main]
        self.may_bind = None if split is None else split.may_bind

    def run(self, before_main: Callable[[], None] | None = None) -> int:
        """Run the program and return its exit status: 0, the ``sys.exit`` code, 1 after an
        uncaught exception (its traceback printed to stderr), 130 after ``KeyboardInterrupt``,
        ``128 + signum`` after :class:`~memlab.commands._signals.Terminated` (SIGTERM: 143,
        SIGHUP: 129; one line on stderr says where the program was). ``before_main`` is called
        when the program reaches its main guard, every definition above it run (never without
        a guard)."""
        module = self.module
        saved = sys.argv, sys.path[:], sys.modules.get("__main__")
        sys.argv = list(self.argv)
        sys.path.insert(0, self.path_entry)
        sys.modules["__main__"] = module
        try:
            for part, code in enumerate(self.codes):
                if part and before_main is not None:
                    before_main()
                exec(code, module.__dict__)
        except SystemExit as exit:
            return _exit_status(exit.code)
        except Terminated as terminated:  # SIGTERM or SIGHUP (memlab.commands._signals)
            print(f"memlab run: {terminated} {terminated.where}: the program stopped there", file=sys.stderr)
            return terminated.status
        except BaseException as error:  # the program's own failure: report it as Python would
            traceback.print_exception(
                type(error), error, error.__traceback__.tb_next if error.__traceback__ else None
            )
            return 130 if isinstance(error, KeyboardInterrupt) else 1
        finally:
            sys.argv, sys.path[:] = saved[0], saved[1]
            if saved[2] is not None:
                sys.modules["__main__"] = saved[2]
        return 0


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives a process: None is 0, ints as they are, anything else
    is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _module_code(name: str) -> tuple[types.CodeType, str, importlib.machinery.ModuleSpec]:
    """(code, file, spec) of module ``name``; a package runs its ``__main__`` submodule."""
    sys.path.insert(0, os.getcwd())  # as python -m: the current directory comes first
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError) as error:
        raise CommandError(f"cannot find module {name!r}: {error}") from None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
        raise CommandError(f"no module named {name!r}")
    code = spec.loader.get_code(spec.name)
    if code is None:
        raise CommandError(f"module {name!r} has no Python code to run")
    return code, spec.origin or name, spec
