"""Size and time of ``memlab viz``'s offline page (``memlab.history.page.memory_page``), which must
stay bounded however long the trace.

1. The largest snapshot under ``tests/data``: the recorded eor_nn GPU trace
   (``tests/data/gpu-traces/traces.json``, 3,861 alloc/free events) replayed once through
   ``CachingAllocatorModel(history=True)`` (no stacks recorded).
2. A synthetic 100,000-event snapshot: the eor_nn trace replayed again and again through
   ``CachingAllocatorModel(history=History(stack=capture_stack))`` until it made 100,000
   allocations and frees (the events the page draws; its history also holds the segment
   allocations), each with the (interned) Python stack of the replaying loop, so the peak table
   has stacks to show.

For each: the whole command (``memlab viz SNAPSHOT -o page.html``: read the pickle, replay, draw,
write) with ``--stack category`` and ``--stack largest``, best of ``--repeats`` runs; the page's
bytes, the events drawn of those in the trace, and the pickle's bytes; and, for scale, the bytes of
PyTorch's own page (``--viewer pytorch``, which embeds the whole pickle in base64).

Run: ``python benchmarks/bench_viz.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import memlab
from memlab.cli import main as memlab_main
from memlab.history.recorder import History, capture_stack
from memlab.sources.allocator import CachingAllocatorModel

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu-traces" / "traces.json"


def replayed(events: list[list], count: int | None, stacks: bool) -> CachingAllocatorModel:
    """A model that replayed ``events`` once (``count`` None) or again and again until it made
    ``count`` allocations and frees (each pass frees what it left live)."""
    model = CachingAllocatorModel(config="", history=History(stack=capture_stack) if stacks else True)
    done = 0
    while True:
        live: dict[int, int] = {}
        for event in events:
            if event[0] == "a":
                live[event[1]] = model.malloc(event[2])
            else:
                model.free(live.pop(event[1]))
            done += 1
            if done == count:
                return model
        if count is None:
            return model
        for handle in live.values():
            model.free(handle)
            done += 1
            if done == count:
                return model


def measure(name: str, model: CachingAllocatorModel, folder: str, repeats: int) -> None:
    snapshot = os.path.join(folder, f"{name}.pickle")
    memlab.dump_snapshot(snapshot, model)
    page = os.path.join(folder, f"{name}.html")
    print(
        f"{name}: {len(model.history):,} history entries, pickle {os.path.getsize(snapshot) / 1024:,.0f} KiB"
    )
    for stack in ("category", "largest"):
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            assert memlab_main(["viz", snapshot, "-o", page, "--stack", stack]) == 0
            seconds.append(time.perf_counter() - start)
        text = Path(page).read_text(encoding="utf-8")
        drawn = len(json.loads(re.search(r'id="memlab-points">(.*?)</script>', text).group(1))["events"])
        total = int(re.search(r'data-events="(\d+)"', text).group(1))
        assert "http" not in text
        print(
            f"RESULT {name} --stack {stack}: page {len(text.encode()) / 1024:,.0f} KiB, "
            f"{drawn:,} of {total:,} events drawn, {min(seconds):.2f} s (memlab viz, best of {repeats})"
        )
    assert memlab_main(["viz", snapshot, "-o", page, "--viewer", "pytorch"]) == 0
    print(f"{name} --viewer pytorch: page {os.path.getsize(page) / 1024:,.0f} KiB (needs network to display)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    events = json.loads(TRACES.read_text())["eor_nn"]["events"]
    with tempfile.TemporaryDirectory() as folder:
        measure("eor_nn", replayed(events, None, stacks=False), folder, args.repeats)
        measure(f"synthetic_{args.events}", replayed(events, args.events, stacks=True), folder, args.repeats)


if __name__ == "__main__":
    main()
