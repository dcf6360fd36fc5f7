"""ExactAllocator: exact bytes, one segment per allocation, nothing cached."""

from __future__ import annotations

import pytest
import torch

from memlab import STAT_KEYS
from memlab.sources.allocator import ExactAllocator
from tests.sources.allocator.invariants import MiB


def test_exact_allocator_reserves_exactly_what_is_requested():
    m = ExactAllocator()
    m.malloc(40_000)
    m.malloc(400)
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.current"] == 40_400
    assert stats["reserved_bytes.all.current"] == 40_400
    assert stats["requested_bytes.all.current"] == 40_400
    assert stats["segment.all.current"] == 2
    assert tuple(stats) == STAT_KEYS


def test_exact_allocator_releases_on_free():
    m = ExactAllocator()
    m.free(m.malloc(2 * MiB))
    stats = m.memory_stats()
    assert stats["reserved_bytes.large_pool.current"] == 0
    assert stats["reserved_bytes.large_pool.peak"] == 2 * MiB
    assert stats["num_device_free"] == 1


def test_exact_allocator_raises_out_of_memory_at_capacity():
    m = ExactAllocator(capacity=1000)
    m.malloc(600)
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"Tried to allocate 500 bytes\. GPU 0 has a total capacity of 1000 bytes of which 400 bytes is",
    ):
        m.malloc(500)
    stats = m.memory_stats()
    assert stats["num_ooms"] == 1
    assert stats["num_alloc_retries"] == 0


def test_exact_allocator_zero_bytes_and_bad_handles():
    m = ExactAllocator()
    assert m.malloc(0) == 0
    m.free(0)
    with pytest.raises(ValueError, match="unknown handle 3"):
        m.free(3)
    assert m.memory_stats()["allocation.all.allocated"] == 0


def test_exact_allocator_snapshot_has_one_segment_of_one_block_per_allocation():
    m = ExactAllocator()
    small = m.malloc(400)
    m.free(m.malloc(100))
    large = m.malloc(2 * MiB)
    segments = m.snapshot()
    assert [
        (s["address"], s["total_size"], s["allocated_size"], s["requested_size"], s["segment_type"])
        for s in segments
    ] == [(small, 400, 400, 400, "small"), (large, 2 * MiB, 2 * MiB, 2 * MiB, "large")]
    assert [(b["address"], b["size"], b["requested_size"]) for s in segments for b in s["blocks"]] == [
        (small, 400, 400),
        (large, 2 * MiB, 2 * MiB),
    ]
    assert all(b["allocated"] and b["state"] == "active_allocated" for s in segments for b in s["blocks"])
    assert not any(s["is_expandable"] for s in segments)
