"""What a block of memory holds: the categories of the history, the snapshots and the reporter.

Each category is defined here, once; the names are those of PyTorch's memory profiler and viewer
(``torch.profiler._memory_profiler.Category`` lower-cased, as ``torch.cuda._memory_viz`` writes
them into trace entries), plus ``buffer``, which PyTorch counts as a parameter.

- ``parameter``: the storage of a parameter of a model given to the tracker (``add_model``) or
  the reporter (``model=``).
- ``buffer``: the storage of a buffer of such a model (``model.named_buffers()``, e.g. batch-norm
  running statistics).
- ``gradient``: the storage of a parameter's ``.grad``, as backward accumulates it.
- ``optimizer_state``: a tensor in ``optimizer.state`` of an optimizer given to the tracker
  (``add_optimizer``) or the reporter (AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``).
- ``activation``: a tensor autograd saved for backward (seen by a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook while the tracker is active), that had no
  category before (a saved weight stays a ``parameter``).
- ``input``: a tensor held by the arguments of a profiled call, adopted when the call began.
- ``workspace``: a cuBLAS or cuBLASLt workspace, which PyTorch allocates at the first matmul of a
  (thread, stream) on a GPU and keeps (modelled by a tracker for tensors not on a real GPU:
  :mod:`memlab.sources.workspaces`).
- ``temporary``: a block freed while its category was still unknown (an intermediate result that
  was never a parameter, gradient, optimizer state, activation or input). Only trace entries of
  freed blocks carry it; live blocks are never temporary.
- ``unknown``: none of the above is known (yet): a live tensor the tracker cannot place, or any
  block of an allocator driven directly.

A block's category is the first of these it is given; it does not change afterwards.
"""

from __future__ import annotations

__all__ = [
    "ACTIVATION",
    "BUFFER",
    "CATEGORIES",
    "GRADIENT",
    "INPUT",
    "OPTIMIZER_STATE",
    "PARAMETER",
    "TEMPORARY",
    "UNKNOWN",
    "WORKSPACE",
    "category_code",
]

UNKNOWN = "unknown"
PARAMETER = "parameter"
BUFFER = "buffer"
GRADIENT = "gradient"
OPTIMIZER_STATE = "optimizer_state"
ACTIVATION = "activation"
INPUT = "input"
TEMPORARY = "temporary"
WORKSPACE = "workspace"

#: Every category, by its code in a history (``unknown`` is 0, the code of a new entry).
CATEGORIES = (UNKNOWN, PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, INPUT, WORKSPACE, TEMPORARY)
_CODES = {name: code for code, name in enumerate(CATEGORIES)}


def category_code(category: str) -> int:
    """The code of ``category`` (one of :data:`CATEGORIES`) in a history's columns."""
    code = _CODES.get(category) if isinstance(category, str) else None
    if code is None:
        raise ValueError(f"category must be one of {', '.join(CATEGORIES)}; got {category!r}")
    return code
