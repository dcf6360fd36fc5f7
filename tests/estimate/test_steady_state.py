"""Estimates of later training steps: a model that has trained is estimated on fake tensors (its
optimizer's step counters stay readable), the copies free what the step frees, and ``steps=k``
equals k real steps in a row. The reference is the same step run for real on CPU under a tracker
that adopted the same objects."""

from __future__ import annotations

import copy

import pytest
import torch

import memlab
from memlab.history import categories
from memlab.sources import workspaces

KEYS = (
    "allocated_bytes.all.peak",
    "active_bytes.all.peak",
    "reserved_bytes.all.peak",
    "allocated_bytes.all.current",
    "reserved_bytes.all.current",
)
#: An H100's cuBLAS workspace (the GPU modelled here), one per thread that runs a matmul: the
#: forward's and the autograd thread's, which runs backward on a GPU (memlab.sources.workspaces).
WORKSPACE = 32 * 2**20

# torch 2.11's cuBLASLt keeps its own 1 MiB workspace for a bias addmm unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=1; from 2.12 it shares cuBLAS's (memlab.sources.workspaces)
OWN_LT = workspaces.keeps_own_cublaslt()


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def conv_bn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )


def transformer_block() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 16, 10),
    )


class GRUNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(32, 64, batch_first=True)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


MODELS = {
    "mlp": (mlp, (32, 256)),
    "conv_bn": (conv_bn, (8, 3, 16, 16)),
    "transformer": (transformer_block, (8, 16, 64)),
    "gru": (GRUNet, (8, 12, 32)),
}

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
}


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()  # set_to_none=True: the previous step's gradients are freed here
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def tracked_steps(model, optimizer, x, y, steps=1):
    """``steps`` real steps in a row, as a loop ``loss = train_step(...)`` runs them, under a
    tracker that adopted the model, the optimizer and the batch first (the order estimate adopts
    them in)."""
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x, y], category=categories.INPUT)
        loss = None
        for _ in range(steps):
            loss = train_step(model, optimizer, x, y)
        stats = tracker.memory_stats()
    del loss
    return {key: stats[key] for key in KEYS}


def snapshot(model, optimizer):
    """Everything of the user's that an estimate must leave as it was, copied."""
    return (
        copy.deepcopy(model.state_dict()),
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        copy.deepcopy(optimizer.state_dict()),
    )


