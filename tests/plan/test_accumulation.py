"""memlab.plan.accumulation.accumulating: a whole training step run as micro-batches gives the
full batch's gradients and one optimizer step, whichever order the step zeroes and steps in, and
puts back the optimizer and scheduler it patched."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.history import categories
from memlab.plan.accumulation import accumulating


def make_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return model, optimizer, torch.randn(12, 16), torch.randn(12, 4)


def zero_last(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # what the optimizer steps on
    optimizer.step()
    optimizer.zero_grad()
    return grads


def zero_first(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return grads


@pytest.mark.parametrize("step", [zero_last, zero_first])
@pytest.mark.parametrize("micro_batches", [2, 3, 4, 12])
def test_the_full_batchs_gradients_and_one_optimizer_step(step, micro_batches):
    model, optimizer, x, y = make_job()
    whole = [step(model, optimizer, x, y) for _ in range(2)]  # two steps: momentum carried over
    expected = [p.detach().clone() for p in model.parameters()]
    model, optimizer, x, y = make_job()
    split = accumulating(step, micro_batches)
    results = [split(model, optimizer, x, y) for _ in range(2)]
    assert [len(result) for result in results] == [micro_batches] * 2  # step's results, one per micro-batch
    # the gradients the optimizer stepped on: the last micro-batch's, divided by their number after it
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    assert len(whole) == 2 and optimizer.state[model[0].weight]["momentum_buffer"] is not None
    assert all(("step" not in vars(optimizer), "zero_grad" not in vars(optimizer)))  # put back


def test_a_scheduler_among_the_arguments_steps_once_per_batch():
    model, optimizer, x, y = make_job()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step(model, optimizer, scheduler, x, y):
        zero_last(model, optimizer, x, y)
        scheduler.step()

    accumulating(step, 4)(model, optimizer, scheduler, x, y)
    assert (scheduler.last_epoch, optimizer.param_groups[0]["lr"]) == (1, 0.25)
    assert "step" not in vars(scheduler)


def test_an_optimizer_whose_step_a_scheduler_wrapped_keeps_that_wrapper():
    model, optimizer, x, y = make_job()
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    before = dict(vars(optimizer))
    accumulating(zero_last, 3)(model, optimizer, x, y)
    assert {key: before[key] for key in ("step", "zero_grad") if key in before} == {
        key: vars(optimizer)[key] for key in ("step", "zero_grad") if key in before
    }


def test_a_batch_that_does_not_split_evenly():
    model, optimizer, x, y = make_job()
    with pytest.raises(
        ValueError, match=r"^a batch of 12 along dimension 0 does not split into 5 equal micro"
    ):
        accumulating(zero_last, 5)(model, optimizer, x, y)
    assert "step" not in vars(optimizer)


def test_a_call_without_a_batch():
    model, optimizer, _, _ = make_job()
    with pytest.raises(ValueError, match=r"^accumulating 'zero_last': no tensor argument has a dimension 0 "):
        accumulating(zero_last, 2)(model, optimizer, 3, 4)


def test_a_step_without_its_optimizer_among_the_arguments():
    model, _, x, y = make_job()
    with pytest.raises(TypeError, match=r"^accumulating 'zero_last': no optimizer among its arguments; pass"):
        accumulating(zero_last, 2)(model, None, x, y)


@pytest.mark.parametrize(
    ("micro_batches", "error", "message"),
    [
        (0, ValueError, "micro_batches must be >= 1, got 0"),
        (1.5, TypeError, "micro_batches must be an int, got float 1.5"),
        (True, TypeError, "micro_batches must be an int, got bool True"),
    ],
)
def test_a_bad_count(micro_batches, error, message):
    with pytest.raises(error) as raised:
        accumulating(zero_last, micro_batches)
    assert str(raised.value) == message


def test_an_estimate_of_it_copies_what_the_step_names():
    """The accumulated step is a ``functools.partial`` of memlab's loop and the user's step: an
    estimate rebinds the names that step uses (``head``, a closure variable here) to copies, as for
    the step itself, and counts what a real run allocates."""
    model, optimizer, x, y = make_job()
    head = torch.nn.Linear(4, 4)
    optimizer.add_param_group({"params": list(head.parameters())})

    def step(model, optimizer, x, y):
        loss = torch.nn.functional.mse_loss(head(model(x)), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    split = accumulating(step, 3)
    before = [p.detach().clone() for p in head.parameters()]
    estimated = memlab.estimate(split, model, optimizer, x, y, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), before, strict=True))  # untouched
    assert estimated.name == "test_an_estimate_of_it_copies_what_the_step_names.<locals>.step"
    with memlab.TensorTracker(history=True) as tracker:
        tracker.add_optimizer(optimizer)  # its new state categorised as the estimate's tracker does
        tracker.adopt(roots=[model, head])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x, y], category=categories.INPUT)
        for _ in range(2):
            split(model, optimizer, x, y)
    assert estimated.peak_allocated == tracker.max_memory_allocated()
    assert estimated.by_category("end")["optimizer_state"] == tracker.by_category()["optimizer_state"] > 0
