"""Resizes are allocations: ``UntypedStorage.resize_`` and ops that grow a storage, as the CUDA
caching allocator sees them (``resize_bytes_cuda``: to 0 bytes, the block is freed; to any other
size, a new block is allocated, the data copied, then the old block freed)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import memlab
from memlab.sources.resizes import follow_resizes, resizable_arguments

MiB = 1024 * 1024
U8 = torch.uint8


def hooked() -> bool:
    """Whether ``UntypedStorage.resize_`` is other than PyTorch's own C method (PyTorch's
    MemTracker, leaving, may put that method itself into the class's ``__dict__``)."""
    return torch.UntypedStorage.resize_ is not torch._C.StorageBase.__dict__["resize_"]


def test_a_storage_resized_to_zero_and_back_follows_the_caching_allocator():
    with memlab.TensorTracker() as tracker:
        storage = torch.empty(10_000).untyped_storage()  # 40 000 B: a 40 448 B block
        assert tracker.memory_allocated() == 40_448
        storage.resize_(0)
        assert tracker.memory_allocated() == 0
        assert tracker.memory_reserved() == 2 * MiB  # the freed block stays cached in its segment
        storage.resize_(40_000)
        assert tracker.memory_allocated() == 40_448
    stats = tracker.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 40_448
    assert stats["allocation.all.allocated"] == 2
    assert stats["allocated_bytes.all.freed"] == 40_448
    assert stats["segment.all.allocated"] == 1  # the second block came from the cache
    del storage
    assert tracker.memory_allocated() == 0


def test_growing_and_shrinking_allocate_a_new_block_before_freeing_the_old():
    with memlab.TensorTracker() as tracker:
        storage = torch.empty(10_000).untyped_storage()
        storage.resize_(80_000)  # an 80 384 B block next to the 40 448 B one, then that one freed
        assert tracker.memory_allocated() == 80_384
        assert tracker.max_memory_allocated() == 40_448 + 80_384
        storage.resize_(1000)  # a 1 024 B block, then the 80 384 B one freed
        assert tracker.memory_allocated() == 1024
    assert tracker.max_memory_allocated() == 120_832
    assert tracker.memory_stats()["allocation.all.allocated"] == 3
    del storage


def test_exact_bytes_follow_every_size_and_a_resize_to_the_same_size_is_a_new_block():
    with memlab.TensorTracker(allocator=None) as tracker:
        storage = torch.empty(100, dtype=U8).untyped_storage()
        storage.resize_(300)
        assert (tracker.memory_allocated(), tracker.max_memory_allocated()) == (300, 400)
        storage.resize_(50)
        assert tracker.memory_allocated() == 50
        storage.resize_(50)
        assert tracker.memory_allocated() == 50
        storage.resize_(0)
        assert tracker.memory_allocated() == 0
    stats = tracker.memory_stats()
    assert stats["allocation.all.allocated"] == 4  # 100, 300, 50, 50
    assert stats["allocated_bytes.all.allocated"] == 500
    assert stats["allocated_bytes.all.freed"] == 500
    assert stats["allocated_bytes.all.peak"] == 400
    del storage


def test_a_pre_existing_storage_counts_from_the_resize_that_gives_it_a_new_block():
    storage = torch.empty(1000, dtype=U8).untyped_storage()
    with memlab.TensorTracker(allocator=None) as tracker:
        storage.resize_(0)  # frees a block the tracker never counted
        assert tracker.memory_allocated() == 0
        storage.resize_(600)
        assert tracker.memory_allocated() == 600
    del storage
    assert (tracker.memory_allocated(), tracker.max_memory_allocated()) == (0, 600)


def test_typed_storage_resizes_are_the_same_method():
    with memlab.TensorTracker(allocator=None) as tracker:
        tensor = torch.empty(100)  # 400 B
        tensor._typed_storage()._resize_(0)  # FSDP1 frees its flat parameter this way
        assert tracker.memory_allocated() == 0
        tensor._typed_storage()._resize_(25)  # 25 floats
        assert tracker.memory_allocated() == 100
    del tensor


def test_meta_storages_are_counted_like_any_other():
    with memlab.TensorTracker() as tracker:
        storage = torch.empty(MiB, dtype=U8, device="meta").untyped_storage()
        storage.resize_(0)
        assert tracker.memory_allocated("meta") == 0
        storage.resize_(3 * MiB)
        assert tracker.memory_allocated("meta") == 3 * MiB
    assert tracker.max_memory_allocated("meta") == 3 * MiB
    assert tracker.memory_reserved("meta") == 2 * MiB + 20 * MiB  # 1 MiB: small pool; 3 MiB: a 20 MiB segment
    del storage


def test_a_failed_resize_counts_nothing():
    with memlab.TensorTracker(allocator=None) as tracker:
        fixed = torch.frombuffer(bytearray(8), dtype=U8).untyped_storage()
        with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
            fixed.resize_(64)
    assert tracker.memory_stats()["allocation.all.allocated"] == 0


def test_a_resize_past_capacity_raises_out_of_memory_where_the_gpu_would():
    with memlab.TensorTracker(capacity="8 MiB") as tracker:
        storage = torch.empty(MiB, dtype=U8).untyped_storage()
        storage.resize_(0)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 12\.00 MiB"):
            storage.resize_(12 * MiB)
    stats = tracker.memory_stats()
    assert (stats["num_ooms"], stats["num_alloc_retries"]) == (1, 1)
    del storage


# -- ops that grow a storage ----------------------------------------------------------------------


