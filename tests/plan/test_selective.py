"""Selective checkpointing in a plan: blocks whose matmuls' and attention's outputs are kept and
whose other ops run again, checked against real tracked runs and PyTorch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode

import memlab
from memlab.plan.checkpointing import checkpoint, is_checkpointed, keep_matmuls, uncheckpoint
from tests.plan.test_planner import STEPS, make_model, tracked_steps, train_step

aten = torch.ops.aten


def job():
    """A batch of 4 x 512 tokens: 178 MiB as it is; every block checkpointed selectively, 166 MiB."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(1)
    return model, optimizer, torch.randn(4, 512, 128)


def real_flops(model, optimizer, x) -> int:
    with FlopCounterMode(display=False) as counter:
        train_step(model, optimizer, x)
    return counter.get_total_flops()


def test_the_policy_keeps_what_the_flop_counter_counts():
    assert keep_matmuls(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert (
        keep_matmuls(None, aten._scaled_dot_product_efficient_attention.default) == CheckpointPolicy.MUST_SAVE
    )
    # PyTorch's table has CUDA's attention kernels, not the CPU's: recomputed, and counted 0 FLOPs
    cpu_attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert keep_matmuls(None, cpu_attention) == CheckpointPolicy.PREFER_RECOMPUTE
    assert keep_matmuls(None, aten.relu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert keep_matmuls(None, aten.native_layer_norm.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_blocks_checkpointed_selectively_fit_with_no_flops_recomputed_in_a_real_run():
    model, optimizer, x = found_job = job()
    found = memlab.plan(train_step, *found_job, budget="168 MiB", steps=STEPS)
    assert (found.fits, found.settings.selective) == (True, True)
    assert found.checkpointed == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert (found.recomputed_flops, found.extra_compute) == (0, 0.0)
    assert repr(found).splitlines()[0] == (
        "Plan for a budget of 168.00M: checkpoint 4 of 6 blocks selectively (layers.0 to layers.3): +0.0% "
        f"compute, +{found.extra_time:.1%} time on H100 (roofline)"
    )
    before = real_flops(model, optimizer, x)
    with found.apply(model):
        assert [is_checkpointed(layer) for layer in model.layers] == [True] * 4 + [False] * 2
        assert real_flops(model, optimizer, x) == before  # PyTorch's counter: nothing counted runs again
    model, optimizer, x = applied = job()
    with found.apply(model):
        real = tracked_steps(*applied, capacity="168 MiB")
    assert real == {"reserved": found.estimate.peak_reserved, "allocated": found.estimate.peak_allocated}
    model, optimizer, x = fewer = job()
    checkpoint(model.layers[:3], selective=True)
    with pytest.raises(torch.OutOfMemoryError):
        tracked_steps(*fewer, capacity="168 MiB")
    uncheckpoint(model.layers)
    assert not any(is_checkpointed(module) for module in model.modules())


def test_the_pasted_code_checkpoints_selectively():
    found = memlab.plan(train_step, *job(), budget="168 MiB", steps=STEPS)
    assert found.code == (
        "from memlab.plan.checkpointing import checkpoint\n"
        "checkpoint([model.get_submodule(name) for name in ['layers.0', 'layers.1', 'layers.2', "
        "'layers.3']], selective=True)"
    )
    model, _, _ = pasted = job()
    exec(found.code, {"model": model})
    assert tracked_steps(*pasted, capacity="168 MiB")["reserved"] == found.estimate.peak_reserved


def test_where_selective_checkpointing_of_every_block_does_not_fit_whole_blocks_are_checkpointed():
    found = memlab.plan(train_step, *job(), budget="120 MiB", steps=STEPS)
    assert (found.fits, found.settings.selective, len(found.checkpointed)) == (True, False, 5)
    assert (
        found.rejected["selective"]
        == "with every block checkpointed selectively the step needs 166.00M reserved"
    )
    assert found.recomputed_flops > 0


def test_of_selective_and_whole_blocks_that_fit_the_plan_takes_the_faster_by_the_roofline():
    """Under 168 MiB, 4 blocks selectively or 2 whole blocks fit; by the H100's roofline the selective
    plan is faster (it runs no matmul again), and the whole-block plan, planned alone, says so."""
    found = memlab.plan(train_step, *job(), budget="168 MiB", steps=STEPS)
    whole = memlab.plan(train_step, *job(), budget="168 MiB", steps=STEPS, knobs=("checkpointing",))
    assert (len(found.checkpointed), found.settings.selective) == (4, True)
    assert (len(whole.checkpointed), whole.settings.selective, whole.fits) == (2, False, True)
    assert found.extra_time < whole.extra_time
    assert found.rejected["checkpointing"] == (
        f"4 blocks checkpointed selectively: {found.extra_time:+.1%} time by the roofline; 2 blocks "
        f"checkpointed whole: {whole.extra_time:+.1%}"
    )
