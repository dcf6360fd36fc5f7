"""FLOPs and roofline time of the ops a step runs, counted inside an estimate without changing what
it allocates.

PyTorch's ``FlopCounterMode`` decomposes the ops its table lacks (``func.decompose``) and tracks
modules with hooks; both change the ops a step runs, and with checkpointed blocks what it keeps
(a 6-layer ``TransformerEncoder`` with all blocks checkpointed: 146 MB allocated at peak as it is,
190 MB under the counter). :class:`FlopCount` only reads: each op runs as it would, and the
FLOPs of those in PyTorch's own table (``torch.utils.flop_counter.flop_registry``: matmuls,
convolutions, attention) are added, by PyTorch's formulas, from the shapes of its arguments and
result. Ops outside the table count 0, as they do for ``FlopCounterMode``.

**Roofline time.** With a GPU whose peaks are known (:class:`memlab._gpus.GPU`'s ``fp32_flops``,
``tensor_flops``, ``bandwidth``), each op also adds the time a roofline gives it: the larger of its
FLOPs at the GPU's peak for its dtype (16-bit: the tensor cores; float32: TF32 tensor cores, half
the 16-bit peak, where ``torch.get_float32_matmul_precision()`` allows them on an sm80 or later
GPU, else the float32 peak) and the bytes of its tensor arguments and results at the GPU's memory
bandwidth (each read or written once; views move nothing). What it cannot see: kernel launch
latency and the CPU's time (a step of many small ops is slower than its roofline: micro-batches,
optimizers stepping per parameter), caches (a tensor read twice is counted twice), kernels below
their peak (small or odd shapes, attention's softmax), overlap of communication, and the real
kernels' fusion (an op PyTorch fuses into one kernel is counted as the ops it dispatches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from memlab._gpus import GPU

__all__ = ["Cost", "FlopCount", "counting"]


@dataclass(frozen=True)
class Cost:
    """What one call of a step computes: ``flops`` (PyTorch's formulas) and ``seconds`` (its
    roofline time on the GPU counted for; ``None`` where that GPU's peaks are not known)."""

    flops: int
    seconds: float | None = None


class FlopCount(TorchDispatchMode):
    """A dispatch mode that adds up the FLOPs of the ops run under it (``flops``, an int) and, for a
    ``gpu`` with known peaks, their roofline time (``seconds``; see the module docstring)."""

    def __init__(self, gpu: GPU | None = None) -> None:
        super().__init__()
        self.flops = 0
        known = gpu is not None and None not in (gpu.fp32_flops, gpu.tensor_flops, gpu.bandwidth)
        self.gpu = gpu if known else None
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        self.flops += flops
        if self.gpu is not None and _moves(func, out):
            tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            moved = sum(t.nbytes for t in tensors)
            compute = flops / _peak(self.gpu, tensors[0].dtype) if flops and tensors else 0.0
            self.seconds += max(compute, moved / self.gpu.bandwidth)  # type: ignore[operator]
        return out

    @property
    def cost(self) -> Cost:
        """The FLOPs and roofline seconds counted so far."""
        return Cost(self.flops, self.seconds if self.gpu is not None else None)


_KINDS: dict[Any, tuple[bool, bool]] = {}
#: Ops that move no memory although their schema does not say they return views: a view PyTorch
#: makes without alias information, and allocations left uninitialised.
_NO_MEMORY = frozenset(
    {"_unsafe_view", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
)


def _moves(func: Any, out: Any) -> bool:
    """Whether ``func`` moves memory: it returns a tensor that is not a view of its arguments (by its
    schema's alias annotations; not one of :data:`_NO_MEMORY`), or writes into an argument (an
    in-place op, a ``_foreach_*_``). Queries (a tensor's ``device``, ``item()``) move nothing."""
    kind = _KINDS.get(func)
    if kind is None:
        schema = func._schema
        view = func._overloadpacket.__name__ in _NO_MEMORY or (
            bool(schema.returns)
            and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        )
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        kind = _KINDS[func] = (view, writes)
    view, writes = kind
    if view:
        return False
    return writes or any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(out))


def _peak(gpu: GPU, dtype: torch.dtype) -> float:
    """The GPU's peak FLOP/s for a matmul-like op on ``dtype`` (see the module docstring)."""
    if dtype in (torch.bfloat16, torch.float16):
        return gpu.tensor_flops  # type: ignore[return-value]
    if (
        dtype == torch.float32
        and gpu.capability >= (8, 0)
        and torch.get_float32_matmul_precision() != "highest"
    ):
        return gpu.tensor_flops / 2  # type: ignore[operator]
    return gpu.fp32_flops  # type: ignore[return-value]


def counting(costs: list[Cost], gpu: GPU | None = None) -> Callable[[Any, int], AbstractContextManager[None]]:
    """A ``call_context`` for :func:`memlab.estimate.estimate.run_estimate`: each call of the step
    runs under a :class:`FlopCount` for ``gpu`` and appends its :class:`Cost` to ``costs`` (the
    forward, the backward with any recompute, the optimizer: all the call runs). The step itself is
    not wrapped, so the estimate copies what it names as it does for any step."""

    @contextmanager
    def counted(copier: Any, index: int) -> Iterator[None]:
        with FlopCount(gpu) as counter:
            try:
                yield
            finally:
                costs.append(counter.cost)

    return counted
