"""Estimates of sharded training for any world size from one process, against real runs.

``memlab.estimate`` of two steps of a model sharded with FSDP2 (or wrapped in DDP) inside
``fake_group(N)`` is held against rank 0 of a real N-process gloo run of the same steps on CPU,
tracked by a ``TensorTracker`` that adopted the model, the optimizer and the batch first
(``estimated_steps``). The real runs are spawned once per module.
"""

from __future__ import annotations

import json

import pytest
import torch

import memlab
from memlab.distributed import fake_group
from memlab.estimate.sharded import REBUILD_CAVEAT
from tests.distributed import estimated_steps
from tests.distributed.estimated_steps import KEYS, batch, ddp, fsdp2, make_model, train_step
from tests.distributed.test_gather import spawn_ranks

RUNS = [("fsdp2", 2), ("fsdp2", 4), ("ddp", 2)]


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[tuple[str, int], dict[str, int]]:
    found = {}
    for wrapping, world in RUNS:
        out = tmp_path_factory.mktemp(f"{wrapping}{world}")
        spawn_ranks(estimated_steps.run_rank, (world, str(out), wrapping), world)
        found[wrapping, world] = json.loads((out / "stats.json").read_text())
    return found


@pytest.mark.parametrize(("wrapping", "world"), RUNS)
def test_an_estimate_inside_a_real_process_group_equals_one_inside_a_fake_group(real, wrapping, world):
    # every rank of the real job estimated the steps first, FSDP2's collectives going through gloo
    inside_fake = estimated(wrapping, world)[0]
    assert real[wrapping, world]["estimate"] == {key: inside_fake.stats[key] for key in KEYS}


def estimated(
    wrapping: str, world: int, steps: int = 2
) -> tuple[memlab.Estimate, torch.nn.Module, torch.optim.Optimizer]:
    with fake_group(world):
        model = fsdp2(make_model()) if wrapping == "fsdp2" else ddp(make_model())
        optimizer = torch.optim.Adam(model.parameters())
        result = memlab.estimate(train_step, model, optimizer, batch(), steps=steps)
    return result, model, optimizer


@pytest.mark.parametrize("world", [2, 4])
def test_the_fsdp2_estimate_for_n_ranks_is_rank_0_of_a_real_n_process_run(real, world):
    estimate, model, optimizer = estimated("fsdp2", world)

    assert (estimate.method, estimate.forced_by, estimate.caveats) == ("fake", None, [])
    measured = real["fsdp2", world]["real"]
    assert {key: estimate.stats[key] for key in KEYS} == measured  # the issue asks for 1%: exact
    # the user's sharded model and optimizer are untouched: no gradients, no state
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    assert type(model[0].weight).__name__ == "DTensor"


