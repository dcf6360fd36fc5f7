"""Step remedies: the micro-batch from max_batch_size, autocast and activation checkpointing, each
an estimate of the failing step."""

from __future__ import annotations

import gc
import importlib
import io

import pytest
import torch

import memlab
from memlab.oom.capture import Call
from memlab.oom.step import find_batch
from memlab.plan.checkpointing import candidate_blocks, checkpoint, uncheckpoint

MIB = 1 << 20
#: 80 MiB for tensors, and the two 32 MiB cuBLAS workspaces of the H100 the tracker models (the
#: forward's thread's and the autograd thread's), each a segment of its own.
WORKSPACES = 64 * MIB
CAPACITY = 80 * MIB + WORKSPACES


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


def _failing_step(remedies: bool = True) -> tuple[memlab.oom.OOMReport, memlab.TensorTracker, tuple]:
    """A step at batch 4096 out of memory in 80 MiB; the report, the tracker and what is live right
    after the failure."""
    torch.manual_seed(0)
    watched = memlab.explain_oom(train_step, stream=io.StringIO(), remedies=remedies)
    tracker = memlab.TensorTracker(capacity=CAPACITY, history=True)
    with tracker:
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4096, 1024), torch.randn(4096, 1024)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, x, y)
    gc.collect()
    return memlab.oom.last_report(), tracker, (model, optimizer, x, y)


def _accumulate(tracker, model, optimizer, x, y, micro: int) -> int:
    """Two optimizer steps over micro-batches of ``micro`` rows (views of the batch) with gradient
    accumulation, under ``tracker``; the peak reserved bytes from now on."""
    steps = -(-len(x) // micro)
    tracker.reset_peak_memory_stats()
    with tracker:
        for _ in range(2):
            for part, part_y in zip(x.split(micro), y.split(micro), strict=True):
                (((model(part) - part_y) ** 2).mean() / steps).backward()
            optimizer.step()
            optimizer.zero_grad()
    return tracker.max_memory_reserved()


def test_the_micro_batch_remedy_is_the_largest_whose_accumulated_steps_fit_from_the_state_at_the_failure():
    report, tracker, live = _failing_step()
    assert report.verdict == "shortage"
    remedy = next(r for r in report.remedies if r.kind == "micro_batch")
    assert remedy.details == {
        "micro_batch": 167,
        "batch": 4096,
        "accumulation_steps": 25,
        "largest_fitting": 167,
    }
    assert remedy.action == "micro-batches of 167 (of 4096), 25 accumulation steps"
    assert (remedy.peak_reserved, remedy.fits, remedy.unsure) == (142 * MIB, True, None)
    # applied right after the failure, with the 32 MiB batch and the forward's workspace (allocated
    # in the failing call) still live: the estimated peak
    assert _accumulate(tracker, *live, micro=167) == 142 * MIB


def test_the_next_micro_batch_and_one_estimated_from_an_empty_allocator_run_out_of_memory_when_applied():
    _, _, (model, optimizer, x, y) = _failing_step(remedies=False)
    # max_batch_size counts the step's own micro-batch, not the batch the process still holds
    fit = memlab.max_batch_size(
        train_step, lambda b: (model, optimizer, x[:b].clone(), y[:b].clone()), budget=CAPACITY, high=4096
    )
    assert fit.batch_size == 1024
    for micro in (171, 1024):
        _, tracker, live = _failing_step(remedies=False)
        with pytest.raises(torch.OutOfMemoryError):
            _accumulate(tracker, *live, micro=micro)


def test_the_bf16_and_checkpointing_remedies_are_two_steps_estimated_from_the_state_at_the_failure():
    report, tracker, (model, optimizer, x, y) = _failing_step()
    assert [type(block) for _, block in candidate_blocks(model)] == [Block] * 4
    remedies = {r.kind: r for r in report.remedies}
    assert remedies["autocast_bf16"].action == 'torch.autocast("cpu", torch.bfloat16) (bf16)'
    assert [r.kind for r in report.remedies if r.kind.startswith("autocast")] == ["autocast_bf16"]
    names = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]  # none fits: the count that needs the least
    assert remedies["checkpointing"].details == {
        "block": "Block",
        "blocks": 4,
        "checkpointed": names,
        "transformers": False,
    }
    assert remedies["checkpointing"].action == "checkpoint 4 of the 4 Block blocks (blocks.0 to blocks.3)"
    # neither fits; what each would need, from that state and without a limit
    assert (remedies["autocast_bf16"].peak_reserved, remedies["autocast_bf16"].fits) == (266 * MIB, False)
    assert (remedies["checkpointing"].peak_reserved, remedies["checkpointing"].fits) == (246 * MIB, False)
    blocks = [model.get_submodule(name) for name in remedies["checkpointing"].details["checkpointed"]]
    checkpoint(blocks)
    tracker.reset_peak_memory_stats()
    try:
        with tracker, pytest.raises(torch.OutOfMemoryError):
            train_step(model, optimizer, x, y)
    finally:
        uncheckpoint(blocks)


def test_remedies_are_listed_in_order_each_with_its_number():
    report, _, _ = _failing_step()
    assert [r.kind for r in report.remedies] == ["micro_batch", "autocast_bf16", "checkpointing"]
    lines = report.text().splitlines()
    start = lines.index("remedies (predicted peak reserved, capacity 144.00M):")
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


def test_step_remedies_model_the_gpu_of_the_tracker_that_failed(monkeypatch):
    estimate_module = importlib.import_module("memlab.estimate.estimate")  # memlab.estimate is the function
    modelled = []
    original = estimate_module.run_estimate

    def recording(*args, **kwargs):
        estimate = original(*args, **kwargs)
        modelled.append((estimate.gpu.name, estimate.tracker.workspaces.sizes.cublas))
        return estimate

    monkeypatch.setattr(estimate_module, "run_estimate", recording)
    watched = memlab.explain_oom(train_step, stream=io.StringIO())
    with memlab.TensorTracker(capacity="80 MiB", history=True, gpu="A100"):
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4096, 1024), torch.randn(4096, 1024)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, x, y)
    assert memlab.oom.last_report().remedies
    assert modelled and set(modelled) == {("A100", 4096 * 1024 * 2 + 16 * 1024 * 8)}
