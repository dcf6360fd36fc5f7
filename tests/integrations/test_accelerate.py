"""accelerate: models and optimizers from ``Accelerator.prepare`` estimate as plain ones do, equal to a
tracked real run, and are left untouched."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.history import categories

accelerate = pytest.importorskip("accelerate")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")


@pytest.fixture(autouse=True)
def _fresh_state():
    """accelerate keeps one process-wide state; each test makes its own ``Accelerator``."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_prepared_model_and_optimizer_estimate_as_a_tracked_run(mixed_precision):
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(32, 64), torch.randint(0, 10, (32,))), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    x, y = next(iter(loader))

    def step(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        return loss

    state = [p.detach().clone() for p in model.parameters()]
    estimate = memlab.estimate(step, model, optimizer, x, y, device="cpu", steps=2)

    assert estimate.method == "fake"
    assert all(torch.equal(a, b) for a, b in zip(state, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x, y], category=categories.INPUT)
        for _ in range(2):
            loss = step(model, optimizer, x, y)
        stats = tracker.memory_stats()
    del loss
    assert {key: estimate.stats[key] for key in KEYS} == {key: stats[key] for key in KEYS}
