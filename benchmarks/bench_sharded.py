"""Sharded training from one process: FSDP2 estimates of a GPT-2-sized model for world sizes 1 to 8.

For each world size N (one fresh process each, so that host memory is that run's alone):
``memlab.distributed.fake_group(N)``, a GPT-2 built from ``transformers.GPT2Config()`` (124M
parameters, float32), ``fully_shard`` on each transformer block and on the model, AdamW; then

- ``memlab.estimate`` of two training steps (batch 4 x 512 tokens): seconds, host memory (peak
  resident-set growth, sampled every millisecond), and rank 0's peak allocated bytes;
- PyTorch's ``FSDPMemTracker`` on the same model built under ``FakeTensorMode`` (data-free, as the
  estimate is), the same two steps: seconds and its peak;
- with ``--fit``: ``memlab.max_batch_size`` of the step for an 80 GB H100 (two steps; ``high=256``).

Run: ``python benchmarks/bench_sharded.py`` (add ``--fit`` for the batch column; ``--worlds 1 2 4 8``
to pick world sizes). Needs ``transformers`` (``pip install transformers torch==<your torch>``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch
from bench_steady_state import measure  # this folder is on sys.path when run as a script

import memlab
from memlab.distributed import fake_group

BATCH, TOKENS, VOCAB = 4, 512, 50257


def sharded_gpt2(mesh: Any = None) -> torch.nn.Module:
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
) -> torch.Tensor:
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def one_world(world: int, fit: bool) -> dict[str, Any]:
    """What the parent prints for world size ``world`` (run in a child process)."""
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS))
    with fake_group(world):
        model = sharded_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        seconds, host, estimate = measure(
            lambda: memlab.estimate(train_step, model, optimizer, tokens, steps=2)
        )
        found: dict[str, Any] = {
            "world": world,
            "estimate_s": seconds,
            "estimate_host": host,
            "peak_allocated": estimate.peak_allocated,
            "peak_reserved": estimate.peak_reserved,
        }
        found["memtracker_s"], found["memtracker_peak"] = fsdp_mem_tracker(tokens)
        if fit:
            start = time.perf_counter()
            result = memlab.max_batch_size(
                lambda batch: train_step(model, optimizer, batch),
                lambda size: torch.randint(0, VOCAB, (size, TOKENS)),
                "80 GB",
                high=256,
            )
            found["fit"] = result.batch_size
            found["fit_s"] = time.perf_counter() - start
    return found


def fsdp_mem_tracker(tokens: torch.Tensor) -> tuple[float, int]:
    """Seconds and peak bytes of PyTorch's ``FSDPMemTracker`` over the same two steps, data-free."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    start = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = sharded_gpt2(mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fake_tokens = torch.randint(0, VOCAB, tokens.shape)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((fake_tokens,))
        with tracker:
            for _ in range(2):
                train_step(model, optimizer, fake_tokens)
                tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return time.perf_counter() - start, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--fit", action="store_true", help="also find the largest batch per GPU")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child is not None:
        print(json.dumps(one_world(arguments.child, arguments.fit)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; GPT-2 124M, FSDP2, AdamW, ")
    print(f"two steps of batch {BATCH} x {TOKENS} tokens, float32; one process per world size")
    header = "world | estimate s | host MiB | peak allocated MiB | FSDPMemTracker s | its peak MiB"
    print(header + (" | batch that fits (80 GB)" if arguments.fit else ""))
    for world in arguments.worlds:
        command = [sys.executable, __file__, "--child", str(world)] + (["--fit"] if arguments.fit else [])
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{world}: failed\n{done.stderr[-2000:]}")
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        row = (
            f"{world} | {found['estimate_s']:.1f} | {found['estimate_host'] / 2**20:.0f} | "
            f"{found['peak_allocated'] / 2**20:.0f} | {found['memtracker_s']:.1f} | "
            f"{found['memtracker_peak'] / 2**20:.0f}"
        )
        if arguments.fit:
            row += f" | {found['fit']} ({found['fit_s']:.0f} s)"
        print(row, flush=True)


if __name__ == "__main__":
    main()
