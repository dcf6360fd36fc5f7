"""What the model itself takes in a program ``memlab demo`` runs: its parameters, their gradients and
its optimizer's state, read after each optimizer step, apart from the batch, the activations, the
temporaries and the modelled cuBLAS workspaces a line table's peaks also hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memlab._units import format_size
from memlab.sources.allocator.config import round_size
from memlab.sources.tracker import active_tracker
from memlab.sources.workspace_note import ModelledWorkspaces, tracker_workspaces

__all__ = ["ModelFootprint"]


class ModelFootprint:
    """The bytes of the parameters, gradients and optimizer state of the optimizers that stepped
    while :meth:`watching` (PyTorch's global optimizer step hook), at the step where they were
    largest. Each distinct storage counts once, as the block the active
    :class:`~memlab.sources.tracker.TensorTracker` holds it in (a tensor it did not count, e.g. on
    a real GPU: its bytes rounded as the CUDA caching allocator rounds them)."""

    def __init__(self) -> None:
        #: ``(parameters, gradients, optimizer state)`` in bytes, at the largest step seen.
        self.largest: tuple[int, int, int] | None = None
        #: The cuBLAS workspaces the active tracker had modelled by then (``None``: none).
        self.workspaces: ModelledWorkspaces | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[ModelFootprint]:
        """Read every optimizer step of the block."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(self._after_step)
        try:
            yield self
        finally:
            handle.remove()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = [t for kept in optimizer.state.values() for t in kept.values() if isinstance(t, torch.Tensor)]
        found = (_bytes(params), _bytes([p.grad for p in params if p.grad is not None]), _bytes(state))
        if self.largest is None or sum(found) > sum(self.largest):
            self.largest = found
        tracker = active_tracker()
        self.workspaces = None if tracker is None else tracker_workspaces(tracker)

    def line(self) -> str | None:
        """``the model itself takes 24.53M: parameters 6.13M, gradients 6.13M, optimizer state
        12.27M ...``, or ``None`` when no optimizer stepped."""
        if self.largest is None:
            return None
        parameters, gradients, state = self.largest
        found = self.workspaces
        workspaces = "" if found is None else f", and {format_size(found.nbytes)} of workspaces"
        return (
            f"the model itself takes {format_size(parameters + gradients + state)}: parameters "
            f"{format_size(parameters)}, gradients {format_size(gradients)}, optimizer state "
            f"{format_size(state)} (after an optimizer step); the rest of each peak is the batch, "
            f"activations and temporaries{workspaces}"
        )


def _bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages of ``tensors``, as blocks of the active tracker."""
    tracker = active_tracker()
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if tensor.device.type != "meta" else id(storage)
        if key in seen or not storage.nbytes():
            continue
        block = None if tracker is None else tracker.block_size(tensor)
        seen[key] = block if block is not None else round_size(storage.nbytes())
    return sum(seen.values())
