"""The packaged example training script, profiled on the CPU with the numbers of a CUDA GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

import memlab
from memlab._gpus import GPUS
from memlab._torch_version import torch_at_least
from memlab.sources import workspaces

EXAMPLE = os.path.join(os.path.dirname(memlab.__file__), "examples", "train.py")


def test_the_example_prints_train_step_line_by_line_at_exit():
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--epochs", "1"], capture_output=True, text=True, check=True, timeout=300
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("epoch 1: loss ")
    # The model (6 storages) and the data (4 batches of inputs and targets) exist before the first
    # call: adopted, as a GPU's numbers would include them.
    # Where cuBLASLt keeps its own workspace (torch 2.11's default: memlab.sources.workspaces), the
    # forward's bias addmm adds its 1 MiB workspace, in a 2 MiB segment of its own, to every line.
    # (torch 2.8's is per call: not kept, see below)
    own_lt = workspaces.keeps_own_cublaslt()
    header = (
        "3 modelled cuBLAS/cuBLASLt workspaces of the H100: 65.00M"
        if own_lt
        else ("2 modelled cuBLAS workspaces of the H100: 64.00M")
    )
    assert lines[1] == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        f"(memlab.TensorTracker); 14 tensor storages (6.55M) existed before profiling; includes {header}"
    )

    per_call = not torch_at_least(2, 9) and workspaces.workspace_sizes(GPUS["H100"]).cublaslt > 0
    reserved = 108 if per_call else 106 + 2 * own_lt

    def row(allocated: float, line: int) -> list[str]:
        return [f"{allocated + own_lt:.2f}M", f"{reserved:.2f}M", str(line)]

    # Weights, gradients and both AdamW moments (4 x 6.1 MiB) plus the data are alive at entry
    # once a step has run, and the modelled H100's two 32 MiB cuBLAS workspaces (forward's thread's,
    # the autograd thread's); AdamW's temporaries make optimizer.step() the peak. Torch 2.8 reserves
    # 2 MiB more: the small-pool segment of its per-call 1 MiB cuBLASLt workspace (the Linears' addmm).
    # model(inputs) peaks at 84.15M there: during a Linear's cuBLASLt call, with its 1 MiB workspace.
    forward = 84.15 if per_call else 83.40
    assert [(line[:32].split(), line[34:].strip()) for line in lines[8:]] == [
        (["37"], "@memlab.profile"),
        (
            row(88.69, 38),
            "def train_step(model: nn.Module, optimizer: Optimizer, inputs: Tensor, targets: Tensor)"
            " -> float:",
        ),
        (row(88.69, 39), "optimizer.zero_grad(set_to_none=True)"),
        (row(forward, 40), "logits = model(inputs)"),
        (row(83.15, 41), "loss = nn.functional.cross_entropy(logits, targets)"),
        (row(88.95, 42), "loss.backward()"),
        (row(96.70, 43), "optimizer.step()"),
        (row(88.70, 44), "return loss.item()"),
    ]


@pytest.mark.cuda
def test_on_a_gpu_the_modelled_numbers_per_line_match_the_gpus_own():
    """The packaged example's train_step on a GPU, profiled twice at once: by the GPU's own
    statistics (``source="cuda"``) and by a TensorTracker attached to the same run, which replays
    the same CUDA tensors through the allocator model.

    What differs, and why: cuBLAS allocates its workspaces through the caching allocator at the
    first matmul of each thread (the forward's, the autograd engine's), outside the dispatcher, so
    the GPU counts them and a tracker attached to a GPU run does not model them; they stay
    allocated, so from the second step on the GPU's allocated bytes exceed the model's by the same
    amount on every line. Nothing else may differ.
    """
    from memlab.examples import train

    device = torch.device("cuda", 0)
    columns = ("allocated_bytes.all.peak",)
    with torch.device(device):
        torch.manual_seed(0)
        model = train.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = torch.randn(train.BATCH_SIZE, train.FEATURES)
        targets = torch.randint(0, train.CLASSES, (train.BATCH_SIZE,))
        step = train.train_step.__wrapped__
        with memlab.TensorTracker(adopt=True) as tracker:
            gpu = memlab.LineProfiler(step, target_gpu=device, source="cuda", columns=columns)
            modelled = memlab.LineProfiler(step, target_gpu=device, source=tracker, columns=columns)
            for _ in range(3):
                with gpu, modelled:
                    step(model, optimizer, inputs, targets)
    measured = [row[0] for row in gpu.to_dataframe(step, columns).itertuples(index=False)]
    replayed = [row[0] for row in modelled.to_dataframe(step, columns).itertuples(index=False)]
    gaps = [m - r for m, r in zip(measured, replayed, strict=True) if not pd.isna(m)]
    assert all(gap >= 0 for gap in gaps), (measured, replayed)
    assert len(set(gaps[1:])) == 1, (measured, replayed)  # the workspace, the same on every line
