"""memlab.max_batch_size: the largest batch that fits, checked against tracked real runs."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch

import memlab
from memlab._units import format_size
from memlab.estimate.fit import default_budget
from memlab.history import categories
from memlab.sources import workspaces

#: 48 MiB for the step's tensors, and the two 32 MiB cuBLAS workspaces of the H100 the estimates
#: and the tracked runs model (the forward's thread's and the autograd thread's).
BUDGET = 48 * 2**20 + 2 * 32 * 2**20

# torch 2.11's cuBLASLt keeps its own 1 MiB workspace for a bias addmm unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=1; from 2.12 it shares cuBLAS's (memlab.sources.workspaces)
OWN_LT = workspaces.keeps_own_cublaslt()


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


def trains(size: int, budget: int, steps: int = 3, trained: int = 0) -> bool:
    """Whether ``steps`` real training steps at ``size``, on a new model trained ``trained`` steps
    at batch 8 first, run on CPU under a tracker whose modelled GPU has ``budget`` bytes without
    ``torch.OutOfMemoryError`` (the model, optimizer and batch counted first, as estimate counts
    them)."""
    model, optimizer, step = problem()
    for _ in range(trained):
        step(*make_batch(8))
    x, y = make_batch(size)
    try:
        with memlab.TensorTracker(capacity=budget) as tracker:
            tracker.adopt(roots=[model])
            tracker.adopt(roots=[optimizer])
            tracker.adopt(roots=[x, y], category=categories.INPUT)
            for _ in range(steps):
                step(x, y)
    except torch.OutOfMemoryError:
        return False
    return True


def test_the_answer_trains_for_three_steps_and_one_more_does_not():
    model, optimizer, step = problem()
    budget = BUDGET
    fit = memlab.max_batch_size(step, make_batch, budget)
    size = fit.batch_size
    assert (fit.steps, fit.next_size) == (2, size + 1) and size > 1
    assert trains(size, budget) and not trains(size + 1, budget)
    assert fit.estimate.peak_reserved <= budget < fit.next_estimate.peak_reserved
    assert fit.estimate.steps == 2
    # doubling up to the first size that does not fit, then bisection: O(log B) estimates, and
    # the estimate without a capacity of the size just above
    assert fit.estimates <= 2 * math.ceil(math.log2(size + 1)) + 2
    # the user's model and optimizer are untouched
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    text = repr(fit)
    assert text.startswith(f"largest batch that fits in 112.00M for 2 steps in a row: {size} (peak reserved ")
    assert f"; {size + 1} needs " in repr(fit)


def test_the_first_steps_answer_runs_out_of_memory_in_the_second_step():
    """Step 1's peak (in backward) has no optimizer state yet; AdamW's state, two tensors the size
    of the parameters, is alive in every later step. The first step's answer is too large."""
    _, _, step = problem()
    budget = BUDGET
    first = memlab.max_batch_size(step, make_batch, budget, steps=1)
    steady = memlab.max_batch_size(step, make_batch, budget)
    assert first.batch_size > steady.batch_size
    assert trains(first.batch_size, budget, steps=1)
    assert not trains(first.batch_size, budget, steps=2)
    assert trains(steady.batch_size, budget, steps=3)


def test_a_model_that_has_trained_keeps_its_state_in_the_answer():
    model, optimizer, step = problem()
    step(*make_batch(8))  # gradients and AdamW state exist now
    grads = [p.grad.clone() for p in model.parameters()]
    budget = BUDGET
    fit = memlab.max_batch_size(step, make_batch, budget)
    assert fit.estimate.method == "fake"
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert [float(state["step"]) for state in optimizer.state.values()] == [1.0] * 4

    assert trains(fit.batch_size, budget, trained=1) and not trains(fit.batch_size + 1, budget, trained=1)


def test_headroom_and_bounds():
    _, _, step = problem()
    one = memlab.estimate(step, *make_batch(1), steps=2).peak_reserved
    with_headroom = memlab.max_batch_size(step, make_batch, "112 MiB", headroom=BUDGET - one + 1)
    assert with_headroom.batch_size == 0 and with_headroom.estimate is None
    assert with_headroom.next_size == 1 and with_headroom.next_estimate.peak_reserved == one
    note = "includes 2 modelled cuBLAS workspaces of the H100: 64.00M"  # the step's two matmul threads
    assert repr(with_headroom).endswith(f": 0; 1 needs {format_size(one)}; 2 estimates; {note}")
    capped = memlab.max_batch_size(step, make_batch, "112 MiB", low=3, high=5)
    assert (capped.batch_size, capped.next_estimate, capped.next_size, capped.estimates) == (5, None, None, 2)


