"""FLOPs of the ops a step runs, counted inside an estimate without changing what it allocates.

PyTorch's ``FlopCounterMode`` decomposes the ops its table lacks (``func.decompose``) and tracks
modules with hooks; both change the ops a step runs, and with checkpointed blocks what it keeps
(a 6-layer ``TransformerEncoder`` with all blocks checkpointed: 146 MB allocated at peak as it is,
190 MB under the counter). :class:`FlopCount` only reads: each op runs as it would, and the
FLOPs of those in PyTorch's own table (``torch.utils.flop_counter.flop_registry``: matmuls,
convolutions, attention) are added, by PyTorch's formulas, from the shapes of its arguments and
result. Ops outside the table count 0, as they do for ``FlopCounterMode``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["FlopCount", "counting"]


class FlopCount(TorchDispatchMode):
    """A dispatch mode that adds up the FLOPs of the ops run under it (``flops``, an int)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def counting(flops: list[int]) -> Callable[[Any, int], AbstractContextManager[None]]:
    """A ``call_context`` for :func:`memlab.estimate.estimate.run_estimate`: each call of the step
    runs under a :class:`FlopCount` and appends its FLOPs to ``flops`` (the forward, the backward
    with any recompute, the optimizer: all the call runs). The step itself is not wrapped, so the
    estimate copies what it names as it does for any step."""

    @contextmanager
    def counted(copier: Any, index: int) -> Iterator[None]:
        with FlopCount() as counter:
            try:
                yield
            finally:
                flops.append(counter.flops)

    return counted
