"""memlab.max_batch_size: the largest batch that fits, checked against tracked real runs."""

from __future__ import annotations

import math

import pytest
import torch

import memlab
from memlab.history import categories


def problem():
    """A training step that names its model and optimizer as closure variables (made per test: a
    module-level model would stay alive for every later test of the session)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, step


def make_batch(size):
    return torch.randn(size, 512), torch.randint(0, 10, (size,))


def tracked_peak_reserved(model, optimizer, step, size: int) -> int:
    """A real run of the step at ``size`` on CPU, the arguments counted first as estimate counts them."""
    x, y = make_batch(size)
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x, y], category=categories.INPUT)
        step(x, y)
        peak = tracker.max_memory_reserved()
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    return peak


def test_the_answer_fits_and_one_more_does_not_in_tracked_runs():
    model, optimizer, step = problem()
    budget = 48 * 2**20
    fit = memlab.max_batch_size(step, make_batch, budget)
    size = fit.batch_size
    assert size > 1
    assert fit.estimate.peak_reserved <= budget < fit.next_estimate.peak_reserved
    assert tracked_peak_reserved(model, optimizer, step, size) == fit.estimate.peak_reserved
    assert tracked_peak_reserved(model, optimizer, step, size + 1) == fit.next_estimate.peak_reserved
    # doubling up to the first size that does not fit, then bisection: O(log B) estimates
    assert fit.estimates <= 2 * math.ceil(math.log2(size + 1)) + 1
    # the user's model and optimizer are untouched
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    assert repr(fit).startswith(f"largest batch that fits in 48.00M: {size} (peak reserved ")


def test_headroom_and_bounds():
    _, _, step = problem()
    fit = memlab.max_batch_size(step, make_batch, "48 MiB")
    with_headroom = memlab.max_batch_size(step, make_batch, "48 MiB", headroom=fit.estimate.peak_reserved)
    assert with_headroom.batch_size == 0 and with_headroom.estimate is None
    assert with_headroom.next_estimate.peak_reserved == memlab.estimate(step, *make_batch(1)).peak_reserved
    capped = memlab.max_batch_size(step, make_batch, "48 MiB", low=3, high=5)
    assert (capped.batch_size, capped.next_estimate, capped.estimates) == (5, None, 2)


def test_default_budget_is_the_active_trackers_capacity():
    _, _, step = problem()
    with memlab.TensorTracker(capacity="48 MiB"):
        in_tracker = memlab.max_batch_size(step, make_batch)
    assert in_tracker.budget == 48 * 2**20
    assert in_tracker.batch_size == memlab.max_batch_size(step, make_batch, "48 MiB").batch_size
    with pytest.raises(
        ValueError, match="budget: no CUDA GPU to read free memory from and no active TensorTracker"
    ):
        memlab.max_batch_size(step, make_batch)


def test_bad_arguments_are_typed_errors():
    _, _, step = problem()
    with pytest.raises(ValueError, match="low must be >= 1, got 0"):
        memlab.max_batch_size(step, make_batch, "1 GiB", low=0)
    with pytest.raises(ValueError, match="high must be >= 4, got 2"):
        memlab.max_batch_size(step, make_batch, "1 GiB", low=4, high=2)
    with pytest.raises(TypeError, match="make_batch must be callable"):
        memlab.max_batch_size(step, 3, "1 GiB")
    with pytest.raises(ValueError, match="budget 'big' is not a size"):
        memlab.max_batch_size(step, make_batch, "big")
