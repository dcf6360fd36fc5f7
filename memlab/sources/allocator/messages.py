"""PyTorch's own words for allocator failures: its size format and its out-of-memory errors.

The messages are those of ``c10/cuda/CUDACachingAllocator.cpp``, so a model's error reads like
the one a GPU would have raised.
"""

from __future__ import annotations

import torch

__all__ = ["format_cuda_size", "huge_request", "oom_message"]


def format_cuda_size(nbytes: int) -> str:
    """Format bytes as PyTorch's allocator does in its messages (``format_size`` in C++).

    Up to 1024 B: ``"512 bytes"``; up to 1 MiB: ``"40.00 KiB"``; up to 1 GiB: ``"20.00 MiB"``;
    above: ``"1.50 GiB"``. (memlab's own tables print sizes with :func:`memlab._units.format_size`.)
    """
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1_048_576:
        return f"{nbytes / 1024.0:.2f} KiB"
    if nbytes <= 1_073_741_824:
        return f"{nbytes / 1_048_576.0:.2f} MiB"
    return f"{nbytes / 1_073_741_824.0:.2f} GiB"


def oom_message(tried: int, capacity: int, free: int, allocated: int, reserved: int) -> str:
    """PyTorch's ``CUDA out of memory`` message for device 0, word for word.

    ``tried`` is the size of the failed ``cudaMalloc`` (the segment, not the request), ``free``
    what the device has left, ``allocated``/``reserved`` the allocator's current totals.
    """
    return (
        f"CUDA out of memory. Tried to allocate {format_cuda_size(tried)}. GPU 0 has a total capacity of "
        f"{format_cuda_size(capacity)} of which {format_cuda_size(free)} is free. Of the allocated memory "
        f"{format_cuda_size(allocated)} is allocated by PyTorch, and "
        f"{format_cuda_size(reserved - allocated)} is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def huge_request() -> torch.OutOfMemoryError:
    """The error PyTorch's ``allocate`` raises for 1 EiB or more, before the allocator sees it
    (so ``num_ooms`` does not count it)."""
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
