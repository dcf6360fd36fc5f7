"""Activation checkpointing of whole modules that can be taken off again, and the blocks a plan
chooses from.

A checkpointed module runs its forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
PyTorch's recommended form): the tensors its forward saves for backward are dropped after the
forward and recomputed in the backward pass. The module's ``forward`` is replaced on the instance
(:class:`Checkpointed`), so its class, its parameters' names, its ``state_dict`` and its hooks are
unchanged, a ``copy.deepcopy`` of the model (an estimate's copies) is checkpointed the same way, and
:func:`uncheckpoint` puts back exactly what was there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Checkpointed", "candidate_blocks", "checkpoint", "is_checkpointed", "uncheckpoint"]

_NOTHING = object()  # the module had no forward of its own on the instance


class Checkpointed:
    """A module's ``forward`` run under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
    ``forward``: the forward it wraps (the module's bound method); ``previous``: what the instance's
    ``__dict__`` held under ``forward`` before (restored by :func:`uncheckpoint`)."""

    def __init__(self, forward: Any, previous: Any) -> None:
        self.forward = forward
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether :func:`checkpoint` wrapped ``module``'s forward (and :func:`uncheckpoint` did not undo it)."""
    return isinstance(module.__dict__.get("forward"), Checkpointed)


def checkpoint(modules: Iterable[torch.nn.Module]) -> None:
    """Checkpoint each of ``modules`` (already checkpointed ones are left as they are)."""
    for module in modules:
        if not is_checkpointed(module):
            previous = module.__dict__.get("forward", _NOTHING)
            module.forward = Checkpointed(module.forward, previous)  # type: ignore[method-assign]


def uncheckpoint(modules: Iterable[torch.nn.Module]) -> None:
    """Undo :func:`checkpoint` on each of ``modules`` (others are left as they are)."""
    for module in modules:
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, Checkpointed):
            if wrapper.previous is _NOTHING:
                del module.forward
            else:
                module.forward = wrapper.previous  # type: ignore[method-assign]


def candidate_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules a plan may checkpoint, by qualified name, in the order they run: the items of the
    outermost ``ModuleList`` or ``Sequential`` whose children (two or more) are all of one class and
    have parameters (a transformer's layers); for a model without one, its direct children that
    have parameters. The model itself is never one (checkpointing the whole forward saves nothing:
    everything is recomputed at once)."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.named_children())
            if (
                len(children) >= 2
                and len({type(child) for _, child in children}) == 1
                and any(True for _ in children[0][1].parameters())
            ):
                return [(f"{name}.{key}" if name else key, child) for key, child in children]
    return [(key, child) for key, child in model.named_children() if any(True for _ in child.parameters())]
