"""``memlab.distributed.fake_group``: rank ``rank`` of a job of any size in one process, left as found."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from memlab.distributed import FakeGroupError, fake_group


def test_the_process_is_the_rank_asked_for_and_nothing_is_left_behind():
    with fake_group(8, rank=3) as group:
        assert (dist.get_world_size(), dist.get_rank(), group.size(), group.rank()) == (8, 3, 8, 3)
        assert dist.get_backend() == "memlab_fake"
    assert not dist.is_initialized()


def test_nothing_is_left_behind_when_the_body_raises():
    with pytest.raises(KeyboardInterrupt), fake_group(2):
        dist.new_group([0, 1])
        raise KeyboardInterrupt
    assert not dist.is_initialized()
    with fake_group(4):  # and a later group starts afresh
        assert dist.get_world_size() == 4


def test_collectives_complete_at_once_with_their_outputs_and_move_no_data():
    with fake_group(4):
        tensor = torch.arange(3.0)
        work = dist.all_reduce(tensor, async_op=True)
        assert work.is_completed()
        assert work.get_future().value()[0] is tensor
        assert tensor.tolist() == [0.0, 1.0, 2.0]  # not summed over four ranks
        # every rank is taken to hold what this one holds
        gathered = torch.zeros(8)
        # torch 2.13's names; 2.11 has only the older all_gather_into_tensor, reduce_scatter_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather(gathered, torch.tensor([5.0, 6.0]))
        assert gathered.tolist() == [5.0, 6.0] * 4
        out = torch.zeros(1)
        reduce_scatter(out, torch.ones(4))
        assert out.tolist() == [0.0]
        dist.barrier()


def test_ddp_trains_inside_a_fake_group():
    # PyTorch's own fake backend fails here: its work carries no future for DDP's hook
    with fake_group(2):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        assert model.module.weight.grad.shape == (2, 4)


def test_an_initialised_group_is_refused_and_kept():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(FakeGroupError) as caught, fake_group(2):
            pass
        assert str(caught.value) == (
            "fake_group needs torch.distributed uninitialised, but a default process group is initialised "
            "(gloo, world size 1); call fake_group before init_process_group or after destroy_process_group"
        )
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((0,), ValueError, "world_size must be >= 1, got 0"),
        ((2.0,), TypeError, "world_size must be an int, got float 2.0"),
        ((2, -1), ValueError, "rank must be >= 0, got -1"),
        ((2, 2), ValueError, "rank must be < world_size (2), got 2"),
    ],
)
def test_bad_arguments_are_typed_errors(arguments, error, message):
    with pytest.raises(error) as caught, fake_group(*arguments):
        pass
    assert str(caught.value) == message
    assert not dist.is_initialized()


# -- object collectives: what a real group of that size gives this rank --------------------------------
SIZES_AND_RANKS = [(1, 0), (4, 0), (4, 2)]


@pytest.mark.parametrize(("world_size", "rank"), SIZES_AND_RANKS)
def test_all_gather_object_gives_world_size_copies_of_this_ranks_object(world_size, rank):
    mine = {"rank": rank, "shape": [2, 3]}
    with fake_group(world_size, rank):
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, mine)
    assert gathered == [{"rank": rank, "shape": [2, 3]}] * world_size
    assert all(copy is not mine for copy in gathered)  # unpickled, as a real group's are


@pytest.mark.parametrize(("world_size", "rank"), SIZES_AND_RANKS)
def test_gather_object_fills_the_destinations_list_and_leaves_the_others(world_size, rank):
    with fake_group(world_size, rank):
        here: list = [None] * world_size
        dist.gather_object(("rank", rank), here, dst=rank)  # this rank is the destination
        elsewhere = None
        if world_size > 1:
            dist.gather_object(("rank", rank), elsewhere, dst=(rank + 1) % world_size)
    assert here == [("rank", rank)] * world_size
    assert elsewhere is None


@pytest.mark.parametrize(("world_size", "rank"), SIZES_AND_RANKS)
def test_the_source_keeps_its_broadcast_list_and_gets_its_scattered_item(world_size, rank):
    with fake_group(world_size, rank):
        objects = ["config", 7, None]
        dist.broadcast_object_list(objects, src=rank)
        received: list = [None]
        dist.scatter_object_list(received, [f"item {i}" for i in range(world_size)], src=rank)
    assert objects == ["config", 7, None]
    assert received == [f"item {rank}"]


def test_gather_and_scatter_of_tensors_on_the_root_fill_as_an_all_gather_does():
    with fake_group(4, rank=2):
        slots = [torch.zeros(2) for _ in range(4)]
        dist.gather(torch.tensor([1.0, 2.0]), slots, dst=2)
        out = torch.zeros(2)
        dist.scatter(out, [torch.full((2,), float(i)) for i in range(4)], src=2)
    assert [slot.tolist() for slot in slots] == [[1.0, 2.0]] * 4
    assert out.tolist() == [2.0, 2.0]  # this rank's slot


def test_the_object_collectives_are_put_back_when_the_group_is_left():
    originals = (dist.broadcast_object_list, dist.scatter_object_list, dist.recv_object_list)
    with fake_group(2):
        assert dist.broadcast_object_list is not originals[0]
        assert dist.distributed_c10d.broadcast_object_list is dist.broadcast_object_list
    assert (dist.broadcast_object_list, dist.scatter_object_list, dist.recv_object_list) == originals
    assert dist.distributed_c10d.scatter_object_list is originals[1]


def test_device_meshes_that_outlive_the_group_are_not_counted_as_tensors_alive():
    # torch 2.11's C++ DTensor sharding code keeps references to the meshes made inside the group
    # after it (no cache clear frees them); holding one here does the same on any torch. Its
    # rank tables describe a group that no longer exists: no profile after the block counts them
    # (a line profile would call them tensors of the user's that existed before profiling).
    from torch.distributed.device_mesh import init_device_mesh

    from memlab import _tensors

    held = []
    with fake_group(4):
        held.append(init_device_mesh("cpu", (2, 2)))
        mine = torch.arange(3)  # the user's, made inside the block: counted
    tables = [value for value in vars(held[0]).values() if isinstance(value, torch.Tensor)]
    assert tables and all(table.device.type == "cpu" for table in tables)
    view = tables[0][:1]  # a view of a disowned table shares its storage: not counted either
    found = _tensors.live_storages(torch.device("cpu"))
    alive = {entry.storage._cdata for entry in found.values()}
    assert mine.untyped_storage()._cdata in alive
    assert not alive & {table.untyped_storage()._cdata for table in tables}
    reachable = _tensors.reachable_tensors()
    assert any(tensor is view for tensor in reachable)  # a tensor object of its own, still listed
    assert not any(tensor is table for tensor in reachable for table in tables)
    del reachable
    count = len(_tensors._DISOWNED)
    del held, tables, view, found
    gc.collect()
    assert len(_tensors._DISOWNED) < count  # forgotten with the mesh: a later tensor in its place counts
