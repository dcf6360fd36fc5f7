"""The first line of every output says when its numbers include modelled cuBLAS workspaces."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.sources.select import describe_source
from memlab.sources.workspace_note import (
    ModelledWorkspaces,
    snapshot_workspaces,
    tracker_workspaces,
    with_note,
    workspaces_note,
)

MiB = 2**20
CPU = torch.device("cpu")


def matmul_and_backward(tracker_kwargs=None):
    """A matmul and its backward under a tracker modelling an H100: the forward's thread and the
    autograd engine's take one cuBLAS workspace each (32 MiB on sm90, CublasHandlePool.cpp)."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    with memlab.TensorTracker(gpu="H100", **(tracker_kwargs or {})) as tracker:
        (x @ w).sum().backward()
    return tracker


def test_the_sentence_names_count_kind_gpu_and_bytes():
    assert workspaces_note(None) is None
    assert workspaces_note(ModelledWorkspaces(2, 64 * MiB, "H100")) == (
        "includes 2 modelled cuBLAS workspaces of the H100: 64.00M"
    )
    assert workspaces_note(ModelledWorkspaces(1, 8_519_680, "A100")) == (
        "includes 1 modelled cuBLAS workspace of the A100: 8.12M"
    )
    assert workspaces_note(ModelledWorkspaces(3, 65 * MiB, None, cublaslt=1)) == (
        "includes 3 modelled cuBLAS/cuBLASLt workspaces: 65.00M"
    )
    assert workspaces_note(ModelledWorkspaces(1, MiB, "H100", cublaslt=1)) == (
        "includes 1 modelled cuBLASLt workspace of the H100: 1.00M"
    )
    assert with_note("peak 2.00M", None) == "peak 2.00M"


def test_a_tracked_matmul_and_its_backward_say_two_workspaces_in_the_first_line():
    tracker = matmul_and_backward()
    assert tracker_workspaces(tracker) == ModelledWorkspaces(2, 64 * MiB, "H100")
    assert tracker_workspaces(tracker, CPU) == ModelledWorkspaces(2, 64 * MiB, "H100")
    assert tracker_workspaces(tracker, torch.device("meta")) is None  # none on another device
    assert describe_source(tracker, CPU) == (
        "modelled: CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); tensors made "
        "before the tracker was entered are not counted; includes 2 modelled cuBLAS workspaces of the "
        "H100: 64.00M"
    )


def test_cublas_workspace_config_0_0_turns_them_off(monkeypatch):
    with_workspaces = matmul_and_backward().max_memory_reserved()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    tracker = matmul_and_backward()
    assert tracker_workspaces(tracker) is None
    assert "workspace" not in describe_source(tracker, CPU)
    assert with_workspaces - tracker.max_memory_reserved() == 64 * MiB


def test_nothing_is_said_without_a_matmul_or_without_a_gpu_model():
    with memlab.TensorTracker(gpu="H100") as tracker:
        torch.randn(64, 64).sum()
    assert tracker_workspaces(tracker) is None
    assert "workspace" not in describe_source(tracker, CPU)
    with memlab.TensorTracker(allocator=None) as exact:
        torch.randn(8, 16) @ torch.randn(16, 4)
    assert tracker_workspaces(exact) is None
    assert "workspace" not in describe_source(exact, CPU)


@pytest.mark.parametrize(("gpu", "each"), [("H100", 32 * MiB), ("A100", 8_519_680)])
def test_a_snapshot_names_the_workspaces_of_its_trace(gpu, each):
    tracker = matmul_and_backward({"history": True})
    with memlab.TensorTracker(gpu=gpu, history=True) as other:
        torch.randn(8, 16) @ torch.randn(16, 4)
    assert snapshot_workspaces(tracker.snapshot()) == ModelledWorkspaces(2, 64 * MiB, None)
    assert snapshot_workspaces(other.snapshot()) == ModelledWorkspaces(1, each, None)
    assert snapshot_workspaces({"segments": [], "device_traces": [[]]}) is None
