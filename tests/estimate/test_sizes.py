"""memlab.estimate.sizes: a fake run counts the storages the real kernels of the mimicked device allocate,
a meta run those of the meta kernels (tests/estimate/test_zoo.py checks each correction on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memlab
from memlab._torch_version import torch_at_least
from memlab.estimate.kernels import CudaKernels
from memlab.estimate.sizes import CORRECTIONS, _onednn_workspace_nbytes

KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")


def lstm_step(model: nn.LSTM, x: torch.Tensor) -> torch.Tensor:
    out, _ = model(x)
    out.sum().backward()
    return out


def test_the_onednn_workspace_is_measured_once_per_layer_and_direction() -> None:
    torch.manual_seed(0)
    model, x = nn.LSTM(32, 64, num_layers=2, bidirectional=True), torch.randn(10, 4, 32)
    _onednn_workspace_nbytes.cache_clear()

    first = memlab.estimate(lstm_step, model, x)
    again = memlab.estimate(lstm_step, model, x)

    info = _onednn_workspace_nbytes.cache_info()
    assert (info.misses, info.hits) == (4, 4)  # 2 layers x 2 directions, measured in the first estimate
    assert first.stats == again.stats


def test_an_estimate_for_cuda_counts_no_onednn_workspace() -> None:
    """On CUDA an LSTM runs cuDNN, whose reserve the estimate names in a caveat: the CPU's oneDNN
    workspace is not counted, so the estimate equals a fake run tracked without corrections.

    FakeTensorMode's process-wide dispatch cache is off here: a cache hit gives the bias gradient
    that mkldnn_rnn_layer_backward's meta kernel returns twice two storages, the first call one."""
    torch.manual_seed(0)
    model, x = nn.LSTM(64, 256), torch.randn(24, 32, 64)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        on_cuda = memlab.estimate(lstm_step, model, x, device="cuda")
        on_cpu = memlab.estimate(lstm_step, model, x)
        with fake:
            fake_model, fake_x = nn.LSTM(64, 256), torch.empty(24, 32, 64)
        with fake, memlab.TensorTracker(model=fake_model) as tracker, CudaKernels():
            tracker.adopt(roots=[fake_model])
            tracker.adopt(roots=[fake_x])
            lstm_step(fake_model, fake_x)
            stats = tracker.memory_stats()

    assert {key: on_cuda.stats[key] for key in KEYS} == {key: stats[key] for key in KEYS}
    assert any("aten._cudnn_rnn" in caveat for caveat in on_cuda.caveats)
    assert on_cpu.tracker.real_sizes.applied == {"aten.mkldnn_rnn_layer", "aten.mkldnn_rnn_layer_backward"}
    assert on_cuda.tracker.real_sizes.applied == set()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_an_estimate_on_meta_counts_what_meta_kernels_allocate(reduction: str) -> None:
    """device="meta" mimics meta kernels: mse_loss's 0-dim loss has a 0-dim storage there, as a
    tracked run on meta tensors counts it (on CPU it keeps an input-sized one)."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(256, 256), torch.randn(1280, 256), torch.randn(1280, 256)

    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = F.mse_loss(model(x), y, reduction=reduction)
        out.sum().backward()
        return out

    on_meta = memlab.estimate(step, model, x, y, device="meta")
    meta_model, meta_x, meta_y = nn.Linear(256, 256, device="meta"), x.to("meta"), y.to("meta")
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[meta_model])
        tracker.adopt(roots=[meta_x, meta_y])
        out = step(meta_model, meta_x, meta_y)
        stats = tracker.memory_stats()
    del out

    assert on_meta.method == "meta"
    assert {key: on_meta.stats[key] for key in KEYS} == {key: stats[key] for key in KEYS}


def test_each_correction_says_what_differs_and_the_source_it_follows() -> None:
    names = [correction.name for correction in CORRECTIONS]
    assert len(names) == len(set(names))
    ops = [op for correction in CORRECTIONS for op in correction.ops]
    assert len(ops) == len(set(ops))  # one correction per op
    for correction in CORRECTIONS:
        assert correction.differs and correction.source.startswith(("aten/", "torch/"))
        assert set(correction.kernels) <= {"cpu", "cuda"}


def test_a_bfloat16_lstms_backward_rebuilt_as_the_cpu_kernel_matches_the_real_run(monkeypatch):
    # The CPU kernel returns float32 gradients for a bfloat16 LSTM (cast to bfloat16 afterwards);
    # torch 2.13's meta kernel says so, 2.11's gives bfloat16 ones, and there memlab rebuilds the
    # outputs as the CPU kernel makes them. That rebuild, forced on any torch, matches the real run
    # (the zoo's case tests the installed torch's own path).
    from memlab.estimate import sizes
    from tests.estimate.test_zoo import ZOO, tracked_run

    monkeypatch.setattr(sizes, "ONEDNN_BACKWARD_META_FIXED_SINCE", (99, 0))
    torch.manual_seed(0)
    step, module, *inputs = ZOO["lstm_no_bias_bfloat16"].build()
    estimate = memlab.estimate(step, module, *inputs)
    real = tracked_run(step, module, tuple(inputs))
    # the real run's peak: 528,384 B with torch 2.8.0's CPU kernel, 479,232 B from 2.9 on (2.11, 2.13)
    peak = 479_232 if torch_at_least(2, 9) else 528_384
    assert estimate.stats["allocated_bytes.all.peak"] == real["allocated_bytes.all.peak"] == peak
