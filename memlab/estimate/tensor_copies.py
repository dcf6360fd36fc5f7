"""How an estimate copies one tensor, by the way it runs: a fake tensor (a one-element host value as
a fake constant that carries its value), a ``meta`` tensor, or a real CPU clone."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

__all__ = ["host_scalar", "tensor_copier"]


def tensor_copier(method: str, mode: FakeTensorMode | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if method == "fake":

        def fake(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(tensor, FakeTensor) and tensor.fake_mode is mode:
                return tensor  # made by make_arguments under the mode: data-free already
            if host_scalar(tensor):
                # A fake tensor that carries its value (FakeTensorMode's constants, which it makes
                # itself of torch.tensor(0.0) in a fresh optimizer's first step): reading it
                # (Adam's step.item()) works, and ops whose inputs are all constants (step += 1)
                # update it for real. The constant is a clone, so those updates never reach the
                # user's tensor; one written by a non-constant op stops being readable (PyTorch
                # invalidates it), and reading it then forces a real run, as any value would.
                with unset_fake_temporarily():
                    value = tensor.detach().clone()
                return mode.fake_tensor_converter.from_real_tensor(mode, value, make_constant=True)
            return mode.from_tensor(tensor)

        return fake
    target = "meta" if method == "meta" else "cpu"
    memo: dict[int, Any] = {}

    def real(tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        if source.device.type == target:  # keeps views of one storage sharing it
            new = copy.deepcopy(source, memo)
        else:
            new = source.to(target, copy=True)
        return new.requires_grad_(tensor.requires_grad) if tensor.is_leaf else new

    return real


def host_scalar(tensor: torch.Tensor) -> bool:
    """A one-element CPU tensor outside autograd (an optimizer's step counter, a GradScaler's
    scale on CPU): the values Python code reads to decide what to do next."""
    return (
        tensor.numel() <= 1
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and type(tensor) is torch.Tensor  # not a Parameter, not a subclass
    )
