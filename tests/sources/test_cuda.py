"""CudaSource: a thin reader of the real GPU's statistics. GPU tests are marked ``cuda``."""

from __future__ import annotations

import pytest
import torch

from memlab.sources.base import MemorySource
from memlab.sources.cuda import CudaSource, cuda_device_exists


def test_cpu_and_meta_are_not_cuda_devices():
    assert cuda_device_exists(torch.device("cpu")) is False
    assert cuda_device_exists(torch.device("meta")) is False


def test_unknown_key_is_rejected_before_touching_cuda():
    with pytest.raises(ValueError, match=r"unknown statistic 'bytes\.peak'; valid keys are: "):
        CudaSource().sampler(["bytes.peak"])


def test_device_forms_are_normalized():
    assert CudaSource(1).device == torch.device("cuda", 1)
    assert CudaSource("cuda").device == torch.device("cuda", 0)
    assert CudaSource().device is None
    assert isinstance(CudaSource(), MemorySource)


@pytest.mark.cuda
def test_linear_100_on_a_gpu():
    source = CudaSource(0)
    sample = source.sampler(["active_bytes.all.peak"])
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats(0)["active_bytes.all.current"]  # what earlier tests left
    layer = torch.nn.Linear(100, 100).cuda()
    assert sample() == (before + 40960,)
    del layer


@pytest.mark.cuda
def test_memory_stats_match_torch():
    source = CudaSource(0)
    x = torch.empty(1000, device="cuda")
    assert source.memory_stats()["allocated_bytes.all.current"] == torch.cuda.memory_allocated(0)
    del x


@pytest.mark.cuda
def test_snapshot_is_pytorchs_own_with_the_recorded_history():
    torch.cuda.memory._record_memory_history()
    try:
        x = torch.empty(1024, device="cuda")
        snapshot = CudaSource().snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    blocks = [b for s in snapshot["segments"] for b in s["blocks"] if b["address"] == x.data_ptr()]
    assert [(b["size"], b["state"]) for b in blocks] == [(4096, "active_allocated")]
    assert sum(s["total_size"] for s in snapshot["segments"]) == torch.cuda.memory_reserved()
