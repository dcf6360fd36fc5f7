"""Verdicts and allocator remedies: fragmentation or shortage, replays under other settings, and
tensors held across calls."""

from __future__ import annotations

import gc
import io

import pytest
import torch

import memlab
from memlab.oom.capture import OOMCapture
from memlab.oom.postmortem import replay_peak, trace_events, verdict
from memlab.sources.allocator import CachingAllocatorModel

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    gc.collect()
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))


def _fragmented() -> memlab.oom.OOMReport:
    """Twenty 3 MiB tensors in 20 MiB segments, the first ten freed, then a 24 MiB request."""
    with memlab.explain_oom(stream=io.StringIO()) as watch:
        with memlab.TensorTracker(capacity="80 MiB", history=True):
            blocks = [torch.empty(3 * MIB // 4) for _ in range(20)]
            del blocks[:10]
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(24 * MIB // 4)
    return watch.report


def test_freed_medium_blocks_then_a_large_request_is_fragmentation():
    report = _fragmented()
    assert report.verdict == "fragmentation"
    assert (report.capacity, report.reserved, report.allocated) == (80 * MIB, 60 * MIB, 30 * MIB)
    assert (report.free, report.cached_free) == (20 * MIB, 30 * MIB)
    assert report.largest_free_block == 14 * MIB
    assert report.inactive_split_bytes == 30 * MIB
    assert report.block_size == 24 * MIB
    lines = report.text().splitlines()
    assert (
        "verdict: fragmentation: 50.00M free in all (20.00M on the device, 30.00M cached), but the largest "
        "free block is 14.00M; inactive split blocks hold 30.00M"
    ) in lines


def test_the_expandable_segments_remedy_is_a_replay_of_the_same_allocations():
    model = CachingAllocatorModel(config="expandable_segments:True")
    handles = [model.malloc(3 * MIB) for _ in range(20)]
    for handle in handles[:10]:
        model.free(handle)
    model.malloc(24 * MIB)
    expected = model.memory_stats()["reserved_bytes.all.peak"]

    remedy = next(r for r in _fragmented().remedies if r.kind == "expandable_segments")
    assert remedy.peak_reserved == expected == 60 * MIB
    # a block, not a watched step: the rest of the work is unknown, so a margin and not "fits"
    assert (remedy.fits, remedy.margin) == (None, 20 * MIB)
    assert (
        remedy.unsure == "replayed up to the failing request only, with no watched step to estimate the rest"
    )
    assert remedy.action == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def test_the_max_split_size_remedy_keeps_the_lowest_replayed_peak():
    report = _fragmented()
    remedy = next(r for r in report.remedies if r.kind == "max_split_size_mb")
    peaks = {}
    for megabytes in (32, 64, 128, 256, 512, 1024):
        model = CachingAllocatorModel(config=f"max_split_size_mb:{megabytes}")
        handles = [model.malloc(3 * MIB) for _ in range(20)]
        for handle in handles[:10]:
            model.free(handle)
        model.malloc(24 * MIB)
        peaks[megabytes] = model.memory_stats()["reserved_bytes.all.peak"]
    best = min(peaks.values())
    assert remedy.peak_reserved == best
    assert remedy.details["max_split_size_mb"] == max(m for m, p in peaks.items() if p == best)
    assert remedy.action == f"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{remedy.details['max_split_size_mb']}"


def test_a_shortage_gets_no_allocator_remedy():
    with memlab.explain_oom(stream=io.StringIO()) as watch:
        with memlab.TensorTracker(capacity="40 MiB", history=True):
            kept = torch.empty(30 * MIB // 4)
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(12 * MIB // 4)
    assert kept.numel()
    report = watch.report
    assert report.verdict == "shortage"
    assert (report.allocated, report.block_size) == (30 * MIB, 12 * MIB)
    assert report.remedies == ()
    assert (
        "verdict: shortage: 10.00M free in all (10.00M on the device, 0.00B cached), less than the 12.00M "
        "block requested"
    ) in report.text().splitlines()


def _capture(capacity: int, allocated: int, block: int) -> OOMCapture:
    return OOMCapture(
        0,
        "",
        "cpu",
        "tracker",
        (),
        block,
        block,
        block,
        capacity,
        {"allocated_bytes.all.current": allocated},
        0,
    )


def test_the_verdict_boundary_is_the_block_against_capacity_minus_allocated():
    assert verdict(_capture(100 * MIB, 76 * MIB, 24 * MIB)) == "fragmentation"
    assert verdict(_capture(100 * MIB, 76 * MIB + 512, 24 * MIB)) == "shortage"


def test_replay_peak_replays_allocs_and_frees_then_the_request():
    snapshot = {
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 3 * MIB, "time_us": 1},
                {"action": "alloc", "addr": 2, "size": 3 * MIB, "time_us": 2},
                {"action": "free_requested", "addr": 1, "size": 3 * MIB, "time_us": 3},
                {"action": "free_completed", "addr": 1, "size": 3 * MIB, "time_us": 3},
                {"action": "segment_alloc", "addr": 9, "size": 20 * MIB, "time_us": 4},
            ]
        ]
    }
    events = trace_events(snapshot)
    assert events == [("alloc", 1, 3 * MIB, 1), ("alloc", 2, 3 * MIB, 2), ("free", 1, 3 * MIB, 3)]
    # 17 MiB is more than the 14 MiB + 3 MiB left free in the 20 MiB segment: a second one, of 18 MiB
    assert replay_peak(events, "", 17 * MIB) == 38 * MIB
    assert replay_peak(events, "", 17 * MIB, release=[2], release_at_us=3) == 20 * MIB


kept: list[torch.Tensor] = []


def leaky_step(model, x):
    out = model(x)
    kept.append(out)  # held across calls, with nothing of the next call needing it
    return out.sum()


def test_tensors_held_across_calls_are_a_remedy_with_the_bytes_it_frees(monkeypatch):
    # sized without torch 2.8's per-call cuBLASLt workspace (its 2 MiB small segment)
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")
    kept.clear()
    watched = memlab.explain_oom(leaky_step, stream=io.StringIO())
    # 40 MiB for tensors, and the 32 MiB cuBLAS workspace of the modelled H100 in a segment of its own
    with memlab.TensorTracker(capacity=(40 + 32) * MIB, history=True):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU())
        x = torch.ones(256, 1024)
        with pytest.raises(torch.OutOfMemoryError):
            for _ in range(20):
                watched(model, x)
    # each call makes two 2 MiB outputs (linear, relu) and keeps one: five kept fill the weight's
    # 20 MiB segment, and the sixth call needs a new segment
    assert len(kept) == 5
    report = memlab.oom.last_report()
    remedy = next(r for r in report.remedies if r.kind == "free_held")
    assert remedy.details["frees"] == 5 * 2 * MIB
    assert remedy.details["tensors"] == 5
    line = leaky_step.__code__.co_firstlineno + 1
    assert remedy.details["allocated_at"] == [f"{__file__}:{line}"]
    assert remedy.action == f"free 5 tensors held across calls (10.00M, from test_postmortem.py:{line})"
    # released when the sixth call began, its outputs take their place: the segments of before
    assert remedy.peak_reserved == report.reserved
    assert (remedy.fits, remedy.margin) == (None, report.capacity - report.reserved)
    assert remedy.unsure == (
        "replayed up to the failing request only: a step that keeps tensors across calls is not "
        "estimated again"
    )
    # the step is not estimated again (its estimates would not see the held tensors)
    assert [r.kind for r in report.remedies] == ["expandable_segments", "max_split_size_mb", "free_held"]
    assert report.notes == (
        "step remedies left out: tensors held across calls are outside the step's arguments, where "
        "estimates cannot see them; free them first",
    )
    assert all(type(t) is torch.Tensor for t in kept)
    kept.clear()


def test_a_ring_buffer_that_dropped_entries_is_not_replayed():
    with memlab.explain_oom(stream=io.StringIO()) as watch:
        with memlab.TensorTracker(capacity="80 MiB", history=5):
            blocks = [torch.empty(3 * MIB // 4) for _ in range(20)]
            del blocks[:10]
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(24 * MIB // 4)
    assert watch.report.verdict == "fragmentation"
    assert watch.report.remedies == ()


def test_a_trace_that_does_not_end_where_the_allocator_was_is_not_replayed():
    from memlab.oom.postmortem import expandable_segments_remedy

    snapshot = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 3 * MIB, "time_us": 1}]]}
    capture = _capture(80 * MIB, 30 * MIB, 24 * MIB)
    capture.snapshot, capture.trace_complete = snapshot, True
    assert expandable_segments_remedy(capture) is None  # the trace accounts for 3 MiB of the 30 MiB
    capture.stats["allocated_bytes.all.current"] = 3 * MIB
    capture.trace_checked = None
    assert expandable_segments_remedy(capture).peak_reserved == 40 * MIB  # 3 MiB, then 24 MiB: two pages
