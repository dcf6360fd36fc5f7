"""Step remedies: the micro-batch from max_batch_size, autocast and activation checkpointing, each
an estimate of the failing step."""

from __future__ import annotations

import gc
import io

import pytest
import torch

import memlab
from memlab.oom.capture import Call
from memlab.oom.step import checkpointed, find_batch, repeated_blocks

MIB = 1 << 20
CAPACITY = "80 MiB"


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    gc.collect()
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(1024, 1024)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def train_step(model, optimizer, x, y):
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _failing_step(batch: int = 4096) -> tuple[memlab.oom.OOMReport, tuple]:
    torch.manual_seed(0)
    watched = memlab.explain_oom(train_step, stream=io.StringIO())
    with memlab.TensorTracker(capacity=CAPACITY, history=True):
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, x, y)
    return memlab.oom.last_report(), (model, optimizer, x, y)


def test_a_shortage_in_a_training_step_gets_the_micro_batch_max_batch_size_finds():
    report, (model, optimizer, x, y) = _failing_step()
    assert report.verdict == "shortage"
    fit = memlab.max_batch_size(
        train_step, lambda b: (model, optimizer, x[:b].clone(), y[:b].clone()), budget=CAPACITY, high=4096
    )
    remedy = next(r for r in report.remedies if r.kind == "micro_batch")
    micro = fit.batch_size
    assert 0 < micro < 4096
    assert remedy.details == {
        "micro_batch": micro,
        "batch": 4096,
        "accumulation_steps": -(-4096 // micro),
        "largest_fitting": micro,
    }
    assert remedy.peak_reserved == fit.estimate.peak_reserved
    assert remedy.fits
    assert remedy.action == f"micro-batches of {micro} (of 4096), {-(-4096 // micro)} accumulation steps"
    # the step at that micro-batch runs under the same capacity
    with memlab.TensorTracker(capacity=CAPACITY) as tracker:
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = train_step(model, optimizer, torch.randn(micro, 1024), torch.randn(micro, 1024))
    assert loss.shape == ()
    assert tracker.max_memory_reserved() <= 80 * MIB


def test_the_bf16_remedy_is_the_estimate_of_the_step_under_autocast():
    report, (model, optimizer, x, y) = _failing_step()
    with torch.autocast("cpu", torch.bfloat16):
        expected = memlab.estimate(train_step, model, optimizer, x, y).peak_reserved
    remedy = next(r for r in report.remedies if r.kind == "autocast_bf16")
    assert remedy.peak_reserved == expected
    assert remedy.action == 'torch.autocast("cpu", torch.bfloat16) (bf16)'
    assert [r.kind for r in report.remedies if r.kind.startswith("autocast")] == ["autocast_bf16"]


def test_the_checkpointing_remedy_is_the_estimate_with_the_repeated_blocks_checkpointed():
    report, (model, optimizer, x, y) = _failing_step()
    assert repeated_blocks(model) == (Block, 4)
    with checkpointed(Block):
        expected = memlab.estimate(train_step, model, optimizer, x, y).peak_reserved
    assert Block.forward is Block.__dict__["forward"]  # restored
    remedy = next(r for r in report.remedies if r.kind == "checkpointing")
    assert remedy.peak_reserved == expected
    assert remedy.details == {"block": "Block", "blocks": 4}
    assert remedy.action == "activation checkpointing of the 4 Block blocks"


def test_remedies_are_listed_in_order_each_with_its_number():
    report, _ = _failing_step()
    assert [r.kind for r in report.remedies] == ["micro_batch", "autocast_bf16", "checkpointing"]
    lines = report.text().splitlines()
    start = lines.index("remedies (predicted peak reserved, capacity 80.00M):")
    for remedy, line in zip(report.remedies, lines[start + 1 : start + 4], strict=True):
        assert line.startswith(f"  {remedy.action}")
        assert line.endswith(
            f"{memlab._units.format_size(remedy.peak_reserved)}  "
            + ("fits" if remedy.fits else "does not fit")
        )


def test_find_batch_takes_the_size_most_batch_tensors_share():
    x, y, mask = torch.zeros(8, 3), torch.zeros(8), torch.zeros(5, 8)
    assert find_batch(Call(train_step, (torch.nn.Linear(2, 2), x, y, mask), {}, 0)) == (8, 0)
    assert find_batch(Call(train_step, (x,), {"mask": mask}, 0, batch_dim=1)) == (3, 1)
    assert find_batch(Call(train_step, (torch.nn.Linear(2, 2), 3), {}, 0)) is None


def test_no_step_no_step_remedies():
    with memlab.explain_oom(stream=io.StringIO()) as watch, memlab.TensorTracker(capacity="40 MiB"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(48 * MIB // 4)
    assert watch.report.remedies == ()
