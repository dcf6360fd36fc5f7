"""memlab's example: train a small classifier and profile its training step line by line.

Run ``python -m memlab.examples.train --epochs 1`` (or ``python memlab/examples/train.py``): the
``@memlab.profile`` table of ``train_step`` is printed when the script exits. Everything runs on
the GPU when there is one, otherwise on torch's default device. On a GPU the numbers are its own;
elsewhere memlab counts the tensors through a :class:`memlab.TensorTracker`, which adopts those that
exist when ``train_step`` is first called (the model, the data), as a GPU's numbers include them,
and reports what the CUDA caching allocator would show.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

import memlab

FEATURES, HIDDEN, CLASSES = 512, 1024, 10
BATCH_SIZE, BATCHES = 64, 4


def make_model() -> nn.Module:
    """A three-layer perceptron: about 1.6 M parameters (6.1 MiB in float32)."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


@memlab.profile
def train_step(model: nn.Module, optimizer: Optimizer, inputs: Tensor, targets: Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits, targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def train(epochs: int) -> list[float]:
    """Train for ``epochs`` passes over a fixed random dataset; return the last loss of each."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [
        (torch.randn(BATCH_SIZE, FEATURES), torch.randint(0, CLASSES, (BATCH_SIZE,))) for _ in range(BATCHES)
    ]
    losses = []
    for _ in range(epochs):
        for inputs, targets in data:
            loss = train_step(model, optimizer, inputs, targets)
        losses.append(loss)
    return losses


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default: 2)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.get_default_device()
    with torch.device(device):
        for epoch, loss in enumerate(train(args.epochs), 1):
            print(f"epoch {epoch}: loss {loss:.4f}")


if __name__ == "__main__":
    main()
