"""The estimate's tracker: one Python dispatch mode above the fake mode, as many bytes as before."""

from __future__ import annotations

import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

import memlab
from memlab.estimate.values import stands_for


def repeat_by_loaded_counts(x):
    """Repeats ``x`` as often as a batch made "by a data loader" says: in an estimate the batch is a
    fake tensor whose values the run is told (``stands_for``); in a real run it holds them."""
    print([type(mode).__name__ for mode in _get_current_dispatch_mode_stack()])
    counts = torch.empty(3, dtype=torch.int64)
    with _disable_current_modes():
        loaded = torch.tensor([3, 1, 2])
    if isinstance(counts, FakeTensor):
        stands_for(counts, loaded)
    else:
        counts.copy_(loaded)
    print(counts.tolist())
    return x.repeat(int(counts.sum()))


def test_an_estimate_runs_the_tracker_alone_above_the_fake_mode_and_its_host_values_still_answer(capsys):
    x = torch.randn(1000)
    tracker = memlab.TensorTracker()
    with tracker:
        real = repeat_by_loaded_counts(x)
    assert capsys.readouterr().out == "['TensorTracker']\n[3, 1, 2]\n"
    assert real.shape == (6000,)

    estimate = memlab.estimate(repeat_by_loaded_counts, x)

    # HostValues is off the stack while the tracker runs (the tracker calls it), and back after.
    assert capsys.readouterr().out == "['FaithfulFakeTensorMode', 'EstimateTracker']\n[3, 1, 2]\n"
    assert _get_current_dispatch_mode_stack() == []
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    # the real run's blocks (counts, the result) and the estimate's copy of x: 4000 B -> 4096 B
    assert estimate.peak_allocated == tracker.max_memory_allocated() + 4096 == 28672


def exp_plus_a_sum_made_in_a_thread(x):
    sums = []
    worker = threading.Thread(target=lambda: sums.append((x * 2).sum()))
    worker.start()
    worker.join()
    return x.exp() + sums[0]


def test_the_ops_of_a_thread_the_step_starts_are_counted_as_in_a_real_run():
    x = torch.randn(1000)
    tracker = memlab.TensorTracker()
    with tracker:
        exp_plus_a_sum_made_in_a_thread(x)

    estimate = memlab.estimate(exp_plus_a_sum_made_in_a_thread, x)

    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert estimate.peak_allocated == tracker.max_memory_allocated() + 4096 == 12800
