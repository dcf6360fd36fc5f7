"""SnapshotDiff: what appeared, disappeared, grew or shrank between two snapshots."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from memlab import MemReporter
from memlab.reporter import SnapshotDiff, TensorRecord, TensorSnapshot


def _training_step(model: nn.Module, optimizer: torch.optim.Optimizer, leaked: list | None) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(torch.ones(8, 16))
    out.pow(2).mean().backward()
    optimizer.step()
    if leaked is not None:
        leaked.append(out.detach())


def test_snapshot_diff_over_one_leaking_step_names_exactly_the_leaked_tensor():
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    reporter = MemReporter(model, pre_collect=True)
    reporter.add_optimizer(optimizer)
    leaked: list[torch.Tensor] = []
    _training_step(model, optimizer, None)  # gradients and optimizer state now exist
    before = reporter.snapshot()
    _training_step(model, optimizer, leaked)
    diff = reporter.diff(before)
    assert len(diff.entries) == 1
    entry = diff.appeared[0]
    assert (entry.device, entry.category, entry.shape, entry.before, entry.after) == (
        "cpu",
        "unknown",
        (8, 4),
        0,
        128,
    )
    assert re.fullmatch(r"Tensor\d+", entry.name)
    assert diff.disappeared == diff.grew == diff.shrank == []
    text = str(diff)
    assert re.search(rf"^appeared\s+{entry.name}\s+\(8, 4\)\s+0\.00B\s+128\.00B\s+\+128\.00B$", text, re.M)
    assert text.splitlines()[-2:] == [
        "Appeared: 1  Disappeared: 0  Grew: 0  Shrank: 0  Used Memory change: +128.00B",
        "sizes: storage bytes found through gc (memlab.MemReporter)",
    ]
    after = reporter.snapshot()
    leaked.clear()
    gone = reporter.diff(after)
    assert [(e.change, e.name, e.delta) for e in gone.entries] == [("disappeared", entry.name, -128)]


def test_snapshot_diff_reports_growth_of_the_same_tensor():
    buffer = torch.zeros(10)
    reporter = MemReporter(pre_collect=True)
    before = reporter.snapshot()
    buffer.resize_(1000)
    diff = reporter.diff(before)
    assert [(e.change, e.before, e.after, e.delta) for e in diff.entries] == [("grew", 40, 4000, 3960)]
    frame = diff.to_dataframe()
    assert list(frame.columns) == [
        "change",
        "device",
        "name",
        "category",
        "shape",
        "before",
        "after",
        "delta",
    ]
    assert list(frame["shape"]) == [(1000,)]


def test_snapshots_that_count_bytes_differently_are_not_compared():
    before = TensorSnapshot((TensorRecord("x", "unknown", "cpu", (1,), "float32", 4, 4),))
    after = TensorSnapshot(
        (TensorRecord("x", "unknown", "cpu", (1,), "float32", 4, 512),), device_model="cuda"
    )
    with pytest.raises(ValueError) as raised:
        SnapshotDiff.between(before, after)
    assert str(raised.value) == (
        "cannot compare a snapshot taken with device_model=None with one taken with "
        "device_model='cuda': they count bytes differently"
    )


def test_a_modelled_diff_says_so_in_its_last_line():
    before = TensorSnapshot(
        (TensorRecord("x", "unknown", "meta", (1,), "float32", 4, 512),), device_model="cuda"
    )
    grown = TensorRecord("x", "unknown", "meta", (200,), "float32", 800, 1024)
    diff = SnapshotDiff.between(before, TensorSnapshot((grown,), device_model="cuda"))
    assert [(e.change, e.before, e.after) for e in diff.entries] == [("grew", 512, 1024)]
    assert diff.render().splitlines()[-2:] == [
        "Appeared: 0  Disappeared: 0  Grew: 1  Shrank: 0  Used Memory change: +512.00B",
        "sizes: as the CUDA caching allocator would round them (modelled from meta tensors)",
    ]
