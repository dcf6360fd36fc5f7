"""Allocation traces recorded on real GPUs, replayed through the caching allocator model.

The data is a copy of ``../shared/gpu-traces`` kept in ``tests/data/gpu-traces`` (see its README),
so a clone tests itself: the model's claim to be faithful rests on these traces.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from memlab.sources.allocator import CachingAllocatorModel
from memlab.sources.allocator.config import allocation_size, pool_name, round_size

TRACES = Path(__file__).resolve().parents[2] / "data" / "gpu-traces" / "traces.json"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def traces() -> dict[str, Any]:
    return json.loads(TRACES.read_text())


@pytest.fixture(scope="module")
def eor_nn(traces) -> tuple[CachingAllocatorModel, dict[int, int]]:
    """A fresh model after every recorded eor_nn event; and the still live handles by event id."""
    model = CachingAllocatorModel(config="")
    live: dict[int, int] = {}
    for event in traces["eor_nn"]["events"]:
        if event[0] == "a":
            live[event[1]] = model.malloc(event[2])
        else:
            model.free(live.pop(event[1]))
    return model, live


def test_eor_nn_replay_ends_with_the_recorded_128_mib_reserved(eor_nn, traces):
    model, _ = eor_nn
    recorded = traces["eor_nn"]["recorded"]
    assert recorded["final_reserved_bytes"] == 134_217_728
    assert model.memory_stats()["reserved_bytes.all.current"] == 134_217_728


def test_eor_nn_replay_ends_with_the_recorded_ten_segments(eor_nn, traces):
    model, _ = eor_nn
    sizes = sorted(segment["total_size"] for segment in model.snapshot())
    assert sizes == sorted(traces["eor_nn"]["recorded"]["final_segment_sizes"])
    assert Counter(sizes) == {20 * MiB: 6, 2 * MiB: 4}
    assert model.memory_stats()["segment.all.current"] == 10


def test_eor_nn_recorded_live_blocks_have_their_rounded_size(traces):
    blocks = traces["eor_nn"]["recorded"]["final_live_blocks_requested_size_pool_segment"]
    assert len(blocks) == 40
    for requested, granted, pool, _segment in blocks:
        assert granted == round_size(requested)
        assert pool_name(granted) == f"{pool}_pool"


def test_eor_nn_replayed_live_blocks_are_granted_what_the_gpu_granted(eor_nn, traces):
    # recording began with three segments in use, so the replay holds a subset of the 40 live blocks
    model, live = eor_nn
    recorded = Counter(
        (r, g) for r, g, _, _ in traces["eor_nn"]["recorded"]["final_live_blocks_requested_size_pool_segment"]
    )
    replayed = Counter(
        (b["requested_size"], b["size"]) for s in model.snapshot() for b in s["blocks"] if b["allocated"]
    )
    assert sum(replayed.values()) == len(live) == 9
    assert replayed <= recorded


def test_eor_nn_segments_allocated_during_the_trace_follow_the_segment_size_rule(traces):
    sizes = traces["eor_nn"]["recorded"]["segment_alloc_sizes_in_trace"]
    assert set(sizes) <= {
        allocation_size(round_size(e[2])) for e in traces["eor_nn"]["events"] if e[0] == "a"
    }


def test_voxelflex_granted_sizes_follow_from_requested_sizes(traces):
    segments = traces["voxelflex"]["segments"]
    active = [
        (req, size, s["segment_type"])
        for s in segments
        for req, size, state in s["blocks"]
        if state == "active_allocated"
    ]
    assert len(active) == 73
    for requested, granted, segment_type in active:
        assert granted == round_size(requested)
        assert pool_name(granted) == f"{segment_type}_pool"


def test_voxelflex_blocks_tile_their_segments(traces):
    for segment in traces["voxelflex"]["segments"]:
        assert sum(size for _req, size, _state in segment["blocks"]) == segment["total_size"]


def test_voxelflex_was_recorded_with_the_default_settings_the_model_uses(traces):
    settings = traces["voxelflex"]["allocator_settings"]
    model = CachingAllocatorModel(config=settings["PYTORCH_CUDA_ALLOC_CONF"])
    assert model.memory_stats()["max_split_size"] == settings["max_split_size"] == -1
    assert model.config.expandable_segments is settings["expandable_segments"] is False
    assert set(settings["roundup_power2_divisions"].values()) == {0}


def test_voxelflex_segment_sizes_are_possible_segment_sizes(traces):
    for segment in traces["voxelflex"]["segments"]:
        size = segment["total_size"]
        if segment["segment_type"] == "small":
            assert size == allocation_size(1 * MiB)
        else:
            assert size == 20 * MiB or (size >= 10 * MiB and size % (2 * MiB) == 0)
