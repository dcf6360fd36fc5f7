"""expandable_segments:True: one growing address range per pool, mapped and unmapped page by page."""

from __future__ import annotations

import pytest
import torch

from memlab.sources.allocator import CachingAllocatorModel
from tests.sources.allocator.invariants import MiB, model


def expandable(capacity=None) -> CachingAllocatorModel:
    return model(capacity=capacity, config="expandable_segments:True")


def test_expandable_segments_give_the_same_numbers_for_linear_100_100():
    m = expandable()
    m.malloc(40_000)
    m.malloc(400)
    stats = m.memory_stats()
    assert stats["active_bytes.all.peak"] == 40_960
    assert stats["reserved_bytes.all.peak"] == 2 * MiB


def test_expandable_segment_maps_20_mib_pages_for_the_large_pool():
    m = expandable()
    m.malloc(30 * MiB)
    stats = m.memory_stats()
    assert stats["reserved_bytes.large_pool.current"] == 40 * MiB
    assert stats["num_device_alloc"] == 1


def test_expandable_mappings_are_not_counted_as_segments():
    m = expandable()
    m.malloc(30 * MiB)
    stats = m.memory_stats()
    assert stats["segment.all.current"] == 0
    assert stats["oversize_segments.current"] == 0


def test_expandable_segment_grows_from_its_free_tail_instead_of_a_new_segment():
    m = expandable()
    m.malloc(30 * MiB)
    m.malloc(5 * MiB)  # from the 10 MiB left on the mapped pages
    m.malloc(15 * MiB)  # 5 MiB free tail + one new 20 MiB page
    stats = m.memory_stats()
    assert stats["reserved_bytes.large_pool.current"] == 60 * MiB
    assert stats["num_device_alloc"] == 2
    (segment,) = m.snapshot()
    assert [(b["size"], b["allocated"]) for b in segment["blocks"]] == [
        (30 * MiB, True),
        (5 * MiB, True),
        (15 * MiB, True),
        (10 * MiB, False),
    ]


def test_expandable_large_pool_splits_off_remainders_of_512_bytes_and_up():
    m = expandable()
    m.malloc(19 * MiB)
    stats = m.memory_stats()
    assert stats["allocated_bytes.large_pool.current"] == 19 * MiB
    assert stats["inactive_split.large_pool.current"] == 0


def test_expandable_empty_cache_unmaps_only_whole_free_pages():
    m = expandable()
    m.malloc(30 * MiB)
    m.malloc(5 * MiB)
    m.free(m.malloc(15 * MiB))  # free: 25 MiB from 35 MiB on; the page from 40 MiB is wholly free
    m.empty_cache()
    stats = m.memory_stats()
    assert stats["reserved_bytes.large_pool.current"] == 40 * MiB
    assert stats["num_device_free"] == 1
    assert [b["size"] for b in m.snapshot()[0]["blocks"]] == [30 * MiB, 5 * MiB, 5 * MiB]


def test_expandable_empty_cache_returns_everything_once_all_is_free():
    m = expandable()
    handles = [m.malloc(n) for n in (30 * MiB, 1000, 5 * MiB)]
    for handle in handles:
        m.free(handle)
    m.empty_cache()
    assert m.memory_stats()["reserved_bytes.all.current"] == 0
    assert m.snapshot() == []


def test_expandable_segment_recreated_after_empty_cache_reuses_its_address_range():
    m = expandable()
    m.free(m.malloc(30 * MiB))
    first = m.snapshot()[0]["address"]
    m.empty_cache()
    m.malloc(30 * MiB)
    assert m.snapshot()[0]["address"] == first


def test_set_capacity_limits_the_pages_mapped_from_now_on():
    m = expandable(capacity=40 * MiB)
    m.malloc(30 * MiB)  # two 20 MiB pages
    m.set_capacity(30 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match=r"total capacity of 30\.00 MiB"):
        m.malloc(1000)
    m.set_capacity(None)
    m.malloc(1000)  # a 2 MiB small page
    assert m.memory_stats()["reserved_bytes.all.current"] == 42 * MiB


def test_expandable_capacity_retries_then_raises_out_of_memory():
    m = expandable(capacity=40 * MiB)
    m.malloc(30 * MiB)
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"Tried to allocate 2\.00 MiB\. GPU 0 has a total capacity "
        r"of 40\.00 MiB of which 0 bytes is free",
    ):
        m.malloc(1000)
    stats = m.memory_stats()
    assert stats["num_alloc_retries"] == 1
    assert stats["num_ooms"] == 1
