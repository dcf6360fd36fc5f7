"""memlab.plan's step settings: the optimizers' ``foreach`` off and bf16 autocast, each kept only
where it lowers the peak, checked by real tracked runs under the budget
(``TensorTracker(capacity=budget)``) of the step as the plan changes it."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.plan.checkpointing import is_checkpointed
from memlab.plan.settings import Settings
from tests.plan.test_planner import STEPS, tracked_steps, train_step

MIB = 2**20


def linear_job(optimizer=torch.optim.AdamW, **options):
    """Eight 2048x2048 linear layers (128 MiB of parameters) and a batch of 8: the optimizer step,
    not the activations, sets the peak."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    options.setdefault("foreach", True)
    return model, optimizer(model.parameters(), **options), torch.randn(8, 2048)


def encoder_job():
    from tests.plan.test_planner import make_model

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(1)
    return model, optimizer, torch.randn(32, 256, 128)


def real(job, capacity, step=train_step) -> dict[str, int]:
    return tracked_steps(*job, capacity=capacity, step=step)


def test_optimizers_that_step_per_parameter_fit_where_their_multi_tensor_kernels_do_not():
    model, optimizer, _ = job = linear_job()
    found = memlab.plan(train_step, *job, budget="650 MiB", steps=STEPS)
    assert (found.fits, found.settings, found.checkpointed) == (True, Settings(per_parameter=True), [])
    assert found.baseline.peak_reserved == 706 * MIB
    assert found.setting_tries == [(Settings(per_parameter=True), True, 610 * MIB)]
    assert repr(found).splitlines()[0] == (
        "Plan for a budget of 650.00M: optimizers step per parameter (foreach=False): +0.0% compute, "
        f"{found.extra_time:+.1%} time on H100 (roofline)"
    )
    assert optimizer.param_groups[0]["foreach"] is True  # planning changed nothing of the user's
    with pytest.raises(torch.OutOfMemoryError):  # as it is, a real run does not fit
        real(linear_job(), "650 MiB")
    with found.apply(model, optimizer):
        assert [group["foreach"] for group in optimizer.param_groups] == [False]
        assert real(job, "650 MiB") == {
            "reserved": found.estimate.peak_reserved,
            "allocated": found.estimate.peak_allocated,
        }
    assert optimizer.param_groups[0]["foreach"] is True  # removed: as it was


def test_the_pasted_code_turns_foreach_off_and_fits():
    _, optimizer, _ = job = linear_job()
    found = memlab.plan(train_step, *job, budget="650 MiB", steps=STEPS)
    assert found.code == (
        "for group in optimizer.param_groups:  # per parameter, no multi-tensor kernels\n"
        '    group["foreach"] = False'
    )
    exec(found.code, {"optimizer": optimizer})
    assert real(job, "650 MiB")["reserved"] == found.estimate.peak_reserved


def test_a_plan_that_changes_the_optimizer_needs_it_to_be_applied():
    model, optimizer, _ = job = linear_job()
    found = memlab.plan(train_step, *job, budget="650 MiB", steps=STEPS)
    with pytest.raises(ValueError) as raised:
        found.apply(model)
    assert str(raised.value) == (
        "this plan steps the optimizers per parameter (foreach=False): pass the optimizer too, "
        "plan.apply(model, optimizer)"
    )
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer or several, got \[1\]"):
        found.apply(model, [1])
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer or several, got 5"):
        found.apply(model, 5)
    assert optimizer.param_groups[0]["foreach"] is True


def test_a_setting_that_lowers_nothing_is_not_kept_and_says_why():
    """SGD with momentum: its multi-tensor step makes no temporaries as large as the parameters."""
    job = linear_job(torch.optim.SGD, lr=0.1, momentum=0.9)
    found = memlab.plan(train_step, *job, budget="300 MiB", steps=STEPS, knobs=("foreach",))
    verdict = "does not fit with these knobs: the least the step needs is 450.00M reserved, with no change"
    assert (found.fits, found.settings) == (False, Settings())
    assert found.rejected == {
        "foreach": "the peak is no lower with optimizers step per parameter (foreach=False): 450.00M "
        "reserved, 450.00M without"
    }
    assert repr(found).splitlines() == [
        f"Plan for a budget of 300.00M: {verdict}",
        "  as it is: 450.00M reserved at peak",
        "  tried optimizers step per parameter (foreach=False): does not fit, 450.00M reserved (unbounded)",
        f"  foreach not kept: {found.rejected['foreach']}",
        "  blocks checkpointed  fits  peak reserved (unbounded)",
        "                   0    no        450.00M",
    ]
    assert found.code == f"# {verdict}"


