"""Tensors a call reaches other than through its arguments, seen while an estimate runs.

An estimate copies the tensors among a call's arguments and the names it uses; a tensor it reaches
another way (a model held by another module's global) is handed to the fake mode as a real tensor
by the first op that uses it. :func:`watch_outside` notes each one (an :class:`EstimateError` at once
for one that requires grad: backward would give it a gradient that no copy holds) and
:func:`outside_tensors` turns them into the estimate's caveat: they are used, not counted.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from memlab._units import format_size
from memlab.estimate.result import EstimateError

__all__ = ["outside_tensors", "watch_outside"]


def watch_outside(mode: FakeTensorMode | None) -> list[torch.Tensor]:
    """From now on, the real tensors ``mode`` is handed by an op: tensors the call reached other
    than through its copied arguments (the constants fake tensors make of literals are not, nor
    the outputs of an op without a meta kernel, which ``mode`` runs for real on zeros and hands
    back as fake tensors: the tracker counts those as the op's outputs). One that requires grad
    is an :class:`EstimateError` at once: backward would give it a gradient."""
    found: list[torch.Tensor] = []
    if mode is None:
        return found
    converter = mode.fake_tensor_converter
    convert = converter.from_real_tensor

    def from_real_tensor(
        fake_mode: Any, tensor: torch.Tensor, make_constant: bool = False, *a: Any, **k: Any
    ) -> Any:
        if not make_constant and converter._get_memo(tensor) is None and not _fallback_output():
            if tensor.requires_grad:
                what = f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
                raise EstimateError(
                    f"fn used a tensor that requires grad and is not among its arguments or the names it "
                    f"uses ({what}), e.g. a parameter of a model another module holds; pass the model and "
                    f"optimizer to fn as arguments so that the estimate copies them"
                )
            found.append(tensor)
        return convert(fake_mode, tensor, make_constant, *a, **k)

    converter.from_real_tensor = from_real_tensor
    return found


def _fallback_output() -> bool:
    """Whether ``from_real_tensor`` is being called by FakeTensorMode's fallback for an op without a
    meta kernel, on the op's real outputs (torch/_subclasses/fake_tensor.py: run_fallback_kernel,
    map_out): two frames up from here."""
    caller = sys._getframe(2).f_code
    return caller.co_name == "map_out" and caller.co_filename == fake_tensor.__file__


def outside_tensors(found: list[torch.Tensor]) -> list[str]:
    """The caveat for tensors the call reached other than through its arguments: not counted."""
    if not found:
        return []
    nbytes = sum(t.untyped_storage().nbytes() for t in found)
    return [
        f"{len(found)} tensor(s) ({format_size(nbytes)}) that fn reached other than through its arguments "
        f"were used but not counted (pass them as arguments to count them)"
    ]
