"""PyTorch's wording in the allocator models' messages."""

from __future__ import annotations

import pytest

from memlab.sources.allocator import format_cuda_size
from tests.sources.allocator.invariants import MiB


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (MiB, "1024.00 KiB"),
        (20 * MiB, "20.00 MiB"),
        (1536 * MiB, "1.50 GiB"),
    ],
)
def test_sizes_in_messages_are_formatted_like_pytorch(nbytes, text):
    assert format_cuda_size(nbytes) == text
