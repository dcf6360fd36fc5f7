"""Find the functions a user names for profiling (``name``, ``Class.method``, ``module:qualname``),
in code that has not run yet, in a namespace, or in an imported module.

Shared by the IPython magics and ``memlab run``: both accept names of functions that do not exist
yet when profiling starts (defined later in the same cell, script or an imported module).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MISSING", "FunctionName", "code_function", "codes_named", "lookup"]

#: What :func:`lookup` returns for a name that does not resolve (yet).
MISSING: Any = object()

_FORMS = "name, Class.method or module:qualname"


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
