"""The Lightning modules, data and trainers of tests/integrations/test_lightning.py. Lightning is
imported here, when the first of those tests runs, not when pytest collects them: importing it
imports torchmetrics, which keeps a tensor in a module global for the life of the process
(``torchmetrics.functional.text.chrf._EPS_SMOOTHING``), and the tests that walk every live tensor
("no tensors existed before profiling") would count it."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import memlab
from memlab.integrations import lightning as ml

__all__ = [
    "KEYS",
    "MLP",
    "WIDE",
    "Data",
    "Deep",
    "ItemMLP",
    "SetUpData",
    "make_trainer",
    "ml",
    "peaks",
    "pl",
    "tracked_fit",
]

KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")


class MLP(pl.LightningModule):
    """Two layers; optionally ``self.log`` in the step, optionally manual optimization."""

    def __init__(
        self,
        batch_size: int = 8,
        width: int = 64,
        log: bool = False,
        manual: bool = False,
        samples: int = 512,
    ) -> None:
        super().__init__()
        self.batch_size, self.width, self.logs = batch_size, width, log
        self.automatic_optimization = not manual
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        generator = torch.Generator().manual_seed(0)
        self.data = (
            torch.randn(samples, width, generator=generator),
            torch.randint(0, 10, (samples,), generator=generator),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.logs:
            self.log("train_loss", loss)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.data), batch_size=self.batch_size)


def make_trainer(accumulate: int = 2, precision: str = "bf16-mixed", **options) -> pl.Trainer:
    return pl.Trainer(
        max_steps=3, accumulate_grad_batches=accumulate, precision=precision, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **options,
    )  # fmt: skip


def tracked_fit(
    module: pl.LightningModule, trainer: pl.Trainer, capacity: int | None = None
) -> dict[str, int]:
    with memlab.TensorTracker(capacity=capacity) as tracker:
        tracker.adopt(roots=[module])
        trainer.fit(module)
        stats = tracker.memory_stats()
    return {key: stats[key] for key in KEYS}


def peaks(estimate: memlab.Estimate) -> dict[str, int]:
    return {key: estimate.stats[key] for key in KEYS}


WIDE = 2048  # an input wide enough that the batch moves the large pool's segments


class Deep(MLP):
    """Six 1024-wide blocks (a linear layer and a GELU each) and a head of 4096 classes: the
    activations and the logits matter."""

    def __init__(self, batch_size: int = 1024) -> None:
        super().__init__(batch_size=batch_size, width=1024, samples=2048)
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(6)]
        self.net = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(1024, 4096)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.net(x)), y)


class ItemMLP(MLP):
    """A step that reads the loss's value (``.item()``), as logging code does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()
        return loss


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(1)
        self.data = (torch.randn(4096, WIDE, generator=generator), torch.randint(0, 10, (4096,)))

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.data), batch_size=self.batch_size, shuffle=True)


class SetUpData(pl.LightningDataModule):
    """A datamodule that makes its dataset in ``setup``, as most do."""

    def setup(self, stage: str) -> None:
        if hasattr(self, "dataset"):
            return
        generator = torch.Generator().manual_seed(2)
        self.dataset = TensorDataset(torch.randn(64, 64, generator=generator), torch.randint(0, 10, (64,)))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=8)
