"""memlab.integrations.transformers against real ``trainer.train()`` runs tracked by TensorTracker:
a tiny GPT-2 from a config, random tokens, gradient accumulation 2, bf16 autocast on CPU."""

from __future__ import annotations

import io
import random
import warnings

import numpy
import pytest
import torch

import memlab
from memlab._units import format_size
from memlab.sources.tracker import active_tracker

transformers = pytest.importorskip("transformers")
from memlab.integrations import transformers as hf  # noqa: E402

MiB = 1 << 20
DEFAULTS = {"bf16": True, "use_cpu": True, "report_to": [], "save_strategy": "no", "disable_tqdm": True}
SAMPLES, TOKENS = 64, 32


class Tokens(torch.utils.data.Dataset):
    """Random tokens as a torch Dataset of tensors, with an attention mask of ones."""

    def __init__(self):
        self.ids = torch.randint(0, 512, (SAMPLES, TOKENS), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_trainer(tmp_path, batch_size=2, accumulation=2, max_steps=3, callbacks=None, data=None, **options):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    if data is None:  # lists of token ids, collated by the trainer's default collator
        tokens = torch.randint(0, 512, (SAMPLES, TOKENS), generator=torch.Generator().manual_seed(1)).tolist()
        data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        **{**DEFAULTS, **options},
    )
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def tracked_training(trainer, capacity=None):
    """``trainer.train()`` under a TensorTracker that counts the model from the start."""
    with memlab.TensorTracker(capacity=capacity) as tracker:
        tracker.adopt(roots=[trainer.model])
        trainer.train()
    return tracker.memory_stats("cpu")


def peaks(stats):
    return [stats[f"{name}_bytes.all.peak"] for name in ("allocated", "active", "reserved")]


@pytest.mark.parametrize(
    ("steps", "options"),
    [
        (1, {}),
        (3, {}),
        (2, {"fp16": True, "bf16": False}),  # accelerate's GradScaler on CPU
        (2, {"optim": "adamw_torch", "max_grad_norm": 0.0}),  # foreach AdamW, no clipping
    ],
    ids=["bf16-1-step", "bf16-3-steps", "fp16", "adamw-torch-no-clipping"],
)
def test_estimate_equals_tracked_training(tmp_path, steps, options):
    estimate = hf.estimate(make_trainer(tmp_path / "estimate", **options), steps=steps, device="cpu")
    real = tracked_training(make_trainer(tmp_path / "real", max_steps=steps, **options))
    assert estimate.method == "fake" and estimate.forced_by is None and estimate.caveats == []
    assert [estimate.peak_allocated, estimate.peak_active, estimate.peak_reserved] == peaks(real)


def test_estimate_of_a_torch_dataset_with_attention_masks_equals_tracked_training(tmp_path):
    """GPT-2's mask check reads the mask's values (``masking_utils.py``): the batches the estimate
    makes stand for the loader's, so the run knows them and stays data-free."""
    estimate = hf.estimate(make_trainer(tmp_path / "estimate", data=Tokens()), steps=2, device="cpu")
    real = tracked_training(make_trainer(tmp_path / "real", max_steps=2, data=Tokens()))
    assert (estimate.method, estimate.forced_by, estimate.caveats) == ("fake", None, [])
    assert [estimate.peak_allocated, estimate.peak_active, estimate.peak_reserved] == peaks(real)


def test_estimate_with_gradient_checkpointing_equals_tracked_training(tmp_path):
    trainer = make_trainer(tmp_path / "estimate", max_steps=2, gradient_checkpointing=True)
    estimate = hf.estimate(trainer, steps=2, device="cpu")
    real = tracked_training(make_trainer(tmp_path / "real", max_steps=2, gradient_checkpointing=True))
    assert not trainer.model.is_gradient_checkpointing  # enabled on the estimate's copy only
    assert [estimate.peak_allocated, estimate.peak_active, estimate.peak_reserved] == peaks(real)


