"""What each rank runs in the multi-process tests (imported by the spawned processes)."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import memlab
from memlab.distributed import gather

MiB = 1024 * 1024


def work(rank: int) -> torch.Tensor:
    big = torch.empty((rank + 1) * MiB // 4)
    small = torch.empty(256)
    return big.sum() + small.sum()


def run_rank(rank: int, world: int, out: str, scenario: str) -> None:
    """Profile :func:`work` on this rank (``scenario`` "all"), or on rank 0 only with rank 1
    profiling nothing and rank 2 raising ("idle"), then gather lines and tracker statistics on
    rank 0, which writes them to ``out``/lines.json and stats.json."""
    store = f"file://{os.path.join(out, 'store')}"  # a file, not a port another process could take
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        profiler = memlab.LineProfiler(work)
        tracker = memlab.TensorTracker(history=True)
        try:
            try:
                with tracker:
                    if scenario == "idle" and rank == 2:
                        raise RuntimeError("rank 2 failed")
                    if scenario == "all" or rank == 0:
                        profiler(work)(rank)
            finally:
                lines = gather(profiler, dst=0)
                stats = gather(tracker if (scenario == "all" or rank == 0) else None, dst=0)
        except RuntimeError:
            pass
        if rank == 0:
            with open(os.path.join(out, "lines.json"), "w") as file:
                json.dump(lines.to_data(), file)
            with open(os.path.join(out, "stats.json"), "w") as file:
                json.dump(stats.to_data(), file)
            with open(os.path.join(out, "lines.txt"), "w") as file:
                file.write(lines.render())
        dist.barrier()  # rank 0 has written: no rank tears the group down under another's feet
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo can abort a process at interpreter exit: a worker thread destroys the
    # gather's work, whose tensors' Python objects need the GIL while Python is finalizing
    # (SIGABRT, "terminate called without an active exception"; seen in 1 of 10 runs on this
    # machine, with a backtrace through ProcessGroupGloo::runLoop). The results are written:
    # leave without finalizing.
    os._exit(0)
