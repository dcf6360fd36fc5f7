"""``Estimate.by_module()``: memory per module from a data-free run, as a tracked real run gives it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memlab


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def training() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128))
    return model, torch.optim.Adam(model.parameters()), torch.randn(64, 128)


def test_estimate_by_module_equals_a_tracked_real_run() -> None:
    model, optimizer, x = training()
    estimated = memlab.estimate(step, model, optimizer, x, steps=2).by_module()
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state  # untouched
    with memlab.TensorTracker(model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model, optimizer, x])
        for _ in range(2):
            step(model, optimizer, x)
    measured = tracker.by_module()
    assert estimated.equals(measured), estimated.compare(measured)
    assert list(estimated.index) == ["", "0", "1", "2"]
    # the CUDA allocator model's blocks: weight 256 KiB, bias 2 KiB; two Adam moments and a step counter each
    assert estimated.loc["0", ["parameter", "optimizer_state", "activation"]].tolist() == [
        262144 + 2048,
        2 * (262144 + 2048) + 2 * 512,
        64 * 128 * 4,
    ]
    assert estimated["calls"].tolist() == [2, 2, 2, 2]


def test_estimate_names_the_target_device() -> None:
    model, optimizer, x = training()
    estimate = memlab.estimate(step, model, optimizer, x, device="cuda")
    assert estimate.modules is not None
    assert estimate.modules.text().splitlines()[0] == "memory per module on cuda, highest peak first"


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def test_an_estimate_without_modules_has_no_table() -> None:
    estimate = memlab.estimate(product, torch.randn(8, 8), torch.randn(8, 8))
    assert estimate.modules is None
    with pytest.raises(
        ValueError, match=r"by_module: the estimated call product used no torch.nn.Module \(none"
    ):
        estimate.by_module()
