"""An estimate's cost against its floor: the same training step run under a bare ``FakeTensorMode``.

For five small models (an MLP, a transformer encoder, a conv-net, an LSTM and a GPT-2-like decoder),
each a full training step (zero_grad, forward, cross-entropy, backward, AdamW): the CPU time
(``time.process_time``, one thread) of ``memlab.estimate`` of the step, against the floor: fake
copies of the model, its gradients, the optimizer and its state and the batch made under one plain
``FakeTensorMode`` (``FakeCopyMode`` and ``mode.from_tensor``: what any data-free run must make),
then the step run on them. "fresh": a model never trained; "warm": after two real AdamW steps
(gradients and optimizer state exist, the step counters are fake constants, as an estimate copies
them). Medians of ``--repeats`` runs of each, measured twice with the two sides interleaved (load
drift hits both); the ratio estimate / floor of each measure is what counts (the goal: <= 1.3). The
"step only" column is the floor without the copying, for reference.
Run: ``PYTHONPATH=. python benchmarks/bench_floor.py`` from the repository root (this checkout's memlab;
``--models mlp,lstm`` for a subset).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_estimate import train_step  # the training step every estimate benchmark times
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

import memlab


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 512)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        channels = 3
        for width in (16, 32):
            layers += [
                torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
                torch.nn.Conv2d(width, width, 3, stride=2, padding=1), torch.nn.ReLU(),
            ]  # fmt: skip
            channels = width
        self.layers = torch.nn.Sequential(
            *layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class LSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.lstm = torch.nn.LSTM(64, 64, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(64, 512)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(tokens))[0])


class GPT2Like(torch.nn.Module):
    """``transformers.GPT2LMHeadModel`` at 2 layers, width 64, vocabulary 512."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 512, (8, 32)), torch.randint(0, 512, (8, 32))


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = {
    "mlp": (MLP, lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,)))),
    "transformer": (Transformer, _tokens),
    "convnet": (ConvNet, lambda: (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))),
    "lstm": (LSTM, _tokens),
    "gpt2": (GPT2Like, _tokens),
}


def floor_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any) -> float:
    """CPU seconds of the step alone; the whole call (copies and step) is what the caller times."""
    mode = FakeTensorMode(static_shapes=True)
    with FakeCopyMode(mode):
        fake_model = copy.deepcopy(model)  # parameters, buffers and gradients as fake tensors
    fake_optimizer = torch.optim.AdamW(fake_model.parameters(), lr=optimizer.defaults["lr"])
    originals = dict(zip(model.parameters(), fake_model.parameters(), strict=True))
    for param, state in optimizer.state.items():
        fake_optimizer.state[originals[param]] = {
            key: _fake_state(mode, value) if isinstance(value, torch.Tensor) else value
            for key, value in state.items()
        }
    fake_inputs, fake_targets = mode.from_tensor(inputs), mode.from_tensor(targets)
    start = time.process_time()
    with mode:
        train_step(fake_model, fake_optimizer, fake_inputs, fake_targets)
    return time.process_time() - start


def _fake_state(mode: FakeTensorMode, value: torch.Tensor) -> torch.Tensor:
    if value.dim() == 0 and value.device.type == "cpu":  # a step counter, read with .item(): a constant
        return mode.fake_tensor_converter.from_real_tensor(mode, value.clone(), make_constant=True)
    return mode.from_tensor(value)


def measure(name: str, warm: bool, repeats: int) -> list[tuple[float, float, float]]:
    """Two interleaved measures of (median estimate s, median floor s, median step-only s)."""
    make_model, make_batch = MODELS[name]
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = make_batch()
    if warm:
        for _ in range(2):
            train_step(model, optimizer, inputs, targets)
    memlab.estimate(train_step, model, optimizer, inputs, targets)  # imports, caches
    floor_step(model, optimizer, inputs, targets)
    results = []
    for _ in range(2):
        estimates, floors, steps = [], [], []
        for _ in range(repeats):
            start = time.process_time()
            memlab.estimate(train_step, model, optimizer, inputs, targets)
            estimates.append(time.process_time() - start)
            start = time.process_time()
            steps.append(floor_step(model, optimizer, inputs, targets))
            floors.append(time.process_time() - start)
        results.append((statistics.median(estimates), statistics.median(floors), statistics.median(steps)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--fresh-only", action="store_true", help="skip the warm measures")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, memlab from {os.path.dirname(memlab.__file__)}; CPU time, 1 thread, "
        f"medians of {args.repeats}, each measured twice"
    )
    print(f"{'step':<20}{'estimate ms':>12}{'floor ms':>10}{'ratio':>7}{'step only ms':>14}{'ratio':>7}")
    for warm in (False,) if args.fresh_only else (False, True):
        for name in names:
            for estimate_s, floor_s, step_s in measure(name, warm, args.repeats):
                label = f"{name} ({'warm' if warm else 'fresh'})"
                print(
                    f"{label:<20}{estimate_s * 1e3:>12.1f}{floor_s * 1e3:>10.1f}{estimate_s / floor_s:>7.2f}"
                    f"{step_s * 1e3:>14.1f}{estimate_s / step_s:>7.2f}"
                )
    print(f"load average {' '.join(f'{load:.2f}' for load in os.getloadavg())}")


if __name__ == "__main__":
    main()