def assert_same(before, after):
    (state, grads, optim), (state2, grads2, optim2) = before, after
    assert state.keys() == state2.keys() and all(torch.equal(state[k], state2[k]) for k in state)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
    assert optim["param_groups"] == optim2["param_groups"]
    assert optim["state"].keys() == optim2["state"].keys()
    for key, values in optim["state"].items():
        for name, value in values.items():
            other = optim2["state"][key][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def setup(model_name, optimizer_name, trained_steps):
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    for _ in range(trained_steps):
        train_step(model, optimizer, x, y)
    return model, optimizer, x, y


@pytest.mark.parametrize("trained", [1, 2])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_later_step_is_estimated_data_free_and_equals_the_real_step(model_name, optimizer_name, trained):
    model, optimizer, x, y = setup(model_name, optimizer_name, trained)
    before = snapshot(model, optimizer)

    estimate = memlab.estimate(train_step, model, optimizer, x, y)

    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert_same(before, snapshot(model, optimizer))
    assert {key: estimate.stats[key] for key in KEYS} == tracked_steps(model, optimizer, x, y)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_steps_runs_the_call_again_on_the_same_copies_and_equals_real_steps_in_a_row(model_name):
    model, optimizer, x, y = setup(model_name, "adamw", 0)
    estimates = {k: memlab.estimate(train_step, model, optimizer, x, y, steps=k) for k in (1, 2, 3)}

    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    for k, estimate in estimates.items():
        assert estimate.steps == k and estimate.method == "fake"
        real = tracked_steps(*setup(model_name, "adamw", 0), steps=k)
        assert {key: estimate.stats[key] for key in KEYS} == real
    # The optimizer's state and the gradients are made in step 1 and kept: step 2 needs more,
    # step 3 nothing new (the steady state).
    assert estimates[2].peak_reserved >= estimates[1].peak_reserved
    assert estimates[3].peak_reserved == estimates[2].peak_reserved
    assert estimates[3].peak_step == estimates[2].peak_step


def test_the_peak_of_adamw_is_in_step_two_and_the_text_says_how_many_steps_ran():
    """Step 1's peak is in backward, before AdamW's state exists; step 2's backward holds the state
    (two tensors the size of the parameters) too: with activations larger than the parameters,
    step 2 is the peak."""
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(4096, 1024)

    def step(model, optimizer, x):
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    one = memlab.estimate(step, model, optimizer, x)
    two = memlab.estimate(step, model, optimizer, x, steps=2)
    assert (one.steps, one.peak_step, two.steps, two.peak_step) == (1, 1, 2, 2)
    state = 2 * (1024 * 1024 * 4 + 4096)  # exp_avg and exp_avg_sq of the weight and the bias
    counters, loss = 2 * 512, 512  # the two step counters; step 1's loss, alive until step 2 returns
    # step 1's peak (in backward's elementwise ops) comes before backward's first matmul, which
    # allocates the autograd thread's workspace; step 2's has both workspaces
    assert two.peak_allocated - one.peak_allocated == state + counters + loss + WORKSPACE
    assert one.by_category("peak")["workspace"] == WORKSPACE + OWN_LT * 2**20  # forward's cuBLASLt's
    assert (one.peak_reserved, two.peak_reserved) == (
        106_954_752 + 2 * WORKSPACE,  # unchanged by 2.11's 1 MiB cuBLASLt workspace
        123_731_968 + 2 * WORKSPACE,
    )
    assert "; 1 step)" in repr(one).splitlines()[0]
    workspaces_note = (
        "3 modelled cuBLAS/cuBLASLt workspaces of the H100: 65.00M"
        if OWN_LT
        else "2 modelled cuBLAS workspaces of the H100: 64.00M"
    )
    assert (
        repr(two).splitlines()[0].endswith(f"; 2 steps, peak reserved in step 2); includes {workspaces_note}")
    )


def test_gradients_that_exist_before_the_estimate_are_freed_when_the_step_frees_them():
    """The step sets the gradients to None before it makes new ones; the copies must go then too,
    or the estimate counts the gradients twice."""
    model = torch.nn.Linear(1024, 1024, bias=False)
    x = torch.randn(8, 1024)
    model(x).sum().backward()  # a gradient of 4 MiB exists

    def step(model, x):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    estimate = memlab.estimate(step, model, x)
    weight, batch, out = 1024 * 1024 * 4, 8 * 1024 * 4, 8 * 1024 * 4
    # weight + input + the new gradient, the output and backward's temporaries, and the forward's
    # and backward's workspaces; never two gradients
    assert estimate.peak_allocated < 2 * weight + batch + out + 2 * 512 + weight // 2 + 2 * WORKSPACE
    assert estimate.stats["allocated_bytes.all.current"] == 2 * weight + batch + 2 * WORKSPACE
    assert estimate.by_category("end")["gradient"] == weight
    assert model.weight.grad is not None and float(model.weight.grad.abs().sum()) > 0


def test_a_step_that_replaces_optimizer_state_frees_the_old_copy():
    model = torch.nn.Linear(512, 512, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = [torch.randn(4, 512)]

    def step(model, optimizer, x):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    step(model, optimizer, train[0])
    buffer = 512 * 512 * 4

    def reset_and_step(model, optimizer, x):
        optimizer.state.clear()  # the momentum buffer goes; step makes a new one
        step(model, optimizer, x)

    estimate = memlab.estimate(reset_and_step, model, optimizer, train[0])
    # weight + gradient + momentum + input at the end, one momentum buffer at a time; the
    # workspaces of the forward's and backward's threads
    assert estimate.stats["allocated_bytes.all.current"] == 3 * buffer + 4 * 512 * 4 + 2 * WORKSPACE
    assert estimate.by_category("end")["optimizer_state"] == buffer
    assert len(optimizer.state) == 1


def test_steps_must_be_a_positive_int():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        memlab.estimate(model, torch.randn(1, 2), steps=0)
    with pytest.raises(TypeError, match=r"steps must be an int, got float 2\.0"):
        memlab.estimate(model, torch.randn(1, 2), steps=2.0)


def test_a_later_step_for_cuda_keeps_cudas_kernel_substitutions():
    model, optimizer, x, y = setup("transformer", "adamw", 1)
    before = snapshot(model, optimizer)
    estimate = memlab.estimate(train_step, model, optimizer, x, y, device="cuda")
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert estimate.substituted == {"scaled_dot_product_attention": 1, "dropout": 3, "optimizer_foreach": 1}
    assert_same(before, snapshot(model, optimizer))
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_cached_tensor_the_step_drops_is_freed_at_that_moment():
    namespace = {"torch": torch, "cache": torch.zeros(1024, 1024)}  # 4 MiB, held by a module global
    exec(
        "def step(x):\n    global cache\n    cache = None\n    return x * x\n",
        namespace,
    )
    estimate = memlab.estimate(namespace["step"], torch.randn(512, 512))
    matrix = 512 * 512 * 4
    # the cache is counted until the step drops it: the peak holds it and the input, not the product
    assert estimate.peak_allocated == 4 * 2**20 + matrix
    assert estimate.stats["allocated_bytes.all.current"] == 2 * matrix
    assert namespace["cache"] is not None and namespace["cache"].shape == (1024, 1024)
