"""memlab.integrations.lightning: estimates of a LightningModule's fit steps equal a tracked real
``trainer.fit()``, the batch size found trains and the next one runs out of memory, the callback's
peaks are the tracker's; the user's module, trainer and RNG are untouched."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

import memlab

pl = pytest.importorskip("lightning.pytorch")
ml = pytest.importorskip("memlab.integrations.lightning")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")


@pytest.fixture(autouse=True)
def _quiet():
    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


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


@pytest.mark.parametrize(
    ("precision", "accumulate", "manual", "clip"),
    [
        ("bf16-mixed", 2, False, None),
        ("32-true", 1, False, None),
        ("bf16-mixed", 1, True, None),
        ("16-mixed", 2, False, 1.0),
        ("bf16-true", 2, False, 0.5),
    ],
)
def test_estimate_equals_a_tracked_fit_and_leaves_the_user_objects_alone(precision, accumulate, manual, clip):
    torch.manual_seed(0)
    module = MLP(manual=manual)
    trainer = make_trainer(accumulate, precision, gradient_clip_val=clip)
    state = {key: value.clone() for key, value in module.state_dict().items()}
    rng = torch.random.get_rng_state()

    estimate = ml.estimate(trainer, module, steps=3, device="cpu")

    assert estimate.method == "fake"
    assert estimate.caveats == []
    assert all(torch.equal(state[key], value) for key, value in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert module._trainer is None and trainer.optimizers == [] and trainer.global_step == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert peaks(estimate) == tracked_fit(module, trainer)


def test_self_log_works_and_counts_what_the_result_collection_holds():
    """``self.log`` runs Lightning's own result collection on the stand-in trainer. Its metric keeps
    deep copies of its state defaults (torchmetrics' ``add_state``): storages made by
    ``copy.deepcopy``, which the tracked run counts (the storage constructor) and the estimate
    copies as fake tensors (:mod:`memlab.estimate.deepcopy`): the two are equal."""
    torch.manual_seed(0)
    module, trainer = MLP(log=True), make_trainer()

    estimate = ml.estimate(trainer, module, steps=3, device="cpu")
    assert trainer.callback_metrics == {}  # nothing logged into the user's trainer
    real = tracked_fit(module, trainer)

    metrics = list(trainer.fit_loop.epoch_loop._results.values())
    defaults = [t for metric in metrics for t in metric._defaults.values()]
    assert estimate.method == "fake"
    assert (len(metrics), len(defaults)) == (1, 2)
    assert peaks(estimate) == real


def test_train_dataloaders_given_to_fit():
    torch.manual_seed(0)
    module, trainer = MLP(), make_trainer()
    loader = DataLoader(TensorDataset(*module.data), batch_size=16)

    estimate = ml.estimate(trainer, module, train_dataloaders=loader, steps=3, device="cpu")

    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[module])
        trainer.fit(module, train_dataloaders=loader)
        stats = tracker.memory_stats()
    assert peaks(estimate) == {key: stats[key] for key in KEYS}


def test_bad_arguments_are_named():
    module = MLP()
    with pytest.raises(TypeError, match=r"trainer must be a lightning\.pytorch\.Trainer, got MLP"):
        ml.estimate(module, module)
    with pytest.raises(
        ValueError, match="Field 'bs' not found in the module, the datamodule, nor the module's hparams"
    ):
        ml.max_batch_size(make_trainer(), module, budget="1 GiB", batch_arg_name="bs")


WIDE = 2048  # an input wide enough that the batch moves the large pool's segments


def test_max_batch_size_trains_and_the_next_size_runs_out_of_memory():
    budget = 100 * 2**20
    module = MLP(width=WIDE, samples=4096)
    trainer = make_trainer()

    found = ml.max_batch_size(trainer, module, budget=budget, device="cpu", steps=3)

    size = found.batch_size
    assert module.batch_size == 8  # the user's module keeps its value
    assert size > 8 and found.next_size == size + 1
    assert found.estimate.peak_reserved <= budget < found.next_estimate.peak_reserved
    torch.manual_seed(0)
    fits = tracked_fit(MLP(batch_size=size, width=WIDE, samples=4096), make_trainer(), capacity=budget)
    assert fits["reserved_bytes.all.peak"] == found.estimate.peak_reserved
    with pytest.raises(torch.OutOfMemoryError):
        tracked_fit(MLP(batch_size=size + 1, width=WIDE, samples=4096), make_trainer(), capacity=budget)


def test_max_batch_size_sets_the_size_only_when_asked():
    module = MLP(width=WIDE, samples=4096)
    found = ml.max_batch_size(make_trainer(), module, budget=100 * 2**20, device="cpu", steps=3, apply=True)
    assert module.batch_size == found.batch_size > 8


def test_callback_logs_the_tracked_peaks_and_warns_when_the_steps_do_not_fit():
    torch.manual_seed(0)
    module = MLP()
    logged = []

    class Recorder(pl.loggers.logger.DummyLogger):
        def log_metrics(self, metrics, step=None):
            logged.append((step, dict(metrics)))

    callback = ml.MemlabCallback(budget=2**20, device="cpu")
    trainer = make_trainer(callbacks=[callback])
    trainer.loggers = [Recorder()]
    message = (
        "memlab: the training steps are estimated to need 66.00M reserved, more than the budget of "
        "1.00M. Lower batch_size=8 (memlab.integrations.lightning.max_batch_size(trainer, module, "
        "budget=...) finds the largest that fits, about 1 by proportion) and raise "
        "accumulate_grad_batches from 2 to 16 to keep the effective batch."
    )
    with pytest.warns(UserWarning, match=re.escape(message)):
        trainer.fit(module)

    torch.manual_seed(0)
    real = tracked_fit(MLP(), make_trainer())
    assert len(callback.peaks) == 6  # 3 steps of 2 batches
    assert max(p["peak_allocated"] for p in callback.peaks) == real["allocated_bytes.all.peak"]
    assert max(p["peak_reserved"] for p in callback.peaks) == real["reserved_bytes.all.peak"]
    assert callback.estimate.peak_reserved == real["reserved_bytes.all.peak"]
    assert [metrics["memlab/peak_allocated"] for _, metrics in logged] == [
        p["peak_allocated"] for p in callback.peaks
    ]
    assert [step for step, _ in logged] == [0, 1, 1, 2, 2, 3]


class ItemMLP(MLP):
    """A step that reads the loss's value (``.item()``), as logging code does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()
        return loss


def test_a_step_that_reads_values_is_still_exact():
    torch.manual_seed(0)
    module, trainer = ItemMLP(), make_trainer()

    estimate = ml.estimate(trainer, module, steps=3, device="cpu")

    # loss.item() gives an unbacked symbol the step keeps (memlab.estimate.values): still data-free
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert not hasattr(module, "last_loss")  # written on the copy only
    assert peaks(estimate) == tracked_fit(module, trainer)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(1)
        self.data = (torch.randn(4096, WIDE, generator=generator), torch.randint(0, 10, (4096,)))

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.data), batch_size=self.batch_size, shuffle=True)


