"""Find the functions a user names for profiling (``name``, ``Class.method``, ``module:qualname``),
in code that has not run yet, in a namespace, or in an imported module, and register them with a
profiler as soon as they exist (:class:`FunctionWatch`).

Shared by the IPython magics and ``memlab run``: both accept names of functions that do not exist
yet when profiling starts (defined later in the same cell, script or an imported module).
"""

from __future__ import annotations

import builtins
import contextlib
import difflib
import importlib
import inspect
import sys
import types
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MISSING", "FunctionName", "FunctionWatch", "code_function", "codes_named", "lookup"]

#: What :func:`lookup` returns for a name that does not resolve (yet).
MISSING: Any = object()

_FORMS = "name, Class.method or module:qualname"
#: (module, fromlist) of an import statement that just ran.
_Import = tuple[Any, Collection[str]]


@dataclass(frozen=True)
class FunctionName:
    """A function name as the user wrote it: ``module`` (``None`` unless ``module:qualname``)
    and the dotted ``qualname`` (``name`` or ``Class.method``)."""

    text: str
    module: str | None
    qualname: str

    @classmethod
    def parse(cls, text: str) -> FunctionName:
        """Check and split ``text``; raises ``ValueError`` naming the accepted forms."""
        module, _, qualname = text.rpartition(":")
        parts = [*(module.split(".") if module else ()), *qualname.split(".")]
        if text.count(":") > 1 or not all(part.isidentifier() for part in parts):
            raise ValueError(f"{text!r} is not a function name; write {_FORMS}")
        return cls(text, module or None, qualname)

    @property
    def root(self) -> str:
        """The first name looked up: the module's top package, or the first part of the qualname."""
        return (self.module or self.qualname).split(".")[0]


def _walk(code: types.CodeType) -> Iterator[types.CodeType]:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _walk(const)


def codes_named(code: types.CodeType, qualname: str) -> list[types.CodeType]:
    """The code objects of functions defined anywhere in ``code`` (a compiled module, script or
    cell) whose qualified name is ``qualname``; if none is, those whose plain name is ``qualname``
    (so ``step`` finds ``main.<locals>.step``). Empty when nothing matches."""
    nested = [c for c in _walk(code) if not c.co_name.startswith("<")]  # no lambdas, comprehensions
    exact = [c for c in nested if getattr(c, "co_qualname", c.co_name) == qualname]
    if exact or "." in qualname:
        return exact
    return [c for c in nested if c.co_name == qualname]


def code_function(code: types.CodeType) -> types.FunctionType:
    """A function object around ``code``, for registering ``code`` with a profiler before the
    function the user will create from it exists (profilers key functions by code object)."""
    closure = tuple(types.CellType() for _ in code.co_freevars)
    return types.FunctionType(code, {}, code.co_name, None, closure)


def _attribute(owner: Any, name: str, last: bool) -> Any:
    """``owner.name`` without running a property or descriptor on the last step when possible."""
    if last:
        try:
            return inspect.getattr_static(owner, name)
        except AttributeError:
            pass
    return getattr(owner, name)


def lookup(name: FunctionName, namespace: Mapping[str, Any] | None = None) -> Any:
    """The object ``name`` refers to now, or :data:`MISSING`.

    ``module:qualname`` is looked up in the already imported module ``module`` (nothing is
    imported here); ``name`` and ``Class.method`` in ``namespace``.
    """
    if name.module is not None:
        owner = sys.modules.get(name.module, MISSING)
        parts = name.qualname.split(".")
    else:
        first, *parts = name.qualname.split(".")
        owner = MISSING if namespace is None else namespace.get(first, MISSING)
    if owner is MISSING:
        return MISSING
    for i, part in enumerate(parts):
        try:
            owner = _attribute(owner, part, i == len(parts) - 1)
        except Exception:
            return MISSING
    return owner


