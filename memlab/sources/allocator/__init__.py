"""Models of PyTorch's CUDA caching allocator for machines without a GPU, and an exact-bytes sibling.

:mod:`.caching` holds :class:`CachingAllocatorModel` (the native caching allocator),
:mod:`.segments` its segments (``cudaMalloc``, the retry path, ``empty_cache``),
:mod:`.expandable` its ``expandable_segments`` half, :mod:`.exact` :class:`ExactAllocator`,
:mod:`.blocks` the blocks, pools and snapshot entries both share, :mod:`.snapshot` the
``torch.cuda.memory._snapshot()`` dict of either, :mod:`.stats` the ``memory_stats()`` counters
they keep, :mod:`.config` the size arithmetic and ``PYTORCH_CUDA_ALLOC_CONF``, and
:mod:`.messages` PyTorch's out-of-memory messages.
"""

from __future__ import annotations

from memlab.sources.allocator.caching import CachingAllocatorModel
from memlab.sources.allocator.exact import ExactAllocator
from memlab.sources.allocator.messages import format_cuda_size, oom_message

__all__ = ["CachingAllocatorModel", "ExactAllocator", "format_cuda_size", "oom_message"]
