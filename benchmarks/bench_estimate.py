"""How much faster an estimate is than running the step, and what max_batch_size costs.

For a conv-net and a small transformer, each a full training step (forward, backward, AdamW) at a
small size and at a size a GPU would train at: the wall time of ``memlab.estimate`` of the step
(fake tensors under the tracker) against the same step run for real on this machine's CPU, best of
``--repeats``; then ``memlab.max_batch_size`` of
the transformer step under a budget: its wall time and how many estimates it ran.
Run: ``python benchmarks/bench_estimate.py``.
"""

from __future__ import annotations

import argparse
import time

import torch

import memlab


def conv_net() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    channels = 3
    for width in (32, 64, 128, 256):
        layers += [
            torch.nn.Conv2d(channels, width, 3, padding=1),
            torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(),
            torch.nn.Conv2d(width, width, 3, stride=2, padding=1),
            torch.nn.ReLU(),
        ]
        channels = width
    return torch.nn.Sequential(
        *layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, 10)
    )


class Transformer(torch.nn.Module):
    def __init__(self, width: int = 256, layers: int = 4, vocab: int = 8192) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def train_step(model, optimizer, inputs, targets):
    optimizer.zero_grad()
    out = model(inputs)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss


def best(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(
    name: str, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, repeats: int
) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memlab.estimate(train_step, model, optimizer, inputs, targets)  # warm up (imports, caches)
    estimated = best(repeats, lambda: memlab.estimate(train_step, model, optimizer, inputs, targets))
    real = best(repeats, lambda: train_step(model, optimizer, inputs, targets))
    result = memlab.estimate(train_step, model, optimizer, inputs, targets)
    print(
        f"{name}: estimate {estimated * 1e3:.0f} ms, real CPU step {real * 1e3:.0f} ms: "
        f"{real / estimated:.1f}x faster; estimated peak reserved {result.peak_reserved / 2**20:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    # The estimate's cost grows with the number of ops, not with tensor sizes; a real step's grows
    # with both: each model at a small size and at a size a GPU would train at.
    for batch, side in ((32, 128), (64, 224)):
        compare(
            f"conv-net step (batch {batch}, 3x{side}x{side})",
            conv_net(),
            torch.randn(batch, 3, side, side),
            torch.randint(0, 10, (batch,)),
            args.repeats,
        )
    for batch, tokens in ((16, 256), (32, 512)):
        compare(
            f"transformer step (4 layers, width 256, batch {batch} x {tokens} tokens)",
            Transformer(),
            torch.randint(0, 8192, (batch, tokens)),
            torch.randint(0, 8192, (batch, tokens)),
            args.repeats,
        )
    model = Transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(inputs, targets):
        return train_step(model, optimizer, inputs, targets)

    def make_batch(size):
        return torch.randint(0, 8192, (size, 256)), torch.randint(0, 8192, (size, 256))

    start = time.perf_counter()
    fit = memlab.max_batch_size(step, make_batch, "8 GiB")
    elapsed = time.perf_counter() - start
    print(f"max_batch_size of the transformer step: {fit}; {elapsed:.1f} s")


if __name__ == "__main__":
    main()
