"""Throughput of memlab's CUDA caching allocator model: malloc/free pairs per second.

Two realistic traces, each replayed through a fresh ``CachingAllocatorModel`` several times:

* ``eor_nn``: the 1,935 allocations / 1,926 frees recorded on a real GPU
  (``tests/data/gpu-traces/traces.json``), replayed back to back (live blocks freed between rounds);
* ``training``: a synthetic training-step pattern (parameters kept for the whole run; per step,
  activations allocated layer by layer and freed in reverse during backward, gradients, small
  temporaries freed at once, optimizer state touched), mixing small-pool and large-pool sizes.

Run: ``python benchmarks/bench_allocator.py``. Each trace is replayed ``--repeat`` times per run
and the best of ``--runs`` runs is kept; rates are per second of this process's CPU time, to discount
other load on the machine (on an idle machine wall time agrees). Prints
one line per trace and allocator and a final ``RESULT`` line with the caching model's slower rate.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from memlab.sources.allocator import CachingAllocatorModel, ExactAllocator

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu-traces" / "traces.json"


def eor_nn_events() -> list[tuple[str, int, int]]:
    """The recorded eor_nn trace as ("a", id, bytes) / ("f", id, 0) tuples."""
    events = json.loads(TRACES.read_text())["eor_nn"]["events"]
    return [(e[0], e[1], e[2] if e[0] == "a" else 0) for e in events]


def training_events(steps: int = 20, layers: int = 24, seed: int = 0) -> list[tuple[str, int, int]]:
    """A synthetic training loop's allocations: weights, activations, gradients, temporaries."""
    rng = random.Random(seed)
    events: list[tuple[str, int, int]] = []
    next_id = 0

    def alloc(nbytes: int) -> int:
        nonlocal next_id
        next_id += 1
        events.append(("a", next_id, nbytes))
        return next_id

    def free(ident: int) -> None:
        events.append(("f", ident, 0))

    hidden = [rng.choice((256, 512, 768, 1024, 2048)) for _ in range(layers)]
    for h in hidden:  # parameters: weight and bias, alive for the whole run
        alloc(4 * h * h)
        alloc(4 * h)
    for _ in range(steps):
        batch = rng.choice((16, 32, 64))
        saved = []
        for h in hidden:  # forward: activations kept for backward, temporaries freed at once
            saved.append(alloc(4 * batch * h))
            tmp = alloc(4 * batch * h)
            scalar = alloc(4)
            free(scalar)
            free(tmp)
        loss = alloc(4)
        grads = []
        for h in reversed(hidden):  # backward: gradients appear, activations go
            grad_out = alloc(4 * batch * h)
            grads.append(alloc(4 * h * h))
            grads.append(alloc(4 * h))
            free(saved.pop())
            free(grad_out)
        free(loss)
        for grad in grads:  # optimizer step, then zero_grad(set_to_none=True)
            tmp = alloc(rng.choice((4, 512, 4096)))
            free(tmp)
            free(grad)
    return events


def replay_rate(make_model, events: list[tuple[str, int, int]], repeat: int) -> tuple[float, float, int]:
    """Replay ``events`` ``repeat`` times into one model.

    Returns (pairs per CPU second, pairs per wall-clock second, pairs). CPU time is this process's
    (``time.process_time``), so other work waiting for the same cores does not count against the model.
    """
    model = make_model()
    malloc, free = model.malloc, model.free
    pairs = 0
    cpu_start = time.process_time()
    wall_start = time.perf_counter()
    for _ in range(repeat):
        handles: dict[int, int] = {}
        for kind, ident, nbytes in events:
            if kind == "a":
                handles[ident] = malloc(nbytes)
                pairs += 1
            else:
                free(handles.pop(ident))
        for handle in handles.values():
            free(handle)
    wall = time.perf_counter() - wall_start
    cpu = time.process_time() - cpu_start
    return pairs / cpu, pairs / wall, pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="replays of a trace per run (default 20)")
    parser.add_argument("--runs", type=int, default=5, help="runs per trace; the best is kept (default 5)")
    args = parser.parse_args()
    traces = {"eor_nn": eor_nn_events(), "training": training_events()}
    rates = []
    for name, events in traces.items():
        for label, make_model in (
            ("caching", lambda: CachingAllocatorModel(config="")),
            ("exact", ExactAllocator),
        ):
            cpu_rate, wall_rate, pairs = max(
                replay_rate(make_model, events, args.repeat) for _ in range(args.runs)
            )
            print(
                f"{name:9s} {label:8s} {pairs:9,d} malloc/free pairs  {cpu_rate:10,.0f} pairs/CPU-s"
                f"  {wall_rate:10,.0f} pairs/wall-s"
            )
            if label == "caching":
                rates.append(cpu_rate)
    print(f"RESULT CachingAllocatorModel: {min(rates):,.0f} malloc/free pairs per CPU second (slowest trace)")


if __name__ == "__main__":
    main()
