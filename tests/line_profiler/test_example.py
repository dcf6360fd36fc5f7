"""The packaged example training script, profiled on the CPU with the numbers of a CUDA GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import memlab

EXAMPLE = os.path.join(os.path.dirname(memlab.__file__), "examples", "train.py")


def test_the_example_prints_train_step_line_by_line_at_exit():
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--epochs", "1"], capture_output=True, text=True, check=True, timeout=300
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("epoch 1: loss ")
    # The model (6 storages) and the data (4 batches of inputs and targets) exist before the first
    # call: adopted, as a GPU's numbers would include them.
    assert lines[1] == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        "(memlab.TensorTracker); 14 tensor storages (6.55M) existed before profiling"
    )
    # Weights, gradients and both AdamW moments (4 x 6.1 MiB) plus the data are alive at entry
    # once a step has run; AdamW's temporaries make optimizer.step() the peak.
    assert [(line[:32].split(), line[34:].strip()) for line in lines[8:]] == [
        (["37"], "@memlab.profile"),
        (
            ["24.69M", "42.00M", "38"],
            "def train_step(model: nn.Module, optimizer: Optimizer, inputs: Tensor, targets: Tensor)"
            " -> float:",
        ),
        (["24.69M", "42.00M", "39"], "optimizer.zero_grad(set_to_none=True)"),
        (["19.40M", "42.00M", "40"], "logits = model(inputs)"),
        (["19.15M", "42.00M", "41"], "loss = nn.functional.cross_entropy(logits, targets)"),
        (["24.95M", "42.00M", "42"], "loss.backward()"),
        (["32.70M", "42.00M", "43"], "optimizer.step()"),
        (["24.70M", "42.00M", "44"], "return loss.item()"),
    ]
