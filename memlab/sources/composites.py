"""Composite ops that reach a dispatch mode whole: run their decomposition where the mode sees it.

An op with a ``CompositeImplicitAutograd`` kernel (``linear``, ``matmul``, ``lstm``,
``scaled_dot_product_attention``, ``dropout``, ``contiguous``) is decomposed at the autograd
dispatch key, above the Python key where dispatch modes sit, so in a run with autograd on (grad
mode or ``torch.no_grad()``) a mode sees its parts (``t`` and ``addmm``), never the op itself. Under
``torch.inference_mode()`` the autograd keys are skipped and the op reaches the mode whole; calling
it there runs the parts below the mode, unseen: a tracker would miss every temporary inside it and
every cuBLAS workspace its matmuls take. :func:`composite_kernel` says when the dispatcher below
the mode would run the composite kernel (the arguments' backend has no kernel of its own), and
:func:`run_composite` runs it with the mode back on the stack, so the mode sees what it sees with
autograd on.

:data:`COMPOSITE_KERNELS` lets a higher layer stand in for an op's composite kernel while it
runs (the CUDA kernel choices of :class:`memlab.estimate.kernels.CudaKernels`, registered at the
autograd keys, which inference mode skips).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode

__all__ = ["COMPOSITE_KERNELS", "composite_kernel", "has_composite_kernel", "run_composite"]

#: Op overload -> the kernel that stands in for its ``CompositeImplicitAutograd`` kernel, set by
#: whoever also registers it at the autograd keys (so both paths run the same kernel).
COMPOSITE_KERNELS: dict[Any, Callable[..., Any]] = {}

# Dispatch keys of the dense backends by device type (a tensor on another device is not decomposed).
_BACKEND_KEYS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta", "mps": "MPS", "xpu": "XPU", "hpu": "HPU"}
_COMPOSITE = "CompositeImplicitAutograd"


def has_composite_kernel(func: Any) -> bool:
    """Whether ``func`` (an op overload) has a ``CompositeImplicitAutograd`` kernel (computed once
    per op by the caller); ``False`` for an op the dispatcher does not know (``prim::device``)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
    except RuntimeError:  # operator ... does not exist
        return False


def _backend_key(tensor: torch.Tensor) -> str | None:
    """The dense backend key ``tensor`` dispatches to below the Python key, or ``None`` for a
    layout, device or subclass whose own kernel or ``__torch_dispatch__`` handles the op (nested,
    sparse, mkldnn tensors; ``DTensor``); a fake tensor counts as a tensor of its fake device."""
    from torch._subclasses.fake_tensor import FakeTensor

    if tensor.layout is not torch.strided or tensor.is_nested:
        return None
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter, FakeTensor) and torch._C._dispatch_keys(
        tensor
    ).has(torch._C.DispatchKey.Python):
        return None  # a subclass with its own __torch_dispatch__ decides
    return _BACKEND_KEYS.get(tensor.device.type)


def composite_kernel(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Callable[..., Any] | None:
    """The kernel the dispatcher would run for ``func(*args, **kwargs)`` below the Python key when
    that is ``func``'s composite decomposition (or what :data:`COMPOSITE_KERNELS` has in its
    place), else ``None``: every tensor argument is a dense tensor (plain, ``Parameter`` or fake)
    on one backend that has no kernel of its own for ``func`` (``_fused_rms_norm`` has one on CUDA,
    ``linear`` on nested tensors). An op without tensor arguments is not decomposed."""
    keys = set()
    for value in (*args, *(kwargs or {}).values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                keys.add(_backend_key(item))
    if len(keys) != 1 or None in keys:
        return None
    (key,) = keys
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key):
        return None
    return COMPOSITE_KERNELS.get(func, func.decompose)


@contextlib.contextmanager
def _on_stack(mode: TorchDispatchMode) -> Iterator[None]:
    """Put ``mode`` back on the dispatch mode stack (its ``__torch_dispatch__`` runs with it taken
    off) for the ops a decomposition calls, without entering it again."""
    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


def run_composite(
    mode: TorchDispatchMode, kernel: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Any:
    """Run ``kernel`` (from :func:`composite_kernel`) on the arguments with ``mode`` on the stack,
    so ``mode`` sees the ops it calls, as it would with autograd on."""
    with _on_stack(mode):
        return kernel(*args, **(kwargs or {}))
