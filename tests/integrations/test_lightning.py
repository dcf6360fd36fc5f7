"""memlab.integrations.lightning: estimates of a LightningModule's fit steps equal a tracked real
``trainer.fit()``, the batch size found trains and the next one runs out of memory, the callback's
peaks are the tracker's; the user's module, trainer and RNG are untouched."""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import memlab
from memlab.plan.checkpointing import is_checkpointed

if importlib.util.find_spec("lightning") is None:  # found, not imported: see lightning_cases.py
    pytest.skip("needs lightning (pip install 'memlab[test]')", allow_module_level=True)


@pytest.fixture
def cases():
    """The modules, data and trainers (tests/integrations/lightning_cases.py), imported with Lightning
    when the first test runs: see that module's docstring."""
    from tests.integrations import lightning_cases

    return lightning_cases


@pytest.fixture(autouse=True)
def _quiet():
    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


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
def test_estimate_equals_a_tracked_fit_and_leaves_the_user_objects_alone(
    precision, accumulate, manual, clip, cases
):
    torch.manual_seed(0)
    module = cases.MLP(manual=manual)
    trainer = cases.make_trainer(accumulate, precision, gradient_clip_val=clip)
    state = {key: value.clone() for key, value in module.state_dict().items()}
    rng = torch.random.get_rng_state()

    estimate = cases.ml.estimate(trainer, module, steps=3, device="cpu")

    assert estimate.method == "fake"
    assert estimate.caveats == []
    assert all(torch.equal(state[key], value) for key, value in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert module._trainer is None and trainer.optimizers == [] and trainer.global_step == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert cases.peaks(estimate) == cases.tracked_fit(module, trainer)


def test_self_log_works_and_counts_what_the_result_collection_holds(cases):
    """``self.log`` runs Lightning's own result collection on the stand-in trainer. Its metric keeps
    deep copies of its state defaults (torchmetrics' ``add_state``): storages made by
    ``copy.deepcopy``, which the tracked run counts (the storage constructor) and the estimate
    copies as fake tensors (:mod:`memlab.estimate.deepcopy`): the two are equal."""
    torch.manual_seed(0)
    module, trainer = cases.MLP(log=True), cases.make_trainer()

    estimate = cases.ml.estimate(trainer, module, steps=3, device="cpu")
    assert trainer.callback_metrics == {}  # nothing logged into the user's trainer
    real = cases.tracked_fit(module, trainer)

    metrics = list(trainer.fit_loop.epoch_loop._results.values())
    defaults = [t for metric in metrics for t in metric._defaults.values()]
    assert estimate.method == "fake"
    assert (len(metrics), len(defaults)) == (1, 2)
    assert cases.peaks(estimate) == real


def test_train_dataloaders_given_to_fit(cases):
    torch.manual_seed(0)
    module, trainer = cases.MLP(), cases.make_trainer()
    loader = DataLoader(TensorDataset(*module.data), batch_size=16)

    estimate = cases.ml.estimate(trainer, module, train_dataloaders=loader, steps=3, device="cpu")

    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[module])
        trainer.fit(module, train_dataloaders=loader)
        stats = tracker.memory_stats()
    assert cases.peaks(estimate) == {key: stats[key] for key in cases.KEYS}


def test_bad_arguments_are_named(cases):
    module = cases.MLP()
    with pytest.raises(TypeError, match=r"trainer must be a lightning\.pytorch\.Trainer, got MLP"):
        cases.ml.estimate(module, module)
    with pytest.raises(
        ValueError, match="Field 'bs' not found in the module, the datamodule, nor the module's hparams"
    ):
        cases.ml.max_batch_size(cases.make_trainer(), module, budget="1 GiB", batch_arg_name="bs")