def _user_state(trainer):
    params = [(p.detach().clone(), p._version, p.grad) for p in trainer.model.parameters()]
    optimizer = trainer.optimizer
    state = (
        []
        if optimizer is None
        else [(k, v.clone()) for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)]
    )
    accelerator = trainer.accelerator
    return {
        "params": params,
        "optimizer_state": state,
        "trainer_state": trainer.state.to_json_string() if hasattr(trainer.state, "to_json_string") else None,
        "optimizer": optimizer,
        "scheduler": trainer.lr_scheduler,
        "lists": [len(accelerator._models), len(accelerator._optimizers), len(accelerator._dataloaders)],
        "rng": (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()),
    }


def _assert_same(before, after):
    for (value, version, grad), (value2, version2, grad2) in zip(
        before["params"], after["params"], strict=True
    ):
        assert torch.equal(value, value2) and version == version2 and grad is grad2
    for (key, value), (key2, value2) in zip(before["optimizer_state"], after["optimizer_state"], strict=True):
        assert key == key2 and torch.equal(value, value2)
    assert before["trainer_state"] == after["trainer_state"]
    assert before["optimizer"] is after["optimizer"] and before["scheduler"] is after["scheduler"]
    assert before["lists"] == after["lists"]
    assert torch.equal(before["rng"][0], after["rng"][0])
    assert before["rng"][1] == after["rng"][1] and (before["rng"][2] == after["rng"][2]).all()


def test_estimate_leaves_an_untrained_trainer_as_it_was(tmp_path):
    trainer = make_trainer(tmp_path)
    before = _user_state(trainer)
    hf.estimate(trainer, steps=2, device="cpu")
    _assert_same(before, _user_state(trainer))
    assert trainer.optimizer is None and trainer.lr_scheduler is None
    assert not any(isinstance(p, torch._subclasses.FakeTensor) for p in trainer.model.parameters())


def test_estimate_leaves_a_trained_trainer_as_it_was(tmp_path):
    """After train(), the optimizer (accelerate's wrapper) has state and the parameters hold
    gradients here: the copies' step updates the copies, never the user's tensors."""
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    for param in trainer.model.parameters():
        param.grad = torch.ones_like(param)
    before = _user_state(trainer)
    estimate = hf.estimate(trainer, steps=1, device="cpu")
    _assert_same(before, _user_state(trainer))
    assert estimate.method == "fake"


def _with_own_optimizer(tmp_path, max_steps=3):
    trainer = make_trainer(tmp_path, max_steps=max_steps)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 10)
    trainer.optimizer, trainer.lr_scheduler = optimizer, scheduler  # Trainer(optimizers=(...)) does this
    return trainer


