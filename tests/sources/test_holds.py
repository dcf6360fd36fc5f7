"""Nested trackers and a capacity: a request an inner tracker refuses is counted by no tracker."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.sources import holds

MiB = 2**20
KEYS = (
    "allocated_bytes.all.peak",
    "allocated_bytes.all.current",
    "reserved_bytes.all.peak",
    "allocation.all.allocated",
)


def counted(tracker: memlab.TensorTracker) -> tuple[int, ...]:
    stats = tracker.memory_stats()
    return tuple(stats[key] for key in KEYS)


def allocations(tracker: memlab.TensorTracker) -> list[tuple[str, int]]:
    return [
        (e["action"], e["size"])
        for e in tracker.snapshot()["device_traces"][0]
        if e["action"] != "segment_alloc"
    ]


def test_an_allocation_an_inner_tracker_refuses_is_not_counted_by_the_outer_one():
    outer = memlab.TensorTracker(history=True)
    with outer:
        kept = torch.empty(1024)  # 4 KiB
        before = counted(outer)
        inner = memlab.TensorTracker(capacity="8 MiB")
        with inner, pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 16\.00 MiB"):
            torch.empty(4 * MiB)  # 16 MiB of float32
        assert counted(outer) == before == (4096, 4096, 2 * MiB, 1)
    assert allocations(outer) == [("alloc", 4096)]  # no 16 MiB block in the history
    assert inner.memory_stats()["num_ooms"] == 1
    assert outer.memory_stats()["num_ooms"] == 0
    del kept


def test_every_tracker_further_out_ignores_the_refused_request():
    outer, middle = memlab.TensorTracker(history=True), memlab.TensorTracker(history=True)
    with outer, middle, memlab.TensorTracker(capacity="8 MiB"), pytest.raises(torch.OutOfMemoryError):
        torch.empty(4 * MiB)
    assert counted(outer) == counted(middle) == (0, 0, 0, 0)
    assert allocations(outer) == allocations(middle) == []


def test_outputs_allocated_before_the_refused_one_are_counted_and_freed():
    # max(dim) allocates its values (150 Ki float32: 600 KiB, small pool, a 2 MiB segment) before its
    # indices (150 Ki int64: 1.2 MiB, large pool, a 20 MiB segment that a 4 MiB capacity refuses).
    x = torch.randn(150 * 1024, 2)
    outer = memlab.TensorTracker(history=True)
    with outer, memlab.TensorTracker(capacity="4 MiB"), pytest.raises(torch.OutOfMemoryError):
        torch.max(x, dim=1)
    assert allocations(outer) == [
        ("alloc", 614_400),
        ("free_requested", 614_400),
        ("free_completed", 614_400),
    ]
    assert counted(outer) == (614_400, 0, 2 * MiB, 1)


def test_a_refused_cublas_workspace_leaves_the_outer_tracker_without_one():
    # The 64x64 output fits in 8 MiB; the H100's 32 MiB workspace does not.
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    outer = memlab.TensorTracker(gpu="H100", history=True)
    with outer, memlab.TensorTracker(gpu="H100", capacity="8 MiB"), pytest.raises(torch.OutOfMemoryError):
        a @ b
    assert outer.workspaces.keys == []
    assert [action for action, _ in allocations(outer)] == ["alloc", "free_requested", "free_completed"]
    assert outer.max_memory_allocated() == 16_384
    with outer:  # the next matmul takes it
        c = a @ b
    assert outer.by_category()["workspace"] == 32 * MiB
    del c


def test_what_the_inner_tracker_accepts_the_outer_one_counts():
    outer, inner = memlab.TensorTracker(history=True), memlab.TensorTracker(capacity="64 MiB")
    with outer, inner:
        x = torch.empty(4 * MiB)
        y = x + 1
    assert counted(outer) == counted(inner) == (32 * MiB, 32 * MiB, 32 * MiB, 2)  # two 16 MiB segments
    assert allocations(outer) == [("alloc", 16 * MiB), ("alloc", 16 * MiB)]
    del x, y


def test_an_op_that_fails_below_leaves_nothing_held():
    outer = memlab.TensorTracker()
    with (
        outer,
        memlab.TensorTracker(capacity="8 MiB"),
        pytest.raises(RuntimeError, match="cannot be multiplied"),
    ):
        torch.randn(2, 3) @ torch.randn(4, 5)
    assert getattr(holds._here, "frames", []) == []
    with outer:
        y = torch.empty(256)
    assert outer.memory_allocated() == 1024  # the two inputs freed; y counted at once
    del y
