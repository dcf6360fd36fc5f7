"""The largest live tensors at an out-of-memory error, each named as the user knows it: the model's
parameters, buffers and gradients and the optimizer state by :class:`memlab.MemReporter` (the model
and optimizer found among the step's arguments, the objects it names, the tracker's, the local
variables on the stack, and the modules and optimizers these hold as attributes), other tensors by
the local variable (or the variable's dict key, attribute or index) that holds them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

import torch

from memlab.history.recorder import is_own_code

if TYPE_CHECKING:
    from memlab.oom.capture import Call

__all__ = ["CULPRITS", "Culprit", "culprits", "holders"]

#: How many of the largest live tensors a capture keeps.
CULPRITS = 5


@dataclass(frozen=True)
class Culprit:
    """A live tensor at the moment of the OOM: its ``MemReporter`` name (``unnamed (4096, 1024) float32``
    for a tensor neither a model, an optimizer nor a variable names), category, bytes (as the
    allocator counts them), shape, dtype and ``file:line`` of its allocation (``None`` without a
    history)."""

    name: str
    category: str
    size: int
    shape: str
    dtype: str
    allocated_at: str | None


def culprits(
    device: torch.device,
    call: Call | None,
    tracker: Any,
    device_model: str | None,
    failing: torch.UntypedStorage | None = None,
) -> list[Culprit]:
    """The largest live tensors on ``device`` as :class:`memlab.MemReporter` names them (the model
    names parameters, gradients and buffers: the first among the call's arguments, else the first
    the tracker knows (:meth:`~memlab.TensorTracker.add_model`), else the first a local variable
    of a frame on the stack holds, innermost first; optimizers found the same ways name optimizer
    state; other tensors that a local variable holds get the variable's name), leaving out the
    tensors of the ``failing`` storage (a tracked op's output exists on the tracker's real device
    when its modelled allocation fails)."""
    from memlab.reporter import MemReporter

    stack_locals = _stack_locals()
    roots = holders(
        [
            *(() if call is None else (*call.args, *call.kwargs.values(), *_named(call.func))),
            *(() if tracker is None else (*tracker.models, *tracker.optimizers)),
            *(value for _, value in stack_locals),
        ]
    )
    model = next((root for root in roots if isinstance(root, torch.nn.Module)), None)
    reporter = MemReporter(model, device_model=device_model, tracker=tracker)
    for root in roots:
        if isinstance(root, torch.optim.Optimizer):
            reporter.add_optimizer(root)
    records = reporter.snapshot().select(str(device), verbose=False)
    anonymous = [(entry[0](), entry[2]) for entry in reporter._anonymous.values()]
    if failing is not None:
        names = {name for tensor, name in anonymous if _holds(tensor, failing)}
        records = [r for r in records if r.name not in names]
    local = _local_names(stack_locals)
    renamed = {name: local[id(tensor)] for tensor, name in anonymous if id(tensor) in local}
    unnamed = {name for _, name in anonymous} - renamed.keys()
    # Largest first; of equal sizes, the model's and optimizer's tensors (in MemReporter's order),
    # then those local variables name (by name), then the rest. MemReporter orders tensors outside
    # the model by the order gc lists objects in, which differs between torch releases and runs, so
    # those nothing names are shown by shape and dtype, not by its TensorN.
    records = [r._replace(name=renamed.get(r.name, r.name)) for r in records]
    local_names = set(renamed.values())
    records = sorted(
        (r for r in records if r.memory),
        key=lambda r: (-r.memory, r.name in unnamed, r.name if r.name in local_names else ""),
    )
    return [
        Culprit(
            f"unnamed {r.size_text} {str(r.dtype).removeprefix('torch.')}" if r.name in unnamed else r.name,
            r.category,
            r.memory,
            r.size_text,
            r.dtype,
            r.allocated_at,
        )
        for r in records[:CULPRITS]
    ]


def _named(func: Any) -> list[Any]:
    """The objects ``func`` uses by name (the owner of a bound method and its attributes, globals,
    closure variables: :func:`memlab.estimate.copies.named_objects`)."""
    from memlab.estimate.copies import named_objects

    return named_objects(func)


def holders(values: list[Any]) -> list[Any]:
    """``values``, each followed by the modules and optimizers it holds as attributes (directly, or
    in a list, tuple or dict attribute): a trainer's ``model`` and ``optimizer``, a training
    loop's ``self.model``. Modules and optimizers are not looked into (their tensors are named
    through them)."""
    found: list[Any] = []
    for value in values:
        found.append(value)
        if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, type, ModuleType)):
            continue  # a Python module (`dist`, `torch`) holds no trainer; its attributes may warn
        held = getattr(value, "__dict__", None)
        if not isinstance(held, dict):
            continue
        for attribute in list(held.values()):
            items = attribute.values() if isinstance(attribute, dict) else attribute
            for item in items if isinstance(attribute, (list, tuple, dict)) else (attribute,):
                if isinstance(item, (torch.nn.Module, torch.optim.Optimizer)):
                    found.append(item)
    return found


def _stack_locals() -> list[tuple[str, Any]]:
    """``(name, value)`` of the local variables (arguments included) of the frames on the stack
    outside torch and memlab, the innermost frame first."""
    found: list[tuple[str, Any]] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_own_code(frame.f_code):
            found += frame.f_locals.items()
        frame = frame.f_back
    return found


def _local_names(stack_locals: list[tuple[str, Any]]) -> dict[int, str]:
    """``id(tensor) -> name`` for the tensors among ``stack_locals``, the first name kept: a
    variable's name, or for a tensor inside a variable's dict, list or tuple (a model's output),
    ``out.logits`` (a key that is also an attribute, as in Hugging Face's ``ModelOutput``),
    ``batch['labels']`` or ``pair[0]``."""
    names: dict[int, str] = {}
    for name, value in stack_locals:
        if isinstance(value, torch.Tensor):
            names.setdefault(id(value), name)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if isinstance(item, torch.Tensor):
                    attribute = isinstance(key, str) and getattr(value, key, None) is item
                    names.setdefault(id(item), f"{name}.{key}" if attribute else f"{name}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    names.setdefault(id(item), f"{name}[{index}]")
    return names


def _holds(tensor: torch.Tensor | None, storage: torch.UntypedStorage) -> bool:
    try:
        return tensor is not None and tensor.untyped_storage() is storage
    except Exception:  # tensors without storage (fake, sparse, wrapper subclasses)
        return False
