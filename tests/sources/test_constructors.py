"""Storages made from Python outside the dispatcher (``copy.deepcopy``, ``UntypedStorage(n)``,
``storage.clone()``, ``_new_shared``) are counted once, as the allocator sees them; ground truth is
a ``gc`` walk of the live storages and the arithmetic of known sizes."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import memlab
from memlab.sources.constructors import follow_new_storages


def live_storage_bytes(exclude: dict[int, torch.UntypedStorage]) -> int:
    """Bytes of the distinct live storages ``gc`` finds (held by tensors or bare), not in ``exclude``."""
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            storage = obj.untyped_storage()
        elif type(obj) is torch.UntypedStorage:
            storage = obj
        else:
            continue
        found[id(storage)] = storage
    return sum(s.nbytes() for key, s in found.items() if key not in exclude)


def before() -> dict[int, torch.UntypedStorage]:
    gc.collect()
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            found[id(obj.untyped_storage())] = obj.untyped_storage()
        elif type(obj) is torch.UntypedStorage:
            found[id(obj)] = obj
    return found


def test_deepcopy_of_a_tensor_is_counted_once_as_the_gpu_would():
    with memlab.TensorTracker() as tracker:
        a = torch.tensor(1.0)
        b = copy.deepcopy(a)
        assert tracker.memory_allocated() == 1024  # two 4 B storages, 512 B blocks each
    stats = tracker.memory_stats()
    # Tensor.__deepcopy__: the storage's copy, then new_empty([]) (4 B, freed by set_ to the copy)
    assert (stats["allocation.all.allocated"], stats["allocated_bytes.all.peak"]) == (3, 1536)
    assert (b.item(), b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()) == (1.0, True)


def test_deepcopy_of_a_model_equals_the_live_storages():
    """An EMA copy: parameters copy through ``Parameter.__deepcopy__`` (an aten clone), buffers
    through ``Tensor.__deepcopy__`` (the storage constructor)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    kept = before()
    with memlab.TensorTracker(allocator=None) as tracker:
        ema = copy.deepcopy(model)
        truth = live_storage_bytes(kept)
        assert tracker.memory_allocated() == truth == (64 * 64 + 64 + 4 * 64) * 4 + 8
    stats = tracker.memory_stats()
    # 4 parameters; 3 buffers, each with the new_empty([]) that set_ points at its copy (4, 4, 8 B)
    assert (stats["allocation.all.allocated"], stats["allocated_bytes.all.freed"]) == (10, 16)
    del ema
    assert tracker.memory_allocated() == 0


def test_deepcopy_of_a_view_copies_its_whole_storage():
    base = torch.zeros(100)
    kept = before()
    with memlab.TensorTracker(allocator=None) as tracker:
        view = copy.deepcopy(base[10:20])
        assert tracker.memory_allocated() == live_storage_bytes(kept) == 400
    assert view.shape == (10,)


def test_storage_constructors_are_counted_once_and_freed():
    with memlab.TensorTracker(allocator=None) as tracker:
        made = torch.UntypedStorage(1000)
        assert tracker.memory_allocated() == 1000
        cloned = made.clone()
        assert tracker.memory_allocated() == 2000
        shared = torch.UntypedStorage._new_shared(300)
        assert tracker.memory_allocated() == 2300
        with pytest.warns(UserWarning, match="TypedStorage is deprecated"):
            typed = torch.FloatStorage(25)  # a TypedStorage of 25 float32: 100 B
        assert tracker.memory_allocated() == 2400
        del made, cloned, shared, typed
        assert tracker.memory_allocated() == 0
    assert tracker.memory_stats()["allocation.all.allocated"] == 4


def test_constructor_wrappers_are_removed_when_the_last_tracker_leaves():
    own = torch.UntypedStorage.__dict__.get("__new__"), torch.UntypedStorage.__dict__.get("_new_shared")
    with memlab.TensorTracker(), memlab.TensorTracker():
        assert torch.UntypedStorage.__dict__.get("__new__") is not own[0]
    assert (
        torch.UntypedStorage.__dict__.get("__new__"),
        torch.UntypedStorage.__dict__.get("_new_shared"),
    ) == own
    with memlab.TensorTracker(allocator=None) as tracker:
        pass
    storage = torch.UntypedStorage(64)
    assert tracker.memory_allocated() == 0 and storage.nbytes() == 64


def test_nested_trackers_both_count_a_deepcopy():
    a = torch.ones(10)
    with memlab.TensorTracker(allocator=None) as outer, memlab.TensorTracker(allocator=None) as inner:
        b = copy.deepcopy(a)
        assert (outer.memory_allocated(), inner.memory_allocated()) == (40, 40)
    assert torch.equal(a, b)


def test_observers_are_told_once_per_storage_even_through_new_shared():
    told: list[int] = []
    stop = follow_new_storages(lambda storage: told.append(storage.nbytes()))
    try:
        torch.UntypedStorage(7)
        torch.UntypedStorage._new_shared(9, device="meta")  # calls the constructor inside
        torch.empty(5)  # made by an aten op: not a constructor call
    finally:
        stop()
    torch.UntypedStorage(11)
    assert told == [7, 9]
