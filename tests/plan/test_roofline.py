"""The roofline time :class:`memlab.plan.flops.FlopCount` adds up, op by op, against the GPU
table's peaks computed by hand; and a plan's roofline time against that of a real run of the
applied step under the same counter."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab._gpus import GPUS
from memlab.plan.flops import Cost, FlopCount
from tests.plan.test_planner import BUDGET, STEPS, make_model, train_step

H100 = GPUS["H100"]


def counted(fn, gpu=H100) -> Cost:
    with FlopCount(gpu) as counter:
        fn()
    return counter.cost


@pytest.fixture
def square():
    torch.manual_seed(0)
    return torch.randn(2048, 2048), torch.randn(2048, 2048)


def test_a_float32_matmul_is_compute_bound_at_the_float32_peak(square):
    a, b = square
    cost = counted(lambda: a @ b)
    assert cost == Cost(2 * 2048**3, 2 * 2048**3 / 67e12)  # 256 us; its 48 MiB move in 15 us


def test_tf32_and_bf16_matmuls_run_at_the_tensor_cores_peak(square):
    a, b = square
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert counted(lambda: a @ b).seconds == 2 * 2048**3 / (989.4e12 / 2)
    finally:
        torch.set_float32_matmul_precision(before)
    a, b = a.bfloat16(), b.bfloat16()
    assert counted(lambda: a @ b).seconds == 2 * 2048**3 / 989.4e12


def test_an_elementwise_op_is_memory_bound_and_a_view_moves_nothing(square):
    a, b = square
    assert counted(lambda: a + b) == Cost(0, 3 * 2048 * 2048 * 4 / 3350e9)
    assert counted(lambda: a.view(-1).t() if a.dim() == 1 else a.view(-1)) == Cost(0, 0.0)


def test_a_gpu_without_known_peaks_has_no_roofline(square):
    a, b = square
    assert counted(lambda: a @ b, GPUS["A10G"]) == Cost(2 * 2048**3, None)
    assert counted(lambda: a @ b, None) == Cost(2 * 2048**3, None)


def test_a_plans_roofline_time_is_a_real_run_s():
    """The plan's time and that of the step as it is are the roofline of its last estimated step:
    the same sum as a counter around the second step of a real run, as it is and applied."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(1)
    x = torch.randn(32, 256, 128)
    found = memlab.plan(train_step, model, optimizer, x, budget=BUDGET, steps=STEPS)

    def second_step() -> Cost:
        train_step(model, optimizer, x)
        return counted(lambda: train_step(model, optimizer, x))

    as_it_is = second_step()
    with found.apply(model):
        applied = second_step()
    assert (found.baseline_seconds, found.seconds) == (as_it_is.seconds, applied.seconds)
    assert found.extra_time == applied.seconds / as_it_is.seconds - 1 > 0
    assert repr(found).splitlines()[0] == (
        f"Plan for a budget of 257.50M: checkpoint 4 of 6 blocks (layers.0 to layers.3): +22.5% compute, "
        f"+{found.extra_time:.1%} time on H100 (roofline)"
    )