def test_datamodule_batch_size_is_searched_like_batch_size_finder():
    """The datamodule's ``batch_size`` is the one scaled (BatchSizeFinder's order); its shuffling
    sampler draws from the global RNG, which the search leaves where it was."""
    budget = 100 * 2**20
    module, data = MLP(width=WIDE, samples=8), Data(batch_size=4)
    rng = torch.random.get_rng_state()

    found = ml.max_batch_size(make_trainer(), module, data, budget=budget, device="cpu", steps=3)

    assert data.batch_size == 4 and module.batch_size == 8
    assert torch.equal(torch.random.get_rng_state(), rng)
    torch.manual_seed(0)
    fitting, failing = Data(found.batch_size), Data(found.batch_size + 1)  # host memory, made before
    estimate = ml.estimate(make_trainer(), module, fitting, steps=3, device="cpu")
    with memlab.TensorTracker(capacity=budget) as tracker:
        tracker.adopt(roots=[module])
        make_trainer().fit(module, datamodule=fitting)
        stats = tracker.memory_stats()
    assert peaks(estimate) == {key: stats[key] for key in KEYS}
    assert estimate.peak_reserved == found.estimate.peak_reserved
    with pytest.raises(torch.OutOfMemoryError), memlab.TensorTracker(capacity=budget) as tracker:
        tracker.adopt(roots=[module])
        make_trainer().fit(module, datamodule=failing)


class SetUpData(pl.LightningDataModule):
    """A datamodule that makes its dataset in ``setup``, as most do."""

    def setup(self, stage: str) -> None:
        if hasattr(self, "dataset"):
            return
        generator = torch.Generator().manual_seed(2)
        self.dataset = TensorDataset(torch.randn(64, 64, generator=generator), torch.randint(0, 10, (64,)))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=8)


def test_a_datamodule_set_up_in_setup_is_set_up_on_a_copy():
    torch.manual_seed(0)
    module, data, trainer = MLP(), SetUpData(), make_trainer()

    estimate = ml.estimate(trainer, module, data, steps=3, device="cpu")

    assert not hasattr(data, "dataset")
    data.setup("fit")  # made before the tracked run: the dataset is host memory
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[module])
        trainer.fit(module, datamodule=data)
        stats = tracker.memory_stats()
    assert peaks(estimate) == {key: stats[key] for key in KEYS}


def test_the_default_estimate_is_for_a_gpu_with_its_kernels_and_optimizer_defaults():
    """By default the steps are estimated for CUDA: autocast by CUDA's op lists for each of the six
    batches, and the optimizer made by ``configure_optimizers`` given CUDA's foreach default."""
    torch.manual_seed(0)
    module = MLP()

    estimate = ml.estimate(make_trainer(), module, steps=3)

    assert (estimate.method, estimate.device.type) == ("fake", "cuda")
    assert estimate.substituted == {"autocast": 6, "optimizer_foreach": 1}