def test_estimate_with_the_users_optimizer_and_scheduler_equals_tracked_training(tmp_path):
    """The user's scheduler is copied onto the copied optimizer (which makes its own state, without
    the scheduler's warning about the order of steps); the user's optimizer stays without state."""
    trainer = _with_own_optimizer(tmp_path / "estimate")
    before = _user_state(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate = hf.estimate(trainer, steps=2, device="cpu")
    assert not [w for w in caught if "optimizer.step()" in str(w.message)]
    _assert_same(before, _user_state(trainer))
    assert trainer.optimizer.state == {} and trainer.lr_scheduler.last_epoch == 0
    real = tracked_training(_with_own_optimizer(tmp_path / "real", max_steps=2))
    assert [estimate.peak_allocated, estimate.peak_active, estimate.peak_reserved] == peaks(real)
    assert estimate.by_category("end")["optimizer_state"] == 2 * sum(
        -(-p.numel() * 4 // 512) * 512 for p in trainer.model.parameters()
    ) + 512 * len(list(trainer.model.parameters()))


def test_max_batch_size_trains_and_the_next_size_runs_out(tmp_path):
    budget = 72 * MiB
    fit = hf.max_batch_size(make_trainer(tmp_path / "fit"), budget, steps=3, device="cpu")
    size = fit.batch_size
    stats = tracked_training(make_trainer(tmp_path / "fits", batch_size=size), capacity=budget)
    assert stats["reserved_bytes.all.peak"] <= budget and stats["num_ooms"] == 0
    with pytest.raises(torch.OutOfMemoryError):
        tracked_training(make_trainer(tmp_path / "next", batch_size=size + 1), capacity=budget)
    # the effective batch (2 x 2 = 4) is kept with the largest divisor of it that fits
    assert (fit.per_device_train_batch_size, fit.gradient_accumulation_steps) == (4, 1)
    assert fit.changes == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
    assert fit.remedy == "per_device_train_batch_size=4, gradient_accumulation_steps=1"


def test_keep_effective_batch():
    assert hf.keep_effective_batch(8, 16, 1) == (8, 2)
    assert hf.keep_effective_batch(5, 6, 3) == (3, 6)
    assert hf.keep_effective_batch(100, 4, 2) == (8, 1)
    assert hf.keep_effective_batch(1, 7, 1) == (1, 7)


class PerStepTruth(transformers.TrainerCallback):
    """Ground truth: each step's peaks read from the test's own tracker."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.rows = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.tracker.reset_peak_memory_stats("cpu")

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append(
            (
                state.global_step,
                self.tracker.max_memory_allocated("cpu"),
                self.tracker.max_memory_reserved("cpu"),
            )
        )


def test_callback_logs_the_tracked_peaks_of_each_step(tmp_path):
    callback = hf.MemlabCallback(budget="1 GiB")  # estimates at train begin: it fits, no warning
    trainer = make_trainer(tmp_path, logging_steps=1, callbacks=[callback])
    with memlab.TensorTracker() as tracker:
        truth = PerStepTruth(tracker)
        trainer.add_callback(truth)
        tracker.adopt(roots=[trainer.model])
        trainer.train()
    assert callback.per_step == truth.rows and len(truth.rows) == 3
    assert callback.warning is None
    assert callback.estimate.peak_allocated == max(allocated for _, allocated, _ in truth.rows[:2])
    assert callback.estimate.peak_reserved == max(reserved for _, _, reserved in truth.rows[:2])
    logged = [
        (entry["step"], entry["memlab/peak_allocated"], entry["memlab/peak_reserved"])
        for entry in trainer.state.log_history
        if "memlab/peak_allocated" in entry
    ]
    assert logged == truth.rows
    first = trainer.state.log_history[0]
    categories = [key for key in first if key.startswith("memlab/") and not key.startswith("memlab/peak")]
    assert len(categories) == 3 and "memlab/workspace" in categories
    assert trainer.callback_handler.callbacks[0] is callback  # before the reporting callbacks


def test_callback_warns_at_train_begin_and_explains_the_oom(tmp_path):
    budget = 72 * MiB
    stream = io.StringIO()
    callback = hf.MemlabCallback(stream=stream)
    trainer = make_trainer(tmp_path, batch_size=16, accumulation=1, callbacks=[callback])
    remedy = "set TrainingArguments(per_device_train_batch_size=8, gradient_accumulation_steps=2) to keep "
    remedy += "the effective batch of 16"
    with pytest.warns(ResourceWarning) as warned, pytest.raises(torch.OutOfMemoryError):
        tracked_training(trainer, capacity=budget)
    needs = format_size(callback.estimate.peak_reserved)
    (warning,) = [w for w in warned if w.category is ResourceWarning]
    assert str(warning.message) == (
        f"memlab: an optimizer step of this Trainer needs {needs} (estimated peak reserved; includes 2 "
        "modelled cuBLAS workspaces of the H100: 64.00M) and the "
        f"budget is 72.00M: {remedy}"
    )
    report = stream.getvalue()
    assert "out of memory" in report.lower()
    assert report.endswith(f"memlab: {remedy}\n")
    assert "training_step" not in vars(trainer) and "step" not in vars(trainer.optimizer)
    assert active_tracker() is None  # the callback's own tracker stopped with the error


def test_estimate_for_a_gpu_from_a_cpu_trainer_names_the_autocast_it_ran(tmp_path):
    estimate = hf.estimate(make_trainer(tmp_path), steps=1, gpu="A100")
    assert estimate.device.type == "cuda" and estimate.method == "fake"
    assert estimate.gpu.name == "A100"
    assert estimate.caveats[-1] == (
        "the trainer was built on cpu: its bf16/fp16 steps ran under cpu's autocast, which casts other "
        "ops than CUDA's autocast does on a GPU"
    )


def test_the_default_estimate_is_for_the_training_gpu(tmp_path):
    estimate = hf.estimate(make_trainer(tmp_path), steps=1)  # built on this CPU machine
    assert (estimate.device.type, estimate.gpu.name) == ("cuda", "H100")


def test_bad_inputs(tmp_path):
    with pytest.raises(TypeError, match=r"trainer must be a transformers\.Trainer, got str 'x'"):
        hf.estimate("x")
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="steps"):
        hf.estimate(trainer, steps=0)
    trainer.train_dataset = None
    with pytest.raises(ValueError, match="trainer has no train_dataset"):
        hf.max_batch_size(trainer, "1 GiB")
    with pytest.raises(ValueError, match="log_categories"):
        hf.MemlabCallback(log_categories=-1)


def test_a_trainers_method_given_to_memlab_estimate_names_the_integration(tmp_path):
    trainer = make_trainer(tmp_path / "trainer")
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}

    with pytest.raises(TypeError) as raised:
        memlab.estimate(trainer.training_step, trainer.model, batch)

    assert str(raised.value) == (
        "fn is Trainer.training_step, which runs only inside trainer.train() (it reads state the training "
        "loop sets); estimate the trainer's optimizer steps with "
        "memlab.integrations.transformers.estimate(trainer)"
    )


@pytest.mark.parametrize(
    ("budget", "checkpointed", "arguments"),
    [
        ("73 MiB", ["transformer.h.0", "transformer.h.1"], {}),
        ("71 MiB", [], {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}),
    ],
    ids=["checkpointing", "micro-batches"],
)
def test_a_plan_fits_when_the_trainer_is_built_and_trained_as_it_says(
    tmp_path, budget, checkpointed, arguments
):
    """A batch of 16 needs 76 MiB: 73 MiB are met by checkpointing both GPT-2 blocks selectively (their
    matmuls' and attention's outputs kept), 71 MiB only by 4 micro-batches of 4, as the trainer's own
    gradient accumulation. Each is applied to a new trainer, whose real ``train()`` under the budget has
    exactly the planned peaks."""
    trainer = make_trainer(tmp_path / "plan", batch_size=16, accumulation=1, max_steps=2)
    found = hf.plan(trainer, budget, steps=2, device="cpu")
    assert (found.fits, found.checkpointed, found.arguments) == (True, checkpointed, arguments)
    assert found.baseline.peak_reserved == 76 * MiB
    assert not any(getattr(block, "gradient_checkpointing", False) for block in trainer.model.modules())
    sizes = {"batch_size": 16, "accumulation": 1}
    if arguments:
        sizes = {"batch_size": 4, "accumulation": 4}
        assert found.code == (
            "# in the TrainingArguments the Trainer is built with (the same effective batch):\n"
            "#   per_device_train_batch_size=4, gradient_accumulation_steps=4"
        )
    else:
        assert found.code == (
            "model = trainer.model\n"
            "from memlab.plan.checkpointing import checkpoint\n"
            "checkpoint([model.get_submodule(name) for name in ['transformer.h.0', 'transformer.h.1']], "
            "selective=True)"
        )
        assert (found.settings.selective, found.recomputed_flops) == (True, 0)
    planned = make_trainer(tmp_path / "real", max_steps=2, **sizes)
    with found.apply(planned.model):
        real = tracked_training(planned, capacity=budget)
    assert [found.estimate.peak_allocated, found.estimate.peak_reserved] == [
        real["allocated_bytes.all.peak"],
        real["reserved_bytes.all.peak"],
    ]
    with pytest.raises(torch.OutOfMemoryError):  # as it is, the trainer does not fit
        tracked_training(make_trainer(tmp_path / "as-is", batch_size=16, accumulation=1, max_steps=2), budget)


def test_a_trainer_plan_refuses_autocast(tmp_path):
    with pytest.raises(ValueError) as raised:
        hf.plan(make_trainer(tmp_path), "70 MiB", device="cpu", knobs=("autocast",))
    assert str(raised.value) == (
        "a Trainer's autocast is its TrainingArguments' bf16=True (or fp16=True): set it and plan again; "
        "the knobs for a Trainer are 'foreach', 'checkpointing', 'micro_batches'"
    )
