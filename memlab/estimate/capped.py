"""The one answer to "does it fit": does the step complete under an allocator capped at the budget?

A GPU's CUDA caching allocator, when a new segment would pass the memory it may use, frees its
cached segments and tries again (the retry path, ``num_alloc_retries``) before it raises
``torch.OutOfMemoryError``. A step can therefore complete in a budget below the peak reserved
bytes of an unbounded run, which never frees its cache. :func:`completes_under` runs the step's
estimate under a modelled allocator of exactly that capacity (retry path included), as a
``TensorTracker(capacity=budget)`` run or a real GPU with that much memory would; every fit check
in memlab calls it: :meth:`Estimate.fits <memlab.estimate.result.Estimate.fits>`,
:func:`memlab.max_batch_size`, :func:`memlab.autobatch` and the OOM remedies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memlab.estimate.result import Estimate

__all__ = ["completes_under"]


def completes_under(
    run: Callable[[int | None], Estimate], capacity: int, known: Estimate | None = None
) -> Estimate | None:
    """The estimate of the step under a modelled CUDA caching allocator of ``capacity`` bytes (the
    retry path included), or ``None`` when the step runs out of memory there. ``run(capacity)``
    estimates the step under a capacity (``None``: unbounded), raising ``torch.OutOfMemoryError``
    where it does not fit.

    ``known``: an estimate of the same step already run; when its allocator never had to free its
    cache (no retry, no out-of-memory error) and its peak reserved bytes are within ``capacity``, a
    run capped at ``capacity`` would make the same requests with the same results (the cap is never
    reached), so ``known`` is the answer and nothing runs again; when its peak of requested bytes
    (what the tensors asked for at once: the same under any allocator, and never more than it
    reserves) is above ``capacity``, the step cannot complete there and nothing runs either.
    Otherwise the step runs under the cap. What the estimate cannot see (cuDNN workspaces, the
    CUDA context) is not in ``capacity``: leave room for it."""
    if known is not None:
        stats = known.stats
        capped = stats.get("num_alloc_retries", 0) or stats.get("num_ooms", 0)
        if not capped and known.peak_reserved <= capacity:
            return known
        if stats.get("requested_bytes.all.peak", 0) > capacity:
            return None  # what the tensors ask for at once, whatever the allocator does, is over it
    try:
        return run(capacity)
    except torch.OutOfMemoryError:
        return None