def test_an_optimizer_already_stepping_per_parameter_is_not_tried():
    fused = linear_job(foreach=None, fused=True)
    found = memlab.plan(train_step, *fused, budget="300 MiB", steps=STEPS, knobs=["foreach"])
    assert found.setting_tries == []  # nothing estimated but the step as it is
    job = linear_job()
    job[1].param_groups[0]["foreach"] = False
    found = memlab.plan(train_step, *job, budget="300 MiB", steps=STEPS, knobs=["foreach"])
    assert found.rejected == {
        "foreach": "no optimizer the step can reach runs multi-tensor kernels (foreach off or fused, or "
        "PyTorch's default on cpu)"
    }
    assert found.setting_tries == []


def test_bf16_autocast_is_tried_only_when_asked_for_and_fits_in_a_real_run():
    job = encoder_job()
    assert memlab.plan(train_step, *job, budget="300 MiB", steps=STEPS).settings == Settings()
    found = memlab.plan(train_step, *job, budget="300 MiB", steps=STEPS, knobs=("autocast", "checkpointing"))
    assert (found.fits, found.settings, found.checkpointed) == (True, Settings(autocast=True), [])
    assert (found.baseline.peak_reserved, found.estimate.peak_reserved) == (412 * MIB, 286 * MIB)
    assert repr(found).splitlines()[0] == (
        f"Plan for a budget of 300.00M: bf16 autocast: +0.0% compute, {found.extra_time:+.1%} time on H100 "
        "(roofline)"
    )
    assert found.extra_time < -0.5  # bf16 on the tensor cores: under half the float32 step's time
    assert real(encoder_job(), "300 MiB", found.step(train_step)) == {
        "reserved": found.estimate.peak_reserved,
        "allocated": found.estimate.peak_allocated,
    }
    namespace = {"train_step": train_step}
    exec(found.code, namespace)  # the pasted code: the same autocast step
    assert namespace["train_step"].args == found.step(train_step).args == (train_step, "cpu", torch.bfloat16)


def test_autocast_and_checkpointing_together_fit_when_applied():
    model, _, _ = job = encoder_job()
    found = memlab.plan(train_step, *job, budget="200 MiB", steps=STEPS, knobs=("autocast", "checkpointing"))
    assert found.fits and found.settings == Settings(autocast=True)
    assert found.checkpointed and len(found.checkpointed) < 6
    assert (
        repr(found)
        .splitlines()[0]
        .startswith(
            f"Plan for a budget of 200.00M: bf16 autocast, checkpoint {len(found.checkpointed)} of 6 blocks"
        )
    )
    with found.apply(model):
        assert sum(is_checkpointed(layer) for layer in model.layers) == len(found.checkpointed)
        assert real(job, "200 MiB", found.step(train_step)) == {
            "reserved": found.estimate.peak_reserved,
            "allocated": found.estimate.peak_allocated,
        }
    assert not any(is_checkpointed(module) for module in model.modules())


@pytest.mark.parametrize(
    ("knobs", "error", "message"),
    [
        (
            "autocast",
            TypeError,
            "knobs must be a collection of knob names such as ('checkpointing',), got str 'autocast'",
        ),
        (3, TypeError, "knobs must be a collection of knob names such as ('checkpointing',), got int 3"),
        (
            ["bf16"],
            ValueError,
            "unknown knob 'bf16': the knobs are 'autocast', 'foreach', 'selective', 'checkpointing', "
            "'micro_batches'",
        ),
    ],
)
def test_bad_knobs(knobs, error, message):
    with pytest.raises(error) as raised:
        memlab.plan(train_step, *linear_job(), budget="1 GiB", knobs=knobs)
    assert str(raised.value) == message
