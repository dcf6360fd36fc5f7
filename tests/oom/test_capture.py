"""What a capture names: the largest tensors at an OOM inside a ``with LineProfiler(f):`` block,
where no call's arguments say which model is which."""

from __future__ import annotations

import types

import pytest
import torch

import memlab
from tests.oom.test_explain import _clean  # noqa: F401 (autouse: a collected heap, an OOM folder, no watch left)

MIB = 1 << 20
WEIGHT_ROW = "  weight                           parameter          16.00M"


def forward(model, x):
    return model(x)


def overflow():
    return torch.empty(8 * MIB // 4)


def test_a_model_the_tracker_knows_names_its_weight(capsys):
    lp = memlab.LineProfiler(forward)
    with memlab.TensorTracker(capacity="20 MiB") as tracker:
        holder = types.SimpleNamespace(model=torch.nn.Linear(2048, 2048, bias=False))  # no local holds it
        tracker.add_model(holder.model)
        with pytest.raises(torch.OutOfMemoryError), lp:
            overflow()
    largest = memlab.oom.last_report().culprits[0]
    assert (largest.name, largest.category, largest.size) == ("weight", "parameter", 16 * MIB)
    assert WEIGHT_ROW in capsys.readouterr().err.splitlines()


def test_a_model_a_local_of_the_stack_holds_names_its_weight(capsys):
    lp = memlab.LineProfiler(forward)
    with memlab.TensorTracker(capacity="20 MiB"):
        model = torch.nn.Linear(2048, 2048, bias=False)  # a 16 MiB weight
        with pytest.raises(torch.OutOfMemoryError), lp:
            overflow()
    largest = memlab.oom.last_report().culprits[0]
    assert (largest.name, largest.category, largest.size) == ("weight", "parameter", 16 * MIB)
    assert WEIGHT_ROW in capsys.readouterr().err.splitlines()
    assert model.weight.shape == (2048, 2048)
