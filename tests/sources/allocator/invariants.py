"""What every state of an allocator model must satisfy, and a model that ignores the environment."""

from __future__ import annotations

from itertools import pairwise

from memlab.sources.allocator import CachingAllocatorModel

MiB = 1024 * 1024


def model(capacity=None, config: str = "") -> CachingAllocatorModel:
    """A model with an explicit config, so the test does not depend on the environment."""
    return CachingAllocatorModel(capacity=capacity, config=config)


def assert_consistent(m: CachingAllocatorModel) -> None:
    """Every statistic agrees with the segments and blocks the model holds."""
    stats = m.memory_stats()
    segments = m.snapshot()
    expandable = m.config.expandable_segments
    for pool, kind in (("small_pool", "small"), ("large_pool", "large")):
        segs = [s for s in segments if s["segment_type"] == kind]
        blocks = [b for s in segs for b in s["blocks"]]
        live = [b for b in blocks if b["allocated"]]
        split_free = [b for s in segs if len(s["blocks"]) > 1 for b in s["blocks"] if not b["allocated"]]
        if expandable:  # mapped pages are not segments, and expandable blocks are not inactive_split
            assert all(s["is_expandable"] for s in segs)
            split_free = []
            segs_count = 0
        else:
            segs_count = len(segs)
        assert stats[f"segment.{pool}.current"] == segs_count
        assert stats[f"reserved_bytes.{pool}.current"] == sum(s["total_size"] for s in segs)
        assert stats[f"allocation.{pool}.current"] == len(live)
        assert stats[f"allocated_bytes.{pool}.current"] == sum(b["size"] for b in live)
        assert stats[f"requested_bytes.{pool}.current"] == sum(b["requested_size"] for b in live)
        assert stats[f"inactive_split.{pool}.current"] == len(split_free)
        assert stats[f"inactive_split_bytes.{pool}.current"] == sum(b["size"] for b in split_free)
    for seg in segments:
        address = seg["address"]
        for block in seg["blocks"]:  # blocks tile the segment exactly, in address order
            assert block["address"] == address
            address += block["size"]
        assert address == seg["address"] + seg["total_size"]
        free = [not b["allocated"] for b in seg["blocks"]]
        assert not any(a and b for a, b in pairwise(free)), "two adjacent free blocks were not merged"
    for stat in ("allocation", "allocated_bytes", "reserved_bytes", "segment", "requested_bytes"):
        parts = stats[f"{stat}.small_pool.current"] + stats[f"{stat}.large_pool.current"]
        assert stats[f"{stat}.all.current"] == parts
    assert stats["allocated_bytes.all.current"] <= stats["reserved_bytes.all.current"]
