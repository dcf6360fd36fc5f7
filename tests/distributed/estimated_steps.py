"""What each rank runs in the tests that hold estimates under ``fake_group`` against real runs
(imported by the spawned processes): a model built from one seed, sharded with FSDP2 or wrapped in
DDP, trained for two steps under a ``TensorTracker`` that adopted the model, the optimizer and the
batch first (the order ``memlab.estimate`` adopts its copies in), after an estimate of the same steps
inside the real process group. Rank 0 writes the tracker's stats and the estimate's."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import memlab
from memlab.history import categories

#: The statistics an estimate is held against (bytes).
KEYS = (
    "allocated_bytes.all.peak",
    "allocated_bytes.all.current",
    "active_bytes.all.peak",
    "reserved_bytes.all.peak",
)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 256),
    )  # fmt: skip


def batch() -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(1))


def fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def ddp(model: torch.nn.Module) -> torch.nn.Module:
    # 1 MiB buckets: the 4 MiB weight gets one of its own, the others share
    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def tracked_steps(wrapping: str, steps: int = 2) -> dict[str, int]:
    """``steps`` real steps of the ``wrapping`` (``"fsdp2"`` or ``"ddp"``) model; DDP is built inside
    the tracker (its reducer's buckets are held by C++ alone, where adoption cannot see them)."""
    model = make_model()
    if wrapping == "fsdp2":
        model = fsdp2(model)
    optimizer = torch.optim.Adam(model.parameters())
    x = batch()
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x], category=categories.INPUT)
        if wrapping == "ddp":
            model = ddp(model)
        loss = None
        for _ in range(steps):
            loss = train_step(model, optimizer, x)
        stats = tracker.memory_stats()
    del loss
    return {key: stats[key] for key in KEYS}


def estimated_steps(wrapping: str, steps: int = 2) -> dict[str, int]:
    """``memlab.estimate`` of the steps :func:`tracked_steps` runs, in the process group at hand."""
    model = make_model()
    model = fsdp2(model) if wrapping == "fsdp2" else ddp(model)
    optimizer = torch.optim.Adam(model.parameters())
    estimate = memlab.estimate(train_step, model, optimizer, batch(), steps=steps)
    return {key: estimate.stats[key] for key in KEYS}


def run_rank(rank: int, world: int, out: str, wrapping: str) -> None:
    """Estimate the steps inside the real process group, then train on this rank; rank 0 writes
    ``out``/stats.json: ``{"real": stats, "estimate": stats}``."""
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        stats: Any = {"estimate": estimated_steps(wrapping), "real": tracked_steps(wrapping)}
        if rank == 0:
            with open(os.path.join(out, "stats.json"), "w") as file:
                json.dump(stats, file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo can abort a process at interpreter exit (see workers.run_rank): leave now.
    os._exit(0)
