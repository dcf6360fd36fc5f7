"""One answer to "does it fit": Estimate.fits and max_batch_size ask whether the step completes
under an allocator capped at the budget (retry path included), checked against capped tracked runs."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.history import categories

MiB = 2**20
BUDGET = 64 * MiB


def growing_step(x):
    """A step whose second temporary is larger than its first: an allocator that never frees its
    cache keeps the first one's segment and takes a new one for the second; capped, it frees the
    first one's (cached, unused) segment and retries."""
    pair = torch.cat([x, x])
    total = pair.sum()
    del pair
    triple = torch.cat([x, x, x])
    return total + triple.sum()


def rows(size):
    return torch.randn(size, 1024)


def capped_run(size: int, budget: int) -> memlab.TensorTracker:
    """A real run of ``growing_step`` on CPU, counted by a tracker whose modelled GPU (the H100)
    has ``budget`` bytes, the batch counted first as an estimate counts it; raises
    ``torch.OutOfMemoryError`` where it does not fit."""
    x = rows(size)
    with memlab.TensorTracker(capacity=budget, gpu="H100") as tracker:
        tracker.adopt(roots=[x], category=categories.INPUT)
        growing_step(x)
    return tracker


def test_fits_agrees_with_a_capped_tracked_run_at_the_boundary_batch():
    """Batch 3925: x is 16,076,800 B (a 16 MiB segment), the pair 32,153,600 B (32 MiB), the
    triple 48,230,400 B (46 MiB), the sums one 2 MiB small segment: 96 MiB unbounded, 64 MiB once
    the pair's cached segment is freed for the triple. Batch 3926: the triple is 48,242,688 B, a
    48 MiB segment: 66 MiB even after the retry. A real H100 (torch 2.11.0+cu130, the cap set with
    ``torch.cuda.set_per_process_memory_fraction``, 2026-11-27) gave the same: batch 3925 completes
    at 67,108,864 B reserved with one retry; 3926, and 3925 under 64 MiB - 1 B, run out of memory."""
    fit = memlab.max_batch_size(growing_step, rows, BUDGET, steps=1)
    assert (fit.batch_size, fit.next_size) == (3925, 3926)
    at, above = memlab.estimate(growing_step, rows(3925)), memlab.estimate(growing_step, rows(3926))
    assert at.peak_reserved == 96 * MiB > BUDGET  # an allocator that never frees its cache
    assert at.fits(BUDGET) and at.fits("64 MiB")
    assert not above.fits(BUDGET)
    assert at.fits(BUDGET + 1 * MiB, headroom=1 * MiB) and not at.fits(BUDGET, headroom=1)

    tracker = capped_run(3925, BUDGET)
    stats = tracker.memory_stats()
    assert (stats["reserved_bytes.all.peak"], stats["num_alloc_retries"]) == (64 * MiB, 1)
    assert fit.estimate.stats["reserved_bytes.all.peak"] == 64 * MiB
    assert fit.estimate.stats["num_alloc_retries"] == 1
    with pytest.raises(torch.OutOfMemoryError):
        capped_run(3926, BUDGET)
    # one byte less than the 64 MiB the capped run reserves: neither fits
    assert not at.fits(BUDGET - 1)
    with pytest.raises(torch.OutOfMemoryError):
        capped_run(3925, BUDGET - 1)


def test_an_estimate_within_the_budget_is_not_run_again():
    at = memlab.estimate(growing_step, rows(100))
    at._rerun = None  # a second run would fail
    assert at.fits(at.peak_reserved) and at.fits(BUDGET)


def test_an_estimate_whose_tensors_alone_exceed_the_budget_is_not_run_again():
    at = memlab.estimate(growing_step, rows(3925))
    requested = at.stats["requested_bytes.all.peak"]  # x, the pair or the triple, and the sums
    at._rerun = None  # a second run would fail
    assert not at.fits(requested - 1)