class FunctionWatch:
    """The functions named with ``-f`` (``texts``), registered with ``profiler`` as soon as they exist.

    A name whose function ``codes`` define (compiled code that has not run yet: a script, a module,
    the statements of a cell) is registered at once, by code object; ``module:qualname`` counts as
    such a name when ``module`` is in ``own_modules`` (the code's own module names). Other names
    are looked up in ``namespace`` (``module:qualname``: in the module, imported first when
    ``import_modules``) now, unless ``bound`` holds their first name (the code will bind it), and
    again at each :meth:`look_up` until found, or when their first name is rebound. Raises
    ``ValueError`` for a name that is not ``name``, ``Class.method`` or ``module:qualname`` and for
    something without Python code found now; later ones wait in :attr:`errors` for :meth:`check`.
    ``program`` names the code as the user does (``train.py``): a name it never defines is then
    said with the functions it does define (:meth:`undefined`).
    """

    def __init__(
        self,
        texts: Iterable[str],
        profiler: Any,
        codes: Iterable[types.CodeType] = (),
        namespace: Mapping[str, Any] | None = None,
        *,
        own_modules: Collection[str] = (),
        bound: Collection[str] = (),
        import_modules: bool = False,
        program: str | None = None,
    ) -> None:
        try:
            self.names = [FunctionName.parse(text) for text in texts]
        except ValueError as error:
            raise ValueError(f"-f: {error}") from None
        self.profiler, self.namespace, self.program = profiler, namespace, program
        self.own_modules, self.import_modules = own_modules, import_modules
        self.found: dict[FunctionName, list[Any]] = {name: [] for name in self.names}
        #: One-line messages for things found that cannot be profiled, in the order found.
        self.errors: list[str] = []
        self._waiting: list[FunctionName] = []
        self.codes = codes = list(codes)
        for name in self.names:
            defined = (
                [c for code in codes for c in codes_named(code, name.qualname)] if self._own(name) else []
            )
            for code in defined:
                self._register(name, code_function(code))
            if not defined:
                if name.root not in bound:
                    self._look_up(name, None)
                self._waiting.append(name)
        if self.errors:
            raise ValueError(self.errors[0])

    def _own(self, name: FunctionName) -> bool:
        return name.module is None or name.module in self.own_modules

    def _register(self, name: FunctionName, function: Any) -> None:
        if any(function is known for known in self.found[name]):
            return
        try:
            self.profiler.add_function(function)
        except TypeError:
            self.errors.append(
                f"-f {name.text}: cannot profile a {type(function).__name__}; name a function, method, "
                "property or class defined in Python"
            )
            return
        self.found[name].append(function)

    def _look_up(self, name: FunctionName, imported: _Import | None) -> None:
        """Register what ``name`` refers to now; ``imported`` is (module, fromlist) of an import
        the code just ran in ``namespace`` (``from m import f`` inside a function binds no global)."""
        if self._own(name):
            local = FunctionName(name.text, None, name.qualname)
            found = MISSING
            if imported is not None and local.root in imported[1]:
                found = lookup(local, {local.root: getattr(imported[0], local.root, MISSING)})
            if found is MISSING:
                found = lookup(local, self.namespace)
        else:
            found = lookup(name)
            if found is MISSING and self.import_modules:
                try:
                    importlib.import_module(name.module)  # type: ignore[arg-type]
                except ImportError:
                    return
                found = lookup(name)
        if found is not MISSING:
            self._register(name, found)

    def look_up(
        self, rebound: Collection[str] = (), imported: tuple[Any, Collection[str]] | None = None
    ) -> None:
        """Look up again the names not found yet and those whose first name is in ``rebound``."""
        for name in self._waiting:
            if not self.found[name] or name.root in rebound:
                self._look_up(name, imported)

    @contextlib.contextmanager
    def watching_imports(self) -> Iterator[FunctionWatch]:
        """While inside, :meth:`look_up` after every import (``builtins.__import__`` is wrapped if
        some name is missing on entry), so a name is registered before the imported function runs."""
        if not self.missing():
            yield self
            return
        original = builtins.__import__

        def watching_import(
            name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
        ) -> Any:
            module = original(name, globals, locals, fromlist, level)
            if self.missing():
                self.look_up(imported=(module, fromlist or ()) if globals is self.namespace else None)
            return module

        builtins.__import__ = watching_import
        try:
            yield self
        finally:
            builtins.__import__ = original

    def missing(self) -> list[FunctionName]:
        """The names not found yet, in the order named."""
        return [name for name, found in self.found.items() if not found]

    def functions(self) -> list[Any]:
        """Everything found, in the order named."""
        return [function for found in self.found.values() for function in found]

    def defined(self) -> list[str]:
        """The functions the watched code defines, named as ``-f`` takes them (``Class.method``;
        a nested function by its own name), in the order of the code, each once."""
        names = (
            c.co_name if "<locals>" in getattr(c, "co_qualname", "") else getattr(c, "co_qualname", c.co_name)
            for code in self.codes
            for c in _walk(code)
            if not c.co_name.startswith("<")
        )
        return list(dict.fromkeys(names))

    def undefined(self, name: FunctionName) -> str:
        """The message for ``name``, never defined by the code (of ``program``): the name, then the
        functions the code does define, the closest to it first."""
        program = self.program or "the code"
        defined = self.defined()
        if not defined:
            return (
                f"-f {name.text}: {program} defines no function named {name.qualname}, nor any other function"
            )
        close = difflib.get_close_matches(name.qualname, defined, n=len(defined), cutoff=0.6)
        ordered = [*close, *(d for d in defined if d not in close)]
        return (
            f"-f {name.text}: {program} defines no function named {name.qualname}; "
            f"it defines {', '.join(ordered)}"
        )

    def undefined_now(self, may_bind: Collection[str] | None) -> list[str]:
        """:meth:`undefined` messages for the code's own names still missing after a new
        :meth:`look_up`, but those whose first name is in ``may_bind`` (code still to run may bind
        it; ``None``: it may bind any name, so no message)."""
        self.look_up()
        if may_bind is None:
            return []
        return [
            self.undefined(name) for name in self.missing() if self._own(name) and name.root not in may_bind
        ]

    def check(self) -> list[Any]:
        """:meth:`functions`, or ``ValueError`` for the first thing found that cannot be profiled,
        then for the first name never found (one of the code's own, with ``program`` set: said by
        :meth:`undefined`)."""
        if self.errors:
            raise ValueError(self.errors[0])
        missing = self.missing()
        if missing and self.program is not None and self._own(missing[0]):
            raise ValueError(self.undefined(missing[0]))
        if missing:
            raise ValueError(
                f"-f {missing[0].text}: no function of that name was defined or imported by the code "
                f"or found in the namespace (write {_FORMS})"
            )
        return self.functions()
