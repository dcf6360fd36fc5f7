"""memlab's own Python kept out of a line profiler's trace: tracing off inside the tracker's dispatch.

A ``sys.settrace`` function is called at every new Python frame of the thread, whichever code it
runs: under a line profiler, each op the tracker counts would pay one such call for each of the
~20 frames of the tracker's own Python (storage walk, allocator model, history), about as much as
the tracker itself costs. memlab's line profiler marks its trace functions (:func:`mark_pausable`)
when they chain no other tool's; the tracker's ``__torch_dispatch__`` then switches the thread's
trace off for the duration of one call (:func:`pause_for_op`) and puts it back before returning
(:func:`resume`), also on an exception, so the next line of the user's code is traced as before.
:func:`untraced` does the same for the hooks memlab installs in PyTorch (module, gradient and
optimizer hooks).

Nothing a profile shows changes: a line's numbers are sampled at the line events of registered
frames, never inside an op, and the frames paused are memlab's and torch's (the dispatch, and the
op itself when it can run no one's Python). Tracing stays on when:

- the thread's trace function is not memlab's alone (coverage.py, pdb, another tool chained
  under memlab's): every frame stays theirs to see;
- the op can run Python a profile may have registered: tensor subclasses among its arguments
  (``types``), another dispatch mode below the tracker, or an operator outside the ``aten`` and
  ``prims`` namespaces (a ``torch.library`` custom op implemented in Python).

Python 3.12 and later implement ``sys.settrace`` over ``sys.monitoring``: there, switching the trace
off and on re-instruments every code object run afterwards (measured on 3.12.1 and 3.13.0: a toggle
around three small calls costs 5x the tracing it saves; on 3.10 and 3.11 it saves 60%), so the
trace is never paused.

What it cannot see: a Python kernel a user registered for an ``aten`` operator, or a user's
``__del__``, weak reference callback or signal handler that happens to run during an op, is not
traced while the op runs (its lines land in no row).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["PAUSABLE", "mark_pausable", "pause_for_op", "resume", "untraced"]

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute memlab's line profiler sets, true, on a trace function that chains no other
#: tool's: the tracker may switch it off inside its dispatch.
PAUSABLE = "memlab_pausable"
_NAMESPACES = frozenset({"aten", "prims"})
# id(operator) -> (operator, whether it runs no Python a profile may register). Keyed by id: an
# OpOverload hashes in Python, a call the trace function would see; the entry holds the operator, so
# its id is never reused while there.
_plain_ops: dict[int, tuple[Any, bool]] = {}


def mark_pausable(trace: Callable[..., Any], pausable: bool) -> None:
    """Say whether ``trace``, a trace function of memlab's line profiler, may be switched off
    inside memlab's own code (``pausable``: it chains no other tool's trace function)."""
    setattr(trace, PAUSABLE, pausable)


def pause_for_op(trace: Callable[..., Any], func: Any, types: Any) -> bool:
    """Called by a ``__torch_dispatch__`` with the thread's trace function ``trace`` (the caller
    reads ``sys.gettrace()`` first and calls this only when it is not ``None``: the untraced case
    costs one builtin call per op): switch the trace off and return True when it is memlab's line
    profiler's alone and the op ``func`` (with tensor subclasses ``types``) can run no Python a
    profile may register (see the module docstring); else False, and tracing stays on. After True
    the caller runs the op, then calls ``resume(trace)`` in a ``finally``. Always False on Python
    3.12 and later (see the module docstring)."""
    if _MONITORED or types or not getattr(trace, PAUSABLE, False) or _modes_below():
        return False
    known = _plain_ops.get(id(func))
    if known is None:
        known = _plain_ops[id(func)] = (func, getattr(func, "namespace", None) in _NAMESPACES)
    if not known[1]:
        return False
    sys.settrace(None)
    return True


def resume(trace: Callable[..., Any]) -> None:
    """Put back the trace function :func:`pause_for_op` switched off, unless another was installed
    meanwhile (it stays)."""
    if sys.gettrace() is None:
        sys.settrace(trace)


_MONITORED = sys.version_info >= (3, 12)
_modes_below = torch._C._len_torch_dispatch_stack


def untraced(hook: F) -> F:
    """Wrap one of memlab's hooks that PyTorch calls from the user's code (module hooks, gradient
    hooks, an optimizer's step hook) so that it runs with the thread's trace function switched off
    when that is memlab's line profiler's alone; it is back before the hook returns or raises. A
    hook runs only memlab's and torch's Python (the ops it runs go through the tracker's dispatch).
    On Python 3.12 and later it returns ``hook`` itself (see the module docstring)."""
    if sys.version_info >= (3, 12):
        return hook
    gettrace, settrace = sys.gettrace, sys.settrace

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        trace = gettrace()
        if trace is None or not getattr(trace, PAUSABLE, False):
            return hook(*args, **kwargs)
        settrace(None)
        try:
            return hook(*args, **kwargs)
        finally:
            if gettrace() is None:  # a trace function installed meanwhile stays
                settrace(trace)

    return run  # type: ignore[return-value]