def test_the_size_that_needs_the_bytes_is_the_one_named():
    """A search whose ``low`` does not fit names ``low`` with its bytes, not batch 1."""
    _, _, step = problem()
    fit = memlab.max_batch_size(step, make_batch, "8 MiB", low=100_000)
    needs = memlab.estimate(step, *make_batch(100_000), steps=2).peak_reserved
    assert (fit.batch_size, fit.next_size) == (0, 100_000)
    note = (
        "includes 3 modelled cuBLAS/cuBLASLt workspaces of the H100: 65.00M"
        if OWN_LT  # batch 100,000's bias addmm goes through cuBLASLt (batch 1's above does not)
        else "includes 2 modelled cuBLAS workspaces of the H100: 64.00M"
    )
    assert repr(fit).endswith(f": 0; 100000 needs {format_size(needs)}; 2 estimates; {note}")


def test_default_budget_is_the_active_trackers_capacity():
    _, _, step = problem()
    with memlab.TensorTracker(capacity="112 MiB"):
        in_tracker = memlab.max_batch_size(step, make_batch)
    assert in_tracker.budget == BUDGET
    assert in_tracker.batch_size == memlab.max_batch_size(step, make_batch, "112 MiB").batch_size
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
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        memlab.max_batch_size(step, make_batch, "1 GiB", steps=0)
    with pytest.raises(ValueError, match=r"headroom \(1.00G\) must be less than the budget \(1.00G\)"):
        memlab.max_batch_size(step, make_batch, "1 GiB", headroom="1 GiB")


def test_a_step_whose_memory_does_not_grow_with_the_batch_needs_high():
    weight = torch.nn.Linear(64, 64)

    def step(x):
        return weight(torch.ones(8, 64)).sum()

    def make_batch(size):
        return torch.ones(1)  # a batch of the same size whatever the size asked for

    with pytest.raises(ValueError) as error:
        memlab.max_batch_size(step, make_batch, "1 GiB")
    assert str(error.value) == (
        "the step's memory does not grow with the batch size (batches of 1 and 2 both request a peak of "
        f"{format_size(memlab.estimate(step, torch.ones(1), steps=2).stats['requested_bytes.all.peak'])}"
        "): pass high= to bound the search"
    )
    assert memlab.max_batch_size(step, make_batch, "1 GiB", high=64).batch_size == 64


# -- default budgets ----------------------------------------------------------------------------------
class FakeCuda:
    """What ``default_budget`` reads of a GPU, for a machine without one: ``mem_get_info``, the
    caching allocator's reserved and allocated bytes, the per-process fraction and the total."""

    def __init__(self, free: int, total: int, reserved: int, allocated: int, fraction: float = 1.0) -> None:
        self.free, self.total, self.reserved, self.allocated, self.fraction = (
            free,
            total,
            reserved,
            allocated,
            fraction,
        )

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "mem_get_info", lambda index: (self.free, self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda index: self.reserved)
        monkeypatch.setattr(cuda, "memory_allocated", lambda index: self.allocated)
        # CUDACachingAllocator.cpp: getMemoryFraction is allowed_memory_maximum / totalGlobalMem
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda index: self.fraction)
        properties = type("Properties", (), {"total_memory": self.total})()
        monkeypatch.setattr(cuda, "get_device_properties", lambda index: properties)


GIB = 2**30


def test_on_a_gpu_the_default_budget_is_free_memory_plus_what_the_allocator_caches(monkeypatch):
    FakeCuda(free=60 * GIB, total=80 * GIB, reserved=10 * GIB, allocated=4 * GIB).install(monkeypatch)
    assert default_budget(torch.device("cuda")) == 60 * GIB + 6 * GIB


def test_a_per_process_memory_fraction_caps_the_default_budget(monkeypatch):
    # set_per_process_memory_fraction(0.25) on an 80 GiB GPU: the allocator may reserve 20 GiB in
    # all, 10 GiB more than it holds, although mem_get_info reports 60 GiB free
    FakeCuda(free=60 * GIB, total=80 * GIB, reserved=10 * GIB, allocated=4 * GIB, fraction=0.25).install(
        monkeypatch
    )
    assert default_budget(torch.device("cuda")) == 10 * GIB + 6 * GIB
    # a fraction above what is free leaves the free memory as the limit
    FakeCuda(free=5 * GIB, total=80 * GIB, reserved=10 * GIB, allocated=4 * GIB, fraction=0.5).install(
        monkeypatch
    )
    assert default_budget(torch.device("cuda")) == 5 * GIB + 6 * GIB
    # reserved beyond the limit already (the fraction lowered later): only the cached bytes remain
    FakeCuda(free=60 * GIB, total=80 * GIB, reserved=10 * GIB, allocated=4 * GIB, fraction=0.1).install(
        monkeypatch
    )
    assert default_budget(torch.device("cuda")) == 6 * GIB


