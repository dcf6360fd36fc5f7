"""Activation checkpointing of whole modules that can be taken off again, and the blocks a plan
chooses from.

A checkpointed module runs its forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
PyTorch's recommended form): the tensors its forward saves for backward are dropped after the
forward and recomputed in the backward pass. A Hugging Face layer (``GradientCheckpointingLayer``)
is switched on with its own per-layer switch, which also drops its KV cache arguments (a
recomputed forward would append to the cache twice: ``CheckpointError``); any other module gets its
``forward`` replaced on the instance (:class:`Checkpointed`). Either way only instance attributes
change: the class, the parameters' names, the ``state_dict`` and the hooks stay as they are, a
``copy.deepcopy`` of the model (an estimate's copies) is checkpointed the same way, and
:func:`uncheckpoint` puts back exactly what was there.

**Selective** checkpointing (``selective=True``) keeps, of what a block's forward saves, the
outputs of the ops PyTorch's FLOP counter counts (matmuls, convolutions, attention:
``torch.utils.flop_counter.flop_registry``) and recomputes the others
(:func:`keep_matmuls`, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``):
its recompute runs no counted FLOPs, only the memory-bound ops between them (norms, activations,
elementwise ops), and it frees less than checkpointing the whole block.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

__all__ = [
    "Checkpointed",
    "LayerCheckpoint",
    "candidate_blocks",
    "checkpoint",
    "is_checkpointed",
    "is_layer",
    "keep_matmuls",
    "uncheckpoint",
]

_NOTHING = object()  # the module had no forward of its own on the instance


def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy of selective checkpointing (``create_selective_checkpoint_contexts``): keep the
    output of an op PyTorch's FLOP counter counts (``flop_registry``: matmuls, convolutions,
    attention), recompute any other."""
    if op._overloadpacket in flop_registry:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep_matmuls)}


class Checkpointed:
    """A module's ``forward`` run under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    (``selective``: with :func:`keep_matmuls`). ``forward``: the forward it wraps (the module's
    bound method); ``previous``: what the instance's ``__dict__`` held under ``forward`` before
    (restored by :func:`uncheckpoint`)."""

    def __init__(self, forward: Any, previous: Any, selective: bool = False) -> None:
        self.forward = forward
        self.previous = previous
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = _SELECTIVE if self.selective else {}
        return torch.utils.checkpoint.checkpoint(
            self.forward, *args, use_reentrant=False, **options, **kwargs
        )


class LayerCheckpoint:
    """The checkpoint function given to a Hugging Face ``GradientCheckpointingLayer`` (its own per-layer
    switch: ``gradient_checkpointing``), which also drops the layer's KV cache arguments while it
    is checkpointed: a recomputed forward would append to the cache again. The layer drops those
    it gets by keyword; this drops a cache passed by position too (GPT-2's model passes its
    ``past_key_values`` so, and leaves it out only when the whole model is checkpointed).
    ``previous``: the instance's own ``gradient_checkpointing`` and ``_gradient_checkpointing_func``
    before; ``selective``: with :func:`keep_matmuls`."""

    def __init__(self, previous: tuple[Any, Any], selective: bool = False) -> None:
        self.previous = previous
        self.selective = selective

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(None if _is_cache(arg) else arg for arg in args)
        options = _SELECTIVE if self.selective else {}
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **options, **kwargs)


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face KV cache (``transformers.cache_utils.Cache``, found by
    name: the framework is not imported)."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__
    )


def is_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``GradientCheckpointingLayer`` (found by name: the
    framework is not imported)."""
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether :func:`checkpoint` checkpointed ``module`` (and :func:`uncheckpoint` did not undo it)."""
    return isinstance(module.__dict__.get("forward"), Checkpointed) or (
        isinstance(module.__dict__.get("_gradient_checkpointing_func"), LayerCheckpoint)
        and module.__dict__.get("gradient_checkpointing") is True
    )


def checkpoint(modules: Iterable[torch.nn.Module], selective: bool = False) -> None:
    """Checkpoint each of ``modules`` (already checkpointed ones are left as they are): a Hugging Face
    layer through its own switch (:class:`LayerCheckpoint`), any other module by its forward
    (:class:`Checkpointed`); ``selective``: keeping the outputs of matmuls, convolutions and
    attention (:func:`keep_matmuls`)."""
    for module in modules:
        if is_checkpointed(module):
            continue
        if is_layer(module):
            own = vars(module)
            previous = (
                own.get("gradient_checkpointing", _NOTHING),
                own.get("_gradient_checkpointing_func", _NOTHING),
            )
            module._gradient_checkpointing_func = LayerCheckpoint(previous, selective)
            module.gradient_checkpointing = True
        else:
            previous = module.__dict__.get("forward", _NOTHING)
            module.forward = Checkpointed(module.forward, previous, selective)  # type: ignore[method-assign]


def uncheckpoint(modules: Iterable[torch.nn.Module]) -> None:
    """Undo :func:`checkpoint` on each of ``modules`` (others are left as they are)."""
    for module in modules:
        own = vars(module)
        wrapper = own.get("forward")
        if isinstance(wrapper, Checkpointed):
            _put_back(module, "forward", wrapper.previous)
        function = own.get("_gradient_checkpointing_func")
        if isinstance(function, LayerCheckpoint):
            switch, previous_function = function.previous
            _put_back(module, "gradient_checkpointing", switch)
            _put_back(module, "_gradient_checkpointing_func", previous_function)


def _put_back(module: torch.nn.Module, name: str, value: Any) -> None:
    if value is _NOTHING:
        delattr(module, name)
    else:
        setattr(module, name, value)


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
