"""Which frames are the user's: files outside the installed packages, the standard library, torch
and memlab, so that a report points at the line the user wrote, not at a line inside a library.

The rule is by location, not by a list of libraries: a file is a library's when it lies under a
folder Python installs packages into (``site-packages`` / ``dist-packages``: ``sysconfig``'s
``purelib`` and ``platlib``, ``site``'s folders, and such folders on ``sys.path``) or under the
standard library's, or under torch's or memlab's own folder (memlab may run from a checkout).
``transformers``, ``accelerate``, ``lightning`` and any other installed package are libraries;
a user's package installed in editable mode, a script, a notebook cell (``<ipython-input-…>``)
are the user's. A package of the user's installed into ``site-packages`` is a library here too:
:func:`user_frame` then falls back to the innermost frame it is given.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["is_library_file", "library_folders", "user_frame"]

F = TypeVar("F", bound=Sequence[object])

_folders: list[tuple[str, ...]] = []  # computed once, at the first question
_answers: dict[str, bool] = {}  # filename -> is a library's


def library_folders() -> tuple[str, ...]:
    """The folders (absolute, each ending with a separator) whose files are libraries' code."""
    if _folders:
        return _folders[0]
    found: list[str] = []
    paths = sysconfig.get_paths()
    found += [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)]
    if hasattr(site, "getsitepackages"):  # absent in some old virtualenvs
        found += site.getsitepackages()
    found.append(site.getusersitepackages())
    found += [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")]
    import torch  # already imported by anything that asks

    here = os.path.dirname(os.path.abspath(__file__))
    found += [os.path.dirname(os.path.abspath(torch.__file__)), here]
    folders = []
    for folder in found:
        absolute = os.path.abspath(folder)
        if absolute != os.path.abspath(os.sep):
            folders.append(absolute.rstrip(os.sep) + os.sep)
    _folders.append(tuple(dict.fromkeys(folders)))
    return _folders[0]


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` is a library's code (see the module's docstring); ``<frozen …>``
    modules are the standard library's, other names in angle brackets (``<stdin>``, ``<string>``,
    notebook cells) the user's."""
    answer = _answers.get(filename)
    if answer is None:
        if filename.startswith("<"):
            answer = filename.startswith("<frozen ")
        else:
            answer = os.path.abspath(filename).startswith(library_folders())
        _answers[filename] = answer
    return answer


def user_frame(stack: Sequence[F]) -> F | None:
    """The innermost of ``stack``'s frames (innermost first; each a sequence whose first item is
    the file name, as ``(filename, line, function)``) whose file is not a library's; the innermost
    frame when all are (``None`` for an empty stack)."""
    return next((frame for frame in stack if not is_library_file(str(frame[0]))), stack[0] if stack else None)
