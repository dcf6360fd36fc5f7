"""``memlab.distributed.fake_group``: rank ``rank`` of a job of any size in one process, left as found."""

from __future__ import annotations

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
        dist.all_gather_single(gathered, torch.tensor([5.0, 6.0]))
        assert gathered.tolist() == [5.0, 6.0] * 4
        out = torch.zeros(1)
        dist.reduce_scatter_single(out, torch.ones(4))
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
