"""Tracker overhead per aten op on a training step.

Compares, on the same small training step (small tensors, so dispatch cost dominates):
no mode at all; a pass-through ``TorchDispatchMode`` that only calls the op; memlab's
``TensorTracker`` with the CUDA allocator model and in exact mode; and PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker``. Overhead per op is (time with the mode - time
without any mode) / number of aten ops; "vs pass-through" divides it by the pass-through mode's
overhead per op (the issue-27 goal: <= 1.5). CPU time (``time.process_time``), one thread, medians
of ``--repeats``, every context measured twice, the two rounds interleaved (load drift hits all).
Run: ``PYTHONPATH=. python benchmarks/bench_tracker.py`` (from the repository root: this checkout's memlab).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class LeastCounting(TorchDispatchMode):
    """The least any allocation counter in a Python dispatch mode does: each new output storage gets
    a weak reference whose callback subtracts its bytes; a running total and peak. No history,
    threads or nesting: the floor of any design built on a mode. With ``allocator`` (a
    :class:`memlab.CachingAllocatorModel`), each storage is also malloc'd and freed in it: the
    least a mode that models the CUDA caching allocator does."""

    def __init__(self, allocator: Any = None) -> None:
        super().__init__()
        self.live: dict[int, Any] = {}
        self.allocated = self.peak = 0
        self.allocator = allocator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:
            storage = out.untyped_storage()
            key = id(storage)
            if key not in self.live:
                nbytes = storage.nbytes()
                self.allocated += nbytes
                self.peak = max(self.peak, self.allocated)
                handle = self.allocator.malloc(nbytes) if self.allocator is not None and nbytes else None
                self.live[key] = weakref.ref(
                    storage, lambda _, k=key, n=nbytes, h=handle: self._free(k, n, h)
                )
        return out

    def _free(self, key: int, nbytes: int, handle: Any) -> None:
        self.live.pop(key, None)
        self.allocated -= nbytes
        if handle is not None:
            self.allocator.free(handle)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def make_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    inputs, targets = torch.randn(8, 32), torch.randint(0, 10, (8,))

    def step():
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def ops_per_step() -> int:
    """Aten ops one training step of :func:`make_step` dispatches (after a warm-up step)."""
    counter = CountOps()
    _, _, step = make_step()
    step()
    with counter:
        step()
    return counter.ops


def time_steps(context_factory, steps: int, repeats: int) -> float:
    """Median seconds per training step under the context."""
    model, optimizer, step = make_step()
    results = []
    with context_factory(model, optimizer) as context:
        # MemTracker refuses a second iteration unless its per-module stats are reset first.
        reset = getattr(context, "reset_mod_stats", lambda: None)
        step()  # warm up: optimizer state, op caches
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(steps):
                reset()
                step()
            results.append((time.process_time() - start) / steps)
    return statistics.median(results)


def mem_tracker(model, optimizer):
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # intra-op threads only add noise at these sizes

    ops = ops_per_step()

    contexts = {
        "no mode": lambda m, o: contextlib.nullcontext(),
        "pass-through TorchDispatchMode": lambda m, o: PassThrough(),
        "least counting mode": lambda m, o: LeastCounting(),
        "least counting + allocator model": lambda m, o: LeastCounting(memlab.CachingAllocatorModel()),
        "memlab TensorTracker (cuda model)": lambda m, o: memlab.TensorTracker(),
        "memlab TensorTracker (exact)": lambda m, o: memlab.TensorTracker(allocator=None),
        "torch MemTracker": mem_tracker,
    }
    rounds = [{name: time_steps(factory, args.steps, args.repeats) for name, factory in contexts.items()}]
    rounds.append({name: time_steps(factory, args.steps, args.repeats) for name, factory in contexts.items()})
    print(f"training step: {ops} aten ops; torch {torch.__version__}; CPU time, 1 thread")
    for seconds in rounds:
        base = seconds["no mode"]
        passthrough = seconds["pass-through TorchDispatchMode"] - base
        print(f"{'context':<36}{'us/step':>10}{'us/op overhead':>16}{'vs pass-through':>17}")
        for name, value in seconds.items():
            overhead = (value - base) / ops * 1e6
            ratio = "" if name == "no mode" else f"{(value - base) / passthrough:.2f}x"
            print(f"{name:<36}{value * 1e6:>10.0f}{overhead:>16.2f}{ratio:>17}")
        tracker = seconds["memlab TensorTracker (cuda model)"]
        step_ratio = tracker / seconds["pass-through TorchDispatchMode"]
        print(f"TensorTracker step time / pass-through step time: {step_ratio:.2f}x")
        mem_tracker_ratio = seconds["torch MemTracker"] / tracker
        print(f"torch MemTracker step time / TensorTracker step time: {mem_tracker_ratio:.2f}x")
    print(f"load average {' '.join(f'{load:.2f}' for load in os.getloadavg())}")


if __name__ == "__main__":
    main()