def shards(world: int) -> int:
    """Bytes of one rank's shards of the model's parameters: whole rows of each, each shard one block
    of the CUDA caching allocator model (rounded up to 512 B)."""
    shapes = [(1024, 256), (1024,), (1024, 1024), (1024,), (256, 1024), (256,)]
    sizes = [4 * shape[0] // world * (shape[1] if len(shape) > 1 else 1) for shape in shapes]
    return sum(-(-size // 512) * 512 for size in sizes)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_more_ranks_hold_smaller_shards(world):
    estimate = estimated("fsdp2", world)[0]
    at_end = estimate.by_category("end")
    assert at_end["parameter"] == shards(world)
    # Adam's two states of each shard and its six float32 step counters (a 512 B block each)
    assert at_end["optimizer_state"] == 2 * shards(world) + 6 * 512
    assert shards(4) == 4 * 1_575_168 // 4 + 256  # the last bias's shard, 256 B, takes a 512 B block


def test_the_ddp_estimate_is_rank_0_of_a_real_run_within_the_bucket_rebuild(real):
    estimate, model, _ = estimated("ddp", 2)
    measured = real["ddp", 2]["real"]

    assert estimate.caveats == [REBUILD_CAVEAT]
    assert estimate.stats["reserved_bytes.all.peak"] == measured["reserved_bytes.all.peak"]
    # after the rebuild, the real run holds nothing or 1,038,336 B more, run to run (the caveat says so)
    for key in ("allocated_bytes.all.peak", "allocated_bytes.all.current"):
        assert measured[key] - estimate.stats[key] in (0, 1_038_336)
    peak = measured["allocated_bytes.all.peak"]
    assert peak - estimate.stats["allocated_bytes.all.peak"] < 0.01 * peak
    assert all(p.grad is None for p in model.parameters())


def test_a_ddp_step_estimate_is_exact_before_the_rebuild():
    # one step: DDP's buckets as built, in the real run and in the estimate
    estimate = estimated("ddp", 2, steps=1)[0]
    with memlab.distributed.fake_group(2):
        measured = estimated_steps.tracked_steps("ddp", steps=1)
    assert {key: estimate.stats[key] for key in KEYS} == measured


def test_a_tensor_parallel_model_is_estimated_as_it_runs():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel()}
    with fake_group(2):
        model = parallelize_module(make_model(), init_device_mesh("cpu", (2,)), plan)
        optimizer = torch.optim.Adam(model.parameters())
        x = batch()
        estimates = [memlab.estimate(train_step, model, optimizer, x, steps=k) for k in (1, 2)]
        assert all(p.grad is None for p in model.parameters()) and not optimizer.state
        measured = tracked_in_process(model, optimizer, x)
    for estimate, stats in zip(estimates, measured, strict=True):
        assert (estimate.method, estimate.caveats) == ("fake", [])
        assert {key: estimate.stats[key] for key in KEYS} == stats


def test_fsdp2_over_tensor_parallel_parameters_is_a_clear_error():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with fake_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(make_model(), mesh["tp"], {"0": ColwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.Adam(model.parameters())
        with pytest.raises(memlab.EstimateError) as caught:
            memlab.estimate(train_step, model, optimizer, batch())
    assert str(caught.value) == (
        "cannot estimate the model (Sequential): FSDP2 over DTensor parameters "
        "(tensor parallelism inside FSDP) is not "
        "supported; estimate the tensor-parallel model without fully_shard"
    )


def test_an_optimizer_named_before_its_sharded_model_is_bound_to_the_sharded_copies():
    # FSDP2 makes the copies' parameters anew: an optimizer copied first would hold others
    with fake_group(2):
        model = fsdp2(make_model())
        optimizer = torch.optim.Adam(model.parameters())
        x = batch()
        in_order = memlab.estimate(train_step, model, optimizer, x, steps=2)
        reversed_ = memlab.estimate(lambda o, m, b: train_step(m, o, b), optimizer, model, x, steps=2)
    assert {key: reversed_.stats[key] for key in KEYS} == {key: in_order.stats[key] for key in KEYS}
    assert reversed_.by_category("end")["optimizer_state"] == 2 * shards(2) + 6 * 512


def tracked_in_process(model, optimizer, x, steps=2):
    """The stats after each of ``steps`` real steps in this process (inside a fake group: the other
    ranks' collectives move no data, and each rank's memory is this one's)."""
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x], category="input")
        measured = []
        for _ in range(steps):
            loss = train_step(model, optimizer, x)
            measured.append({key: tracker.memory_stats()[key] for key in KEYS})
        del loss
    return measured


def test_fsdp2_settings_made_after_sharding_are_carried_into_the_estimate():
    from torch.distributed.fsdp import fully_shard

    with fake_group(4):
        model = make_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, reshard_after_forward=False)
        fully_shard(model)
        model.set_reshard_after_backward(False)  # the gathered parameters stay after backward
        optimizer = torch.optim.Adam(model.parameters())
        x = batch()
        estimates = [memlab.estimate(train_step, model, optimizer, x, steps=k) for k in (1, 2)]
        # without the setting the estimate holds less after backward: the setting was carried
        model.set_reshard_after_backward(True)
        resharding = memlab.estimate(train_step, model, optimizer, x, steps=1)
        model.set_reshard_after_backward(False)
        measured = tracked_in_process(model, optimizer, x)
    for estimate, stats in zip(estimates, measured, strict=True):
        assert {key: estimate.stats[key] for key in KEYS} == stats
    assert resharding.stats["allocated_bytes.all.current"] < estimates[0].stats["allocated_bytes.all.current"]


def test_a_tensor_attribute_of_a_sharded_module_is_copied_data_free():
    # Hugging Face's rotary embeddings keep their buffer twice: also as a plain attribute
    # (original_inv_freq). The copy must take it as a tensor to copy, not deep-copy real data into
    # the fake mode; an alias of a buffer holds no bytes of its own, so the estimate is unchanged.
    def with_alias() -> torch.nn.Module:
        model = make_model()
        model[0].register_buffer("scale", torch.ones(256))
        model[0].original_scale = model[0].scale
        return model

    def without_alias() -> torch.nn.Module:
        model = make_model()
        model[0].register_buffer("scale", torch.ones(256))
        return model

    found = []
    for make in (with_alias, without_alias):
        with fake_group(2):
            model = fsdp2(make())
            optimizer = torch.optim.Adam(model.parameters())
            found.append(memlab.estimate(train_step, model, optimizer, batch(), steps=2).stats)
    assert found[0] == found[1]
    assert found[0]["allocated_bytes.all.peak"] > 0