def test_max_batch_size_trains_and_the_next_size_runs_out_of_memory(cases):
    budget = 100 * 2**20
    module = cases.MLP(width=cases.WIDE, samples=4096)
    trainer = cases.make_trainer()

    found = cases.ml.max_batch_size(trainer, module, budget=budget, device="cpu", steps=3)

    size = found.batch_size
    assert module.batch_size == 8  # the user's module keeps its value
    assert size > 8 and found.next_size == size + 1
    assert found.estimate.peak_reserved <= budget < found.next_estimate.peak_reserved
    torch.manual_seed(0)
    fits = cases.tracked_fit(
        cases.MLP(batch_size=size, width=cases.WIDE, samples=4096), cases.make_trainer(), capacity=budget
    )
    assert fits["reserved_bytes.all.peak"] == found.estimate.peak_reserved
    with pytest.raises(torch.OutOfMemoryError):
        cases.tracked_fit(
            cases.MLP(batch_size=size + 1, width=cases.WIDE, samples=4096),
            cases.make_trainer(),
            capacity=budget,
        )


def test_max_batch_size_sets_the_size_only_when_asked(cases):
    module = cases.MLP(width=cases.WIDE, samples=4096)
    found = cases.ml.max_batch_size(
        cases.make_trainer(), module, budget=100 * 2**20, device="cpu", steps=3, apply=True
    )
    assert module.batch_size == found.batch_size > 8


def test_callback_logs_the_tracked_peaks_and_warns_when_the_steps_do_not_fit(cases):
    torch.manual_seed(0)
    module = cases.MLP()
    logged = []

    class Recorder(cases.pl.loggers.logger.DummyLogger):
        def log_metrics(self, metrics, step=None):
            logged.append((step, dict(metrics)))

    callback = cases.ml.MemlabCallback(budget=2**20, device="cpu")
    trainer = cases.make_trainer(callbacks=[callback])
    trainer.loggers = [Recorder()]
    message = (
        "memlab: the training steps are estimated to need 66.00M reserved (includes 2 modelled cuBLAS "
        "workspaces of the H100: 64.00M), more than the budget of "
        "1.00M. Lower batch_size=8 (memlab.integrations.lightning.max_batch_size(trainer, module, "
        "budget=...) finds the largest that fits, about 1 by proportion) and raise "
        "accumulate_grad_batches from 2 to 16 to keep the effective batch."
    )
    with pytest.warns(UserWarning, match=re.escape(message)):
        trainer.fit(module)

    torch.manual_seed(0)
    real = cases.tracked_fit(cases.MLP(), cases.make_trainer())
    assert len(callback.peaks) == 6  # 3 steps of 2 batches
    assert max(p["peak_allocated"] for p in callback.peaks) == real["allocated_bytes.all.peak"]
    assert max(p["peak_reserved"] for p in callback.peaks) == real["reserved_bytes.all.peak"]
    assert callback.estimate.peak_reserved == real["reserved_bytes.all.peak"]
    assert [metrics["memlab/peak_allocated"] for _, metrics in logged] == [
        p["peak_allocated"] for p in callback.peaks
    ]
    assert [step for step, _ in logged] == [0, 1, 1, 2, 2, 3]


def test_a_step_that_reads_values_is_still_exact(cases):
    torch.manual_seed(0)
    module, trainer = cases.ItemMLP(), cases.make_trainer()

    estimate = cases.ml.estimate(trainer, module, steps=3, device="cpu")

    # loss.item() gives an unbacked symbol the step keeps (memlab.estimate.values): still data-free
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert not hasattr(module, "last_loss")  # written on the copy only
    assert cases.peaks(estimate) == cases.tracked_fit(module, trainer)


def test_datamodule_batch_size_is_searched_like_batch_size_finder(cases):
    """The datamodule's ``batch_size`` is the one scaled (BatchSizeFinder's order); its shuffling
    sampler draws from the global RNG, which the search leaves where it was."""
    budget = 100 * 2**20
    module, data = cases.MLP(width=cases.WIDE, samples=8), cases.Data(batch_size=4)
    rng = torch.random.get_rng_state()

    found = cases.ml.max_batch_size(cases.make_trainer(), module, data, budget=budget, device="cpu", steps=3)

    assert data.batch_size == 4 and module.batch_size == 8
    assert torch.equal(torch.random.get_rng_state(), rng)
    torch.manual_seed(0)
    fitting, failing = (
        cases.Data(found.batch_size),
        cases.Data(found.batch_size + 1),
    )  # host memory, made before
    estimate = cases.ml.estimate(cases.make_trainer(), module, fitting, steps=3, device="cpu")
    with memlab.TensorTracker(capacity=budget) as tracker:
        tracker.adopt(roots=[module])
        cases.make_trainer().fit(module, datamodule=fitting)
        stats = tracker.memory_stats()
    assert cases.peaks(estimate) == {key: stats[key] for key in cases.KEYS}
    assert estimate.peak_reserved == found.estimate.peak_reserved
    with pytest.raises(torch.OutOfMemoryError), memlab.TensorTracker(capacity=budget) as tracker:
        tracker.adopt(roots=[module])
        cases.make_trainer().fit(module, datamodule=failing)


