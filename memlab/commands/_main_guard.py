"""A script's top level split at its ``if __name__ == "__main__":`` guard, and the names the
guard's part may still bind.

``memlab run`` runs the two parts one after the other in the same ``__main__`` namespace, so
that it can check the names given with ``-f`` once every definition above the guard has run and
before the program's main work starts. Both parts keep the script's file name and line numbers:
tracebacks, profiled rows and ``inspect`` read as they would for the whole script.
"""

from __future__ import annotations
import __future__

import ast
import types
from dataclasses import dataclass

__all__ = ["MainGuardSplit", "split_at_main_guard"]


@dataclass(frozen=True)
class MainGuardSplit:
    """The code above the guard (``top``), the code from the guard on (``main``), and the names the
    main part may bind in the module namespace (``may_bind``; ``None``: any name, after a
    ``from m import *`` there)."""

    top: types.CodeType
    main: types.CodeType
    may_bind: frozenset[str] | None


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either side, either quotes)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    constants = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(constants) == 1


def _module_bindings(statements: list[ast.stmt]) -> frozenset[str] | None:
    """The names ``statements`` bind at module level (``None``: any, for a star import), not
    counting those bound inside functions and classes they define."""
    names: set[str] = set()
    todo: list[ast.AST] = list(statements)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            todo.extend(node.decorator_list)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue  # their own scopes (a walrus inside binds in the module, but is not a function)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return frozenset(names)


def _global_declarations(tree: ast.Module) -> set[str]:
    """Every name a ``global`` statement anywhere in ``tree`` declares: a function called from the
    main part may bind it."""
    return {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}


def _future_flags(statements: list[ast.stmt]) -> int:
    """The compiler flags of the ``from __future__ import ...`` statements among ``statements``."""
    flags = 0
    for node in statements:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                feature = getattr(__future__, alias.name, None)
                flags |= getattr(feature, "compiler_flag", 0)
    return flags


def split_at_main_guard(source: str | bytes, path: str) -> MainGuardSplit | None:
    """``source`` (already compiled once without error, as ``path``) split before its first
    top-level ``if __name__ == "__main__":``; ``None`` when it has none."""
    tree = ast.parse(source, path)
    guard = next((i for i, node in enumerate(tree.body) if _is_main_guard(node)), None)
    if guard is None:
        return None
    top, main = tree.body[:guard], tree.body[guard:]
    top_code = compile(ast.Module(body=top, type_ignores=[]), path, "exec", dont_inherit=True)
    flags = _future_flags(top)  # `from __future__ import annotations` above the guard holds below it
    main_code = compile(ast.Module(body=main, type_ignores=[]), path, "exec", flags, dont_inherit=True)
    bindings = _module_bindings(main)
    may_bind = None if bindings is None else bindings | _global_declarations(tree)
    return MainGuardSplit(top_code, main_code, may_bind)
