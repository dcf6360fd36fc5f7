"""What answering host reads of values costs a data-free estimate (memlab.estimate.values).

A GPT-2 step (AdamW, ``steps=3``; ``--full``: the real GPT-2 124M sizes at batch 4 x 512, else 2
layers, hidden 64, batch 4 x 32), CPU time (``process_time``: steadier than wall time on a shared
machine), best and median of ``--repeats``, interleaved:

- "before": a plain ``FakeTensorMode``, no ``HostValues`` (what estimates used before; a step that
  reads ``loss.item()`` was then a real CPU run);
- "now": the estimate as it is, for the step without reads, and for the same step ending in
  ``loss.item()`` (from that first read on, the fake mode carries a ``ShapeEnv``).

Run: ``python benchmarks/bench_values.py [--full]``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

import memlab

run_module = importlib.import_module("memlab.estimate.estimate")


def plain() -> tuple[FakeTensorMode, None]:
    return FakeTensorMode(allow_non_fake_inputs=True), None


def step(model: Any, optimizer: Any, tokens: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    return loss


def item_step(model: Any, optimizer: Any, tokens: torch.Tensor) -> float:
    return step(model, optimizer, tokens).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="GPT-2 124M sizes, batch 4 x 512")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    torch.manual_seed(0)
    if options.full:
        config, shape = transformers.GPT2Config(), (4, 512)
    else:
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
        shape = (4, 32)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, shape)
    original = run_module.fake_mode_with_values
    runs = {
        "before, step": (plain, step),
        "now, step": (original, step),
        "now, step ending in loss.item()": (original, item_step),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for repeat in range(options.repeats + 1):  # the first round warms up
            for name, (make, fn) in runs.items():
                run_module.fake_mode_with_values = make
                start = time.process_time()
                estimate = memlab.estimate(fn, model, optimizer, tokens, device="cuda", steps=3)
                if repeat:
                    times[name].append(time.process_time() - start)
                assert estimate.method == "fake", estimate.forced_by
    finally:
        run_module.fake_mode_with_values = original
    print(f"GPT-2 {'124M' if options.full else 'tiny'}, batch {shape[0]} x {shape[1]}, AdamW, steps=3")
    for name, found in times.items():
        found.sort()
        print(f"{name:32s} best {found[0]:.3f} s, median {found[len(found) // 2]:.3f} s (CPU time)")


if __name__ == "__main__":
    main()