def test_an_out_argument_grown_by_an_op_counts_its_new_block():
    made_before = torch.empty(0)
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.ones(100)
        out = torch.empty(0)
        torch.add(a, a, out=out)  # grown from 0 to 400 B
        assert tracker.memory_allocated() == 400 + 400
        torch.add(a, a, out=made_before)  # a storage the tracker never counted, given 400 B
        assert tracker.memory_allocated() == 400 + 400 + 400
    assert tracker.memory_stats()["allocation.all.allocated"] == 3
    del a, out, made_before


def test_resizing_a_pre_existing_tensor_within_its_storage_allocates_nothing():
    tensor = torch.empty(10)
    with memlab.TensorTracker(allocator=None) as tracker:
        tensor.resize_(5)
        tensor.resize_(10)
        assert tracker.memory_allocated() == 0
        tensor.resize_(20)  # past its 40 B: an 80 B block
        assert tracker.memory_allocated() == 80
    del tensor


def test_the_inductor_storage_resize_op_is_counted():
    with memlab.TensorTracker(allocator=None) as tracker:
        tensor = torch.empty(100, dtype=U8)
        torch.ops.inductor.resize_storage_bytes_(tensor, 0)
        assert tracker.memory_allocated() == 0
        torch.ops.inductor.resize_storage_bytes_(tensor, 100)
        assert tracker.memory_allocated() == 100
    assert tracker.memory_stats()["allocation.all.allocated"] == 2
    del tensor


# -- the hook: only while a tracker is active, in the threads it counts ----------------------------


def test_the_method_is_wrapped_only_while_a_tracker_is_active_and_restored_after_an_error():
    assert not hooked()
    with pytest.raises(KeyError):
        with memlab.TensorTracker():
            assert hooked()
            raise KeyError("boom")
    assert not hooked()


def test_nested_trackers_both_count_and_the_wrapper_stays_until_the_last_exits():
    with memlab.TensorTracker(allocator=None) as outer:
        with memlab.TensorTracker(allocator=None) as inner:
            storage = torch.empty(100, dtype=U8).untyped_storage()
            storage.resize_(0)
        assert hooked()
        storage.resize_(30)
    assert not hooked()
    assert (outer.memory_allocated(), inner.memory_allocated()) == (30, 0)
    del storage


def test_resizes_count_in_threads_the_tracker_counts_and_not_in_others():
    storages = [torch.empty(0, dtype=U8).untyped_storage() for _ in range(2)]
    go = threading.Event()
    before = threading.Thread(target=lambda: (go.wait(), storages[0].resize_(100)))
    before.start()  # running before the tracker was entered: its ops are not counted
    with memlab.TensorTracker(allocator=None) as tracker:
        go.set()
        before.join()
        during = threading.Thread(target=lambda: storages[1].resize_(200))
        during.start()
        during.join()
    assert tracker.memory_allocated() == 200
    storages.clear()


def resize_under(memtracker: MemTracker, tracker: memlab.TensorTracker) -> list[tuple[int, int]]:
    """Make 1000 B, resize it to 0 then 300 B: both trackers' allocated bytes after each step."""
    seen = []
    tensor = torch.empty(1000, dtype=U8)
    for size in (0, 300):
        tensor.untyped_storage().resize_(size)
        snapshot = memtracker.get_tracker_snapshot()  # MemTracker drops a device whose total is 0
        seen.append((tracker.memory_allocated(), snapshot.get(torch.device("cpu"), {}).get("Total", 0)))
    return seen


def test_pytorch_memtracker_made_inside_the_tracker_sees_the_same_resizes():
    with memlab.TensorTracker(allocator=None) as tracker:
        memtracker = MemTracker()  # it wraps the method it finds when it is made: the tracker's
        with memtracker:
            assert resize_under(memtracker, tracker) == [(0, 0), (300, 300)]
    assert not hooked()


def test_the_tracker_inside_pytorch_memtracker_sees_the_same_resizes():
    memtracker = MemTracker()
    with memtracker, memlab.TensorTracker(allocator=None) as tracker:
        assert resize_under(memtracker, tracker) == [(0, 0), (300, 300)]
    assert not hooked()


def test_a_wrapper_left_inside_another_tools_wrapper_tells_each_resize_once():
    seen: list[int] = []
    stop = follow_resizes(lambda storage: seen.append(storage.nbytes()))
    ours = torch.UntypedStorage.resize_

    def other_tool(storage: torch.UntypedStorage, size: int) -> object:
        return ours(storage, size)

    torch.UntypedStorage.resize_ = other_tool  # another tool wraps ours, and is still active
    try:
        stop()  # ours stays inside the other tool's wrapper, passing calls through
        assert torch.UntypedStorage.resize_ is other_tool
        storage = torch.empty(0, dtype=U8).untyped_storage()
        storage.resize_(10)
        stop = follow_resizes(lambda storage: seen.append(-storage.nbytes()))  # over the other tool
        storage.resize_(20)
        stop()
        assert torch.UntypedStorage.resize_ is other_tool
    finally:
        del torch.UntypedStorage.resize_  # the other tool leaves
    assert seen == [-20]
    assert not hooked()


def test_resizable_arguments_are_out_arguments_and_what_the_resize_ops_write():
    aten = torch.ops.aten
    assert resizable_arguments(aten.add.out) == ("out",)
    assert resizable_arguments(aten.split_with_sizes_copy.out) == ("out",)
    assert resizable_arguments(aten.resize_.default) == (0,)
    assert resizable_arguments(aten.resize_as_.default) == (0,)
    assert resizable_arguments(aten.add_.Tensor) == ()  # in place, never resized
    assert resizable_arguments(aten.mm.default) == ()
