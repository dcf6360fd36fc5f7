"""What an estimate of a later training step costs: a warm AdamW step against a fresh one.

For a small transformer and a GPT-2-sized model built from ``transformers.GPT2Config()`` (124M
parameters; skipped with a note when ``transformers`` is not installed), each a full training step
(forward, backward, AdamW): the wall time and the host memory (peak resident set growth, sampled
every millisecond) of ``memlab.estimate`` of the step on a fresh model, of the same estimate after
one real step (gradients and AdamW state exist: the step counters must stay readable), and of the
real step on this machine's CPU; then ``memlab.max_batch_size`` of the warm model (steps=2): its
wall time and how many estimates it ran. Targets: warm estimate <= 1.3x the fresh one, host memory
no more than the fresh one's plus a few MiB.
Run: ``python benchmarks/bench_steady_state.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_estimate import Transformer, train_step  # this folder is on sys.path when run as a script

import memlab

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def measure(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, peak resident-set growth in bytes, result) of ``fn()``."""
    gc.collect()
    start_rss = resident()
    peak = [start_rss]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], resident())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], resident())
    return elapsed, peak[0] - start_rss, result


def gpt2() -> torch.nn.Module | None:
    try:
        import transformers
    except ImportError:
        return None

    class GPT2(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config())

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model(tokens).logits

    return GPT2()


def compare(name: str, make: Callable[[], torch.nn.Module], vocab: int, batch: int, tokens: int) -> None:
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randint(0, vocab, (batch, tokens))
    targets = torch.randint(0, vocab, (batch, tokens))
    memlab.estimate(train_step, model, optimizer, inputs[:1, :8], targets[:1, :8])  # imports, caches

    def estimate() -> memlab.Estimate:
        return memlab.estimate(train_step, model, optimizer, inputs, targets)

    fresh_s, fresh_rss, fresh = measure(estimate)
    real_s, real_rss, _ = measure(lambda: train_step(model, optimizer, inputs, targets))
    warm_s, warm_rss, warm = measure(estimate)
    print(f"{name}, batch {batch} x {tokens} tokens, AdamW:")
    print(
        f"  fresh estimate {fresh_s:.2f} s, +{fresh_rss / 2**20:.0f} MiB host ({fresh.method}); "
        f"peak reserved {fresh.peak_reserved / 2**20:.0f} MiB"
    )
    print(
        f"  warm estimate  {warm_s:.2f} s, +{warm_rss / 2**20:.0f} MiB host ({warm.method}); "
        f"peak reserved {warm.peak_reserved / 2**20:.0f} MiB; {warm_s / fresh_s:.2f}x the fresh one's time"
    )
    print(f"  real CPU step  {real_s:.2f} s, +{real_rss / 2**20:.0f} MiB host")

    def step(inputs, targets):
        return train_step(model, optimizer, inputs, targets)

    def make_batch(size):
        return torch.randint(0, vocab, (size, tokens)), torch.randint(0, vocab, (size, tokens))

    fit_s, _, fit = measure(lambda: memlab.max_batch_size(step, make_batch, "24 GiB"))
    print(f"  max_batch_size of the warm model: {fit}; {fit_s:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    compare("small transformer (4 layers, width 256)", Transformer, 8192, 16, 256)
    if gpt2() is None:
        print("GPT-2: transformers is not installed (pip install transformers torch==<your torch>)")
        return
    compare("GPT-2 124M (transformers.GPT2Config())", gpt2, 50257, 4, 512)


if __name__ == "__main__":
    main()
