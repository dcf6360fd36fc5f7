"""Cost of the allocation history: tracker overhead per aten op with history on and off, and bytes.

1. The training step of ``bench_tracker.py`` under ``TensorTracker()`` and
   ``TensorTracker(history=True)``: overhead per aten op (time with the tracker - time without any
   mode, per op) and its ratio, history on / history off. Each allocation with history on records
   the Python stack (interned) and one to three entries.
2. A 1,000,000-event run: the recorded eor_nn GPU trace (``tests/data/gpu-traces/traces.json``)
   replayed through ``CachingAllocatorModel(history=History(stack=capture_stack))`` until the history
   holds a million entries, each with the (interned) Python stack of the replaying loop; bytes of
   history per entry as :meth:`History.nbytes` counts them (typed columns, stack references and
   each distinct stack and frame once), and the size per entry of a pickled snapshot of the last
   100,000 entries (what ``memlab.dump_snapshot`` writes).

Run: ``python benchmarks/bench_history.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import time
import warnings
from pathlib import Path

import torch
from bench_tracker import ops_per_step, time_steps

import memlab
from memlab.history.recorder import History, capture_stack
from memlab.sources.allocator import CachingAllocatorModel

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu-traces" / "traces.json"


def tracker_overhead(steps: int, repeats: int) -> None:
    ops = ops_per_step()
    contexts = {
        "no mode": lambda m, o: contextlib.nullcontext(),
        "TensorTracker (history off)": lambda m, o: memlab.TensorTracker(),
        "TensorTracker (history=True)": lambda m, o: memlab.TensorTracker(history=True),
    }
    seconds = {name: time_steps(factory, steps, repeats) for name, factory in contexts.items()}
    base = seconds["no mode"]
    print(f"training step: {ops} aten ops; torch {torch.__version__}")
    print(f"{'context':<32}{'us/step':>10}{'us/op overhead':>16}")
    for name, value in seconds.items():
        print(f"{name:<32}{value * 1e6:>10.0f}{(value - base) / ops * 1e6:>16.2f}")
    on = seconds["TensorTracker (history=True)"] - base
    off = seconds["TensorTracker (history off)"] - base
    print(f"RESULT overhead per op, history on / history off: {on / off:.2f}x")


def replay(model: CachingAllocatorModel, events: list[list], entries: int) -> None:
    history = model.history
    assert history is not None
    while history.recorded < entries:
        live: dict[int, int] = {}
        for event in events:
            if event[0] == "a":
                live[event[1]] = model.malloc(event[2])
            else:
                model.free(live.pop(event[1]))
            if history.recorded >= entries:
                return
        for handle in live.values():
            model.free(handle)


def history_bytes(entries: int) -> None:
    events = json.loads(TRACES.read_text())["eor_nn"]["events"]
    model = CachingAllocatorModel(config="", history=History(stack=capture_stack))
    start = time.perf_counter()
    replay(model, events, entries)
    elapsed = time.perf_counter() - start
    history = model.history
    assert history is not None
    per_entry = history.nbytes() / len(history)
    rate = elapsed / len(history) * 1e9
    print(f"{len(history):,} entries recorded in {elapsed:.1f} s ({rate:.0f} ns per entry, with the model)")
    print(f"RESULT history bytes per entry (interned frames): {per_entry:.1f} B")
    small = CachingAllocatorModel(config="", history=History(100_000, stack=capture_stack))
    replay(small, events, 100_000)
    pickled = len(pickle.dumps(small.history_snapshot(), protocol=4))
    print(f"pickled snapshot of 100,000 entries: {pickled / 100_000:.1f} B per entry")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tracker_overhead(args.steps, args.repeats)
    history_bytes(args.entries)


if __name__ == "__main__":
    main()
