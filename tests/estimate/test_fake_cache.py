"""memlab.estimate.fake_cache: the fake-tensor dispatch cache gives the storages an uncached call gives,
so an estimate's first call in a process counts what its later calls count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab
from memlab.estimate.fake_cache import FaithfulFakeTensorMode, shares_storage_unlike_cache

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]


def test_three_estimates_in_a_fresh_process_are_equal_byte_for_byte_and_event_for_event():
    # The LSTM's backward (mkldnn_rnn_layer_backward) returns its bias gradient twice; the first call
    # in the process (a cache miss) gave one storage for both, the later ones (hits) two.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = ROOT / "tests" / "estimate" / "fake_cache_steps.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(done.stdout)
    assert sorted(runs) == ["gru", "lstm", "transformer"]
    for name, (first, second, third) in runs.items():
        assert first["stats"] == second["stats"] == third["stats"], name
        assert first["events"] == second["events"] == third["events"], name
        assert any(action == "alloc" for action, _ in first["events"]), name


def test_outputs_sharing_a_storage_are_not_cached():
    x = torch.empty(4, device="meta")
    shared = torch.empty(3, device="meta")
    assert shares_storage_unlike_cache(aten.max.dim, (x, 0), (shared, shared)) == "outputs share a storage"
    view = x[:2]  # a non-view op whose output is a view of its input: a hit would make a new storage
    assert shares_storage_unlike_cache(aten.add.Tensor, (x, x), view) == "output shares an input's storage"


def test_in_place_results_views_and_fresh_outputs_are_cached():
    x = torch.empty(4, 2, device="meta")
    assert shares_storage_unlike_cache(aten.add_.Tensor, (x, x), x) is None  # the input itself
    assert shares_storage_unlike_cache(aten.split.Tensor, (x, 2), tuple(x.split(2))) is None  # views
    fresh = (torch.empty(4, device="meta"), torch.empty(4, device="meta"))
    assert shares_storage_unlike_cache(aten.max.dim, (x, 1), fresh) is None
    assert shares_storage_unlike_cache(aten.sum.default, (x,), None) is None


class BiasGradients(TorchDispatchMode):
    """Records, for each mkldnn_rnn_layer_backward, whether its two bias gradients share a storage."""

    def __init__(self) -> None:
        super().__init__()
        self.shared: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.mkldnn_rnn_layer_backward.default:
            self.shared.append(out[3].untyped_storage()._cdata == out[4].untyped_storage()._cdata)
        return out


def test_a_cache_hit_shares_storages_as_the_uncached_call_did():
    mode, seen = FaithfulFakeTensorMode(allow_non_fake_inputs=True), BiasGradients()
    with mode:
        lstm, x = torch.nn.LSTM(8, 8), torch.empty(5, 2, 8)
    with mode, seen:
        for _ in range(3):
            lstm(x)[0].sum().backward()
    assert seen.shared == [True, True, True]  # the meta kernel returns one tensor twice, every time


@pytest.mark.parametrize("shape", [(2, 3), (5, 1)])
def test_ordinary_ops_are_still_cached(shape):
    mode = FaithfulFakeTensorMode(allow_non_fake_inputs=True)
    before = FaithfulFakeTensorMode.cache_hits
    with mode:
        a = torch.empty(shape)
        for _ in range(3):
            (a * 2).relu()
    assert FaithfulFakeTensorMode.cache_hits >= before + 4  # the mul and relu of the 2nd and 3rd


# -- nested jagged tensors: their ragged size is a symbol of a ShapeEnv the mode takes on demand -------
def jagged_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    nested = torch.nested.nested_tensor([x[:30], x[:50]], layout=torch.jagged)
    loss = model(nested).values().pow(2).mean()
    loss.backward()
    return loss


def jagged_input(nested: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(nested, weight).values().sum()


def tracked(step, *arguments) -> dict[str, int]:
    """``step`` for real, the arguments counted first as an estimate counts them."""
    with memlab.TensorTracker() as tracker:
        for argument in arguments:
            tracker.adopt(roots=[argument])
        result = step(*arguments)
        stats = tracker.memory_stats()
    del result
    return {key: stats[key] for key in KEYS}


# Peaks: the total allocated differs by the 1 KiB of PyTorch's dummy nested tensor, a meta tensor
# that backward reads (_nested_get_jagged_dummy), counted on meta by a real run, with the rest here.
KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")


def test_a_step_that_makes_a_nested_jagged_tensor_is_estimated_as_it_runs():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(64, 64), torch.randn(80, 64)
    estimate = memlab.estimate(jagged_step, model, x)
    assert (estimate.method, estimate.forced_by, estimate.caveats) == ("fake", None, [])
    again = memlab.estimate(jagged_step, model, x)
    assert again.stats == estimate.stats  # PyTorch's dummy nested tensor is made outside the run
    assert model.weight.grad is None  # the user's model untouched
    expected = tracked(jagged_step, model, x)
    assert {key: estimate.stats[key] for key in KEYS} == expected
    assert expected["allocated_bytes.all.peak"] == 161_792  # ground truth: the tracked real run


def test_a_nested_jagged_tensor_given_to_the_step_is_estimated_as_it_runs():
    nested = torch.nested.nested_tensor([torch.randn(30, 64), torch.randn(50, 64)], layout=torch.jagged)
    weight = torch.randn(96, 64)
    estimate = memlab.estimate(jagged_input, nested, weight)
    assert estimate.method == "fake"
    assert {key: estimate.stats[key] for key in KEYS} == tracked(jagged_input, nested, weight)


def test_an_estimate_leaves_pytorchs_dummy_nested_tensor_real():
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nested._internal import nested_tensor

    memlab.estimate(
        jagged_input, torch.nested.nested_tensor([torch.randn(3, 4)], layout=torch.jagged), torch.eye(4)
    )
    dummy = nested_tensor._nt_view_dummy()
    assert not isinstance(dummy._values, FakeTensor) and dummy._values.device.type == "meta"
