"""Trainer batch search on one model under one capacity: memlab's
``memlab.integrations.lightning.max_batch_size`` (estimates, no run) vs Lightning's
``BatchSizeFinder`` (``Tuner.scale_batch_size``: real steps until one runs out of memory), the real
run under ``memlab.TensorTracker(capacity=...)``, which raises ``torch.OutOfMemoryError`` as a GPU
would. Prints each answer, its wall time and the out-of-memory errors raised, then whether each
answer trains 3 steps under the capacity.

    python benchmarks/bench_lightning_batch.py [--budget-mib 100]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

import memlab
from memlab.integrations import lightning as ml

WIDTH, SAMPLES = 2048, 4096


class MLP(pl.LightningModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        generator = torch.Generator().manual_seed(0)
        self.data = (torch.randn(SAMPLES, WIDTH, generator=generator), torch.randint(0, 10, (SAMPLES,)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.data), batch_size=self.batch_size)


def trainer(steps: int = 3) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps, accumulate_grad_batches=2, precision="bf16-mixed", accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def trains(size: int, budget: int) -> bool:
    module = MLP(size)  # the dataset is host memory, made before the device's run
    try:
        with memlab.TensorTracker(capacity=budget) as tracker:
            tracker.adopt(roots=[module])
            trainer().fit(module)
    except torch.OutOfMemoryError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=100)
    budget = parser.parse_args().budget_mib * 2**20
    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")

    start = time.perf_counter()
    found = ml.max_batch_size(trainer(), MLP(), budget=budget, device="cpu", steps=3)
    memlab_time = time.perf_counter() - start

    ooms = 0
    original = memlab.TensorTracker._out_of_memory

    def counted(self, *args):
        nonlocal ooms
        ooms += 1
        return original(self, *args)

    memlab.TensorTracker._out_of_memory = counted
    module = MLP()
    start = time.perf_counter()
    with memlab.TensorTracker(capacity=budget) as tracker:
        tracker.adopt(roots=[module])
        lightning_size = Tuner(trainer()).scale_batch_size(
            module, mode="binsearch", steps_per_trial=3, init_val=8
        )
    lightning_time = time.perf_counter() - start
    memlab.TensorTracker._out_of_memory = original

    print(f"model: Linear({WIDTH}, 256) + Linear(256, 10), AdamW, bf16-mixed, accumulate_grad_batches=2")
    print(f"capacity: {budget // 2**20} MiB (memlab.TensorTracker, H100 allocator model)")
    print(f"{'finder':<34}{'batch size':>11}{'wall s':>9}{'OOMs':>6}{'trains 3 steps':>16}{'B+1 trains':>12}")
    rows = [
        ("memlab max_batch_size (estimates)", found.batch_size, memlab_time, 0),
        ("Lightning BatchSizeFinder (binsearch)", lightning_size, lightning_time, ooms),
    ]
    for name, size, seconds, errors in rows:
        print(f"{name:<34}{size:>11}{seconds:>9.1f}{errors:>6}{trains(size, budget)!s:>16}"
              f"{trains(size + 1, budget)!s:>12}")  # fmt: skip
    print(f"memlab ran {found.estimates} estimates")


if __name__ == "__main__":
    main()
