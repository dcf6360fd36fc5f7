"""History: the bounded log of allocator events, its interned stacks, and the allocators' hooks."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import memlab
from memlab import TensorTracker
from memlab.history.recorder import ALLOC, History, capture_stack, make_history
from memlab.sources.allocator import CachingAllocatorModel, ExactAllocator

MiB = 1024 * 1024


def actions(allocator) -> list[tuple[str, int]]:
    return [(action, size) for action, _, size, _, _, _ in allocator.history.entries()]


def test_a_ring_buffer_of_n_entries_keeps_the_last_n():
    history = History(max_entries=3)
    for size in range(1, 6):
        history.record(ALLOC, 0x1000 * size, size)
    assert [(a, addr, size) for a, addr, size, _, _, _ in history.entries()] == [
        ("alloc", 0x3000, 3),
        ("alloc", 0x4000, 4),
        ("alloc", 0x5000, 5),
    ]
    assert (len(history), history.recorded) == (3, 5)


def test_a_model_with_max_entries_keeps_its_last_events():
    m = CachingAllocatorModel(config="", history=4)
    m.free(m.malloc(1000))
    m.free(m.malloc(3000))
    assert actions(m) == [
        ("free_completed", 1000),
        ("alloc", 3000),
        ("free_requested", 3000),
        ("free_completed", 3000),
    ]
    assert m.history.recorded == 7


def test_the_time_of_entries_never_decreases():
    m = CachingAllocatorModel(config="", history=True)
    for _ in range(10):
        m.free(m.malloc(1000))
    times = [t for _, _, _, _, t, _ in m.history.entries()]
    assert times == sorted(times) and len(times) == 31


def test_a_model_records_segments_allocations_and_frees_at_the_blocks_addresses():
    m = CachingAllocatorModel(config="", history=True)
    small = m.malloc(1000)
    large = m.malloc(3 * MiB)
    (small_segment, large_segment) = m.snapshot()
    m.free(small)
    m.empty_cache()
    entries = [(a, addr, size) for a, addr, size, _, _, _ in m.history.entries()]
    assert entries == [
        ("segment_alloc", small_segment["address"], 2 * MiB),
        ("alloc", small_segment["address"], 1000),
        ("segment_alloc", large_segment["address"], 20 * MiB),
        ("alloc", large_segment["address"], 3 * MiB),
        ("free_requested", small_segment["address"], 1000),
        ("free_completed", small_segment["address"], 1000),
        ("segment_free", small_segment["address"], 2 * MiB),
    ]
    assert m.free(large) is None
    assert all(stack == () and category == "unknown" for _, _, _, stack, _, category in m.history.entries())


def test_the_retry_path_records_the_freed_segments_and_an_oom_records_what_it_tried():
    m = CachingAllocatorModel(capacity=50 * MiB, config="", history=True)
    m.free(m.malloc(15 * MiB))  # a cached 16 MiB segment
    keep = m.malloc(15 * MiB)  # reuses it
    m.free(m.malloc(12 * MiB))  # a second cached segment, of 12 MiB
    m.malloc(30 * MiB)  # 16 + 12 + 30 > 50 MiB: the retry frees the 12 MiB segment, then maps
    with pytest.raises(torch.OutOfMemoryError):
        m.malloc(10 * MiB)
    assert keep
    assert actions(m)[-5:] == [
        ("free_completed", 12 * MiB),
        ("segment_free", 12 * MiB),
        ("segment_alloc", 30 * MiB),
        ("alloc", 30 * MiB),
        ("oom", 10 * MiB),
    ]
    *_, (_, device_free, _, _, _, _) = m.history.entries()
    assert device_free == 50 * MiB - 16 * MiB - 30 * MiB


def test_expandable_segments_record_maps_and_unmaps():
    m = CachingAllocatorModel(config="expandable_segments:True", history=True)
    m.free(m.malloc(3 * MiB))
    m.empty_cache()
    assert actions(m) == [
        ("segment_map", 20 * MiB),
        ("alloc", 3 * MiB),
        ("free_requested", 3 * MiB),
        ("free_completed", 3 * MiB),
        ("segment_unmap", 20 * MiB),
    ]


def test_the_exact_allocator_records_one_segment_per_allocation():
    m = ExactAllocator(history=True)
    m.free(m.malloc(400))
    assert [(a, addr, size) for a, addr, size, _, _, _ in m.history.entries()] == [
        ("segment_alloc", 1, 400),
        ("alloc", 1, 400),
        ("free_requested", 1, 400),
        ("free_completed", 1, 400),
        ("segment_free", 1, 400),
    ]


def test_without_history_malloc_and_free_are_the_class_methods():
    m = CachingAllocatorModel(config="")
    assert m.history is None
    assert "malloc" not in vars(m) and "free" not in vars(m)


@pytest.mark.parametrize("bad", ["yes", 1.5, [3]])
def test_a_history_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="history must be None, False, True or an int max_entries > 0"):
        CachingAllocatorModel(history=bad)
    with pytest.raises(TypeError, match="history must be None, False, True or an int max_entries > 0"):
        TensorTracker(history=bad)


@pytest.mark.parametrize("bad", [0, -3])
def test_a_history_of_no_entries_is_a_value_error(bad):
    with pytest.raises(
        ValueError, match=f"history must be None, False, True or an int max_entries > 0, got {bad}"
    ):
        make_history(bad)
    with pytest.raises(ValueError, match="max_entries > 0"):
        TensorTracker(history=bad)


def test_equal_stacks_are_one_interned_tuple_innermost_first():
    def where() -> tuple:
        return capture_stack()

    first, second = where(), where()
    assert first is second
    assert first[0][1:] == (where.__code__.co_firstlineno + 1, "where")
    assert first[1][2] == "test_equal_stacks_are_one_interned_tuple_innermost_first"
    assert first[0][0] == __file__


def test_with_history_off_no_frame_is_ever_captured(monkeypatch):
    def walker():
        raise AssertionError("a frame was captured")

    monkeypatch.setattr("memlab.sources.device_memory.capture_stack", walker)
    with TensorTracker() as tracker:
        x = torch.ones(1000) * 2
        del x
    assert tracker.memory_stats()["allocation.all.allocated"] == 2
    with pytest.raises(AssertionError, match="a frame was captured"), TensorTracker(history=True):
        torch.ones(1000)


def test_a_tracker_entry_carries_the_stack_of_its_allocation():
    with TensorTracker(history=True) as tracker:
        line = sys._getframe().f_lineno + 1
        x = torch.ones(1000)
        del x
    entries = tracker.snapshot()["device_traces"][0]
    assert [(e["action"], e["size"]) for e in entries] == [
        ("segment_alloc", 2 * MiB),
        ("alloc", 4000),
        ("free_requested", 4000),
        ("free_completed", 4000),
    ]
    name = "test_a_tracker_entry_carries_the_stack_of_its_allocation"
    assert entries[1]["frames"][0] == {"filename": __file__, "line": line, "name": name}
    own = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(memlab.__file__) + os.sep)
    assert not any(f["filename"].startswith(own) for f in entries[1]["frames"])


def test_frames_are_looked_up_by_code_and_instruction_and_each_line_is_its_own():
    def where() -> tuple:
        first = capture_stack()[0]
        second = capture_stack()[0]
        return first, second

    line = where.__code__.co_firstlineno
    assert where() == ((__file__, line + 1, "where"), (__file__, line + 2, "where"))
    assert where()[0] is where()[0]  # the same frame of the same instruction: one interned tuple


def test_a_code_object_made_after_another_was_freed_has_frames_of_its_own():
    # Code objects made and freed one after another often reuse the same address: the walk's
    # caches are keyed by id, and must never answer for a freed code object.
    for n in range(20):
        namespace: dict = {}
        exec(
            compile("def made():\n    return capture_stack()\n", f"<made {n}>", "exec"),
            {"capture_stack": capture_stack},
            namespace,
        )
        stack = namespace.pop("made")()
        assert stack[0] == (f"<made {n}>", 2, "made")
        del namespace, stack
    torch_file = torch.nn.functional.__file__
    namespace = {}
    exec(
        compile("def inside():\n    return capture_stack()\n", torch_file, "exec"),
        {"capture_stack": capture_stack},
        namespace,
    )
    assert all(frame[0] != torch_file for frame in namespace["inside"]())  # torch's file: left out
