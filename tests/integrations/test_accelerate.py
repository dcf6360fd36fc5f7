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


def blocks(tensors) -> int:
    """Bytes the CUDA caching allocator gives these tensors' distinct storages (512 B blocks)."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-nbytes // 512) * 512 for nbytes in storages.values())


@pytest.mark.parametrize("how", ["constructor", "add_optimizer", "add_optimizer_while_active"])
def test_a_prepared_optimizer_registers_with_the_tracker_and_its_state_is_categorised(how):
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(64, 64)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    x = torch.randn(8, 64)

    tracker = memlab.TensorTracker(history=True, optimizer=optimizer if how == "constructor" else None)
    if how == "add_optimizer":
        tracker.add_optimizer(optimizer)
    with tracker:
        if how == "add_optimizer_while_active":
            tracker.add_optimizer(optimizer)
        accelerator.backward(model(x).sum())
        optimizer.step()

    assert tracker.optimizers == [optimizer.optimizer]  # the AdamW it wraps, whose step hooks fire
    state = [t for per_param in optimizer.optimizer.state.values() for t in per_param.values()]
    # exp_avg and exp_avg_sq of the weight (16 KiB each) and the bias (256 B -> 512 B), two steps
    assert (
        tracker.by_category(at="now")[categories.OPTIMIZER_STATE]
        == blocks(state)
        == 2 * (16384 + 512) + 2 * 512
    )


def test_a_lightning_optimizer_is_unwrapped_and_anything_else_is_a_type_error():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from memlab._tensors import unwrap_optimizer

    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert unwrap_optimizer(LightningOptimizer(inner)) is inner
    assert unwrap_optimizer(inner) is inner
    with pytest.raises(TypeError) as error:
        memlab.TensorTracker(optimizer=torch.nn.Linear(2, 2))
    assert str(error.value) == (
        "optimizer must be a torch.optim.Optimizer (e.g. torch.optim.AdamW) or an object that wraps one "
        "as .optimizer (accelerate's AcceleratedOptimizer) or ._optimizer (Lightning's LightningOptimizer), "
        "got Linear Linear(in_features=2, out_features=2, bias=True)"
    )