def test_a_datamodule_set_up_in_setup_is_set_up_on_a_copy(cases):
    torch.manual_seed(0)
    module, data, trainer = cases.MLP(), cases.SetUpData(), cases.make_trainer()

    estimate = cases.ml.estimate(trainer, module, data, steps=3, device="cpu")

    assert not hasattr(data, "dataset")
    data.setup("fit")  # made before the tracked run: the dataset is host memory
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[module])
        trainer.fit(module, datamodule=data)
        stats = tracker.memory_stats()
    assert cases.peaks(estimate) == {key: stats[key] for key in cases.KEYS}


def test_the_default_estimate_is_for_a_gpu_with_its_kernels_and_optimizer_defaults(cases):
    """By default the steps are estimated for CUDA: autocast by CUDA's op lists for each of the six
    batches, and the optimizer made by ``configure_optimizers`` given CUDA's foreach default."""
    torch.manual_seed(0)
    module = cases.MLP()

    estimate = cases.ml.estimate(cases.make_trainer(), module, steps=3)

    assert (estimate.method, estimate.device.type) == ("fake", "cuda")
    assert estimate.substituted == {"autocast": 6, "optimizer_foreach": 1}


def test_a_plain_estimate_of_training_step_says_it_holds_the_forward_only(cases):
    module = cases.MLP()
    x, y = module.data[0][:8], module.data[1][:8]

    estimate = memlab.estimate(module.training_step, (x, y), 0, device="cpu")

    assert estimate.caveats[-1] == (
        "a LightningModule's training_step holds the forward only: the backward pass and the optimizer step "
        "are not in this estimate (memlab.integrations.lightning.estimate(trainer, module) runs them)"
    )


@pytest.mark.parametrize(
    ("budget", "checkpointed", "arguments"),
    [
        ("310 MiB", ["net.0", "net.1", "net.2", "net.3"], {}),
        ("288 MiB", [], {"batch_size": 256, "accumulate_grad_batches": 4}),
    ],
    ids=["checkpointing", "micro-batches"],
)
def test_a_plan_fits_when_the_module_is_trained_as_it_says(cases, budget, checkpointed, arguments):
    """Batches of 1024 need 326 MiB: 310 MiB are met by checkpointing 4 of the 6 blocks; 288 MiB
    (checkpointing all 6 needs 290) by 4 micro-batches of 256, Lightning's own gradient
    accumulation. Each is applied to a new module and trainer, whose real ``fit`` under the budget
    has exactly the planned peaks; as it is, ``fit`` runs out of memory."""
    module = cases.Deep()
    found = cases.ml.plan(cases.make_trainer(accumulate=1), module, budget=budget, device="cpu", steps=3)
    assert (found.fits, found.checkpointed, found.arguments) == (True, checkpointed, arguments)
    assert found.baseline.peak_reserved == 326 * 2**20
    assert module.batch_size == 1024 and not any(is_checkpointed(block) for block in module.net)
    if arguments:
        assert found.code == (
            "# the batch size the dataloader reads, and the Trainer's argument (the same effective batch):\n"
            "#   batch_size=256, accumulate_grad_batches=4"
        )
    planned = cases.Deep(batch_size=arguments.get("batch_size", 1024))
    with found.apply(planned):
        real = cases.tracked_fit(
            planned, cases.make_trainer(accumulate=arguments.get("accumulate_grad_batches", 1)), budget
        )
    assert real == cases.peaks(found.estimate)
    with pytest.raises(torch.OutOfMemoryError):
        cases.tracked_fit(cases.Deep(), cases.make_trainer(accumulate=1), budget)