def test_the_fraction_is_read_back_to_the_allocators_byte_limit(monkeypatch):
    total = 85_899_345_920  # an 80 GiB GPU
    allowed = int(0.3 * total)  # static_cast<size_t>(fraction * totalGlobalMem)
    FakeCuda(free=total, total=total, reserved=0, allocated=0, fraction=allowed / total).install(monkeypatch)
    assert default_budget(torch.device("cuda")) == allowed


def test_without_a_gpu_the_default_budget_for_cuda_is_the_modelled_gpus_memory_less_the_context():
    from memlab._gpus import CONTEXT_ALLOWANCE, GPUS

    assert default_budget(torch.device("cuda")) == GPUS["H100"].total_memory - CONTEXT_ALLOWANCE
    assert default_budget(torch.device("cuda"), "A100-40GB") == 40_960 * 2**20 - 512 * 2**20
    with memlab.TensorTracker(gpu="L4"):
        assert default_budget(torch.device("cuda")) == 23_034 * 2**20 - 512 * 2**20  # the tracker's GPU
    with memlab.TensorTracker(gpu="L4", capacity="1 GiB"):
        assert default_budget(torch.device("cuda")) == GIB  # a capacity comes first
    with pytest.raises(ValueError, match=r"^gpu sm120 has no known total memory: name a GPU"):
        default_budget(torch.device("cuda"), "sm120")


def test_max_batch_size_for_a_named_gpu_defaults_to_cuda_and_its_memory():
    _, _, step = problem()
    fit = memlab.max_batch_size(step, make_batch, gpu="T4", high=64)
    assert fit.budget == 15_360 * 2**20 - 512 * 2**20
    assert (fit.batch_size, fit.estimate.device.type, fit.estimate.gpu.name) == (64, "cuda", "T4")
    lt = OWN_LT * 2**20  # 2.11's own cuBLASLt workspace, at most the cuBLAS one
    assert fit.estimate.by_category("end")["workspace"] == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8) + lt
    with pytest.raises(ValueError, match=r"^gpu 'Z80' is not a GPU memlab knows"):
        memlab.max_batch_size(step, make_batch, gpu="Z80")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_search_shows_each_batch_tried_and_logs_each_result(monkeypatch, caplog):
    monkeypatch.delenv("MEMLAB_PROGRESS", raising=False)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    caplog.set_level(logging.INFO, logger="memlab")
    _, _, step = problem()
    budget = 112 * 2**20
    fit = memlab.max_batch_size(step, make_batch, budget, low=3, high=5)
    three, five = (format_size(memlab.estimate(step, *make_batch(b), steps=2).peak_reserved) for b in (3, 5))
    lines = [
        "memlab max_batch_size: trying batch 3 (estimate 1)",
        f"memlab max_batch_size: batch 3 fits, peak reserved {three} (1 estimate)",
        "memlab max_batch_size: trying batch 5 (estimate 2)",
        f"memlab max_batch_size: batch 5 fits, peak reserved {five} (2 estimates)",
        f"memlab max_batch_size: {fit!r}",
    ]
    widths = [0, *(len(line) for line in lines)]
    assert (
        terminal.getvalue()
        == "".join("\r" + line.ljust(width) for line, width in zip(lines, widths, strict=False)) + "\n"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "memlab"] == [
        line.removeprefix("memlab ") for line in (lines[1], lines[3], lines[4])
    ]


def test_a_batch_that_does_not_fit_is_said_so_and_then_measured(monkeypatch):
    monkeypatch.delenv("MEMLAB_PROGRESS", raising=False)
    _, _, step = problem()
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    fit = memlab.max_batch_size(step, make_batch, "8 MiB", low=100_000)
    assert terminal.getvalue().split("\r")[1:] == [
        "memlab max_batch_size: trying batch 100000 (estimate 1)",
        "memlab max_batch_size: batch 100000 does not fit in 8.00M (1 estimate)",
        "memlab max_batch_size: estimating what batch 100000 needs (estimate 2)",
        f"memlab max_batch_size: {fit!r}".ljust(
            len("memlab max_batch_size: estimating what batch 100000 needs (estimate 2)")
        )
        + "\n",
    ]


def test_the_search_is_quiet_when_stderr_is_not_a_terminal_or_when_asked(monkeypatch, capsys):
    monkeypatch.delenv("MEMLAB_PROGRESS", raising=False)
    _, _, step = problem()
    memlab.max_batch_size(step, make_batch, "112 MiB", low=3, high=5)  # pytest's stderr: not a terminal
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    memlab.max_batch_size(step, make_batch, "112 MiB", low=3, high=5, progress=False)
    monkeypatch.setenv("MEMLAB_PROGRESS", "0")
    memlab.max_batch_size(step, make_batch, "112 MiB", low=3, high=5)
    assert terminal.getvalue() == "" and capsys.readouterr().err == ""
