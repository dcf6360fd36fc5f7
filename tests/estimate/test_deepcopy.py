"""A step that deep-copies tensors (an EMA model made with ``copy.deepcopy``) estimates what a
tracked real run of it allocates, byte for byte."""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import memlab
from memlab.estimate.deepcopy import fake_deepcopy
from memlab.history import categories

KEYS = (
    "allocated_bytes.all.peak",
    "active_bytes.all.peak",
    "reserved_bytes.all.peak",
    "allocated_bytes.all.current",
    "allocation.all.allocated",
    "allocated_bytes.all.freed",
)


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))


def ema_step(model, optimizer, x, y):
    """A training step that keeps an EMA copy of the model, made in the step, plus deep copies of
    two views of one storage (they share one copy) and of a constant."""
    ema = copy.deepcopy(model)
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for kept, now in zip(ema.parameters(), model.parameters(), strict=True):
            kept.mul_(0.9).add_(now, alpha=0.1)
    table = torch.zeros(256, 64)
    halves = copy.deepcopy([table[:128], table[128:]])
    counter = copy.deepcopy(torch.tensor(0.0))
    return loss + ema[0].weight.sum() + halves[1].sum() + counter


def tracked_run(model, optimizer, x, y):
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x, y], category=categories.INPUT)
        loss = ema_step(model, optimizer, x, y)
        stats = tracker.memory_stats()
    del loss
    return {key: stats[key] for key in KEYS}


def test_an_ema_step_estimates_what_the_tracked_real_run_allocates():
    torch.manual_seed(0)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    state = {key: value.clone() for key, value in net.state_dict().items()}

    estimate = memlab.estimate(ema_step, net, optimizer, x, y, device="cpu")

    assert estimate.method == "fake"
    assert all(torch.equal(state[key], value) for key, value in net.state_dict().items())
    assert FakeTensor.__dict__.get("__deepcopy__") is None  # the estimate's copy is gone with it
    assert all(p.grad is None for p in net.parameters()) and not optimizer.state
    real = tracked_run(net, optimizer, x, y)
    assert {key: estimate.stats[key] for key in KEYS} == real


def deep_copies(tracker: memlab.TensorTracker) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    """Make a table, a parameter and weights with a gradient, then deep-copy views of the table
    with the others: bytes allocated by the copy, bytes still held once the views are gone."""
    table = torch.zeros(256, 64)  # 64 KiB
    parameter = torch.nn.Parameter(torch.ones(10))
    weights = torch.ones(10, requires_grad=True)
    weights.grad = torch.ones(10)
    start = tracker.memory_allocated()
    halves, param, copied = copy.deepcopy(([table[:128], table[128:]], parameter, weights))
    copied_bytes = tracker.memory_allocated() - start
    del halves
    return copied_bytes, tracker.memory_allocated() - start, (param, copied)


def test_a_fake_deep_copy_allocates_what_the_real_one_does():
    mode = FakeTensorMode()
    with mode, fake_deepcopy(), memlab.TensorTracker(allocator=None) as fake:
        fake_bytes, fake_left, (param, copied) = deep_copies(fake)
    with memlab.TensorTracker(allocator=None) as real:
        real_bytes, real_left, _ = deep_copies(real)

    # the table's storage once (a view copies its whole storage), the parameter's own elements
    # (Parameter.__deepcopy__ clones), the weights and their gradient
    assert fake_bytes == real_bytes == 256 * 64 * 4 + 40 + 40 + 40
    assert fake_left == real_left == 120
    keys = ("allocated_bytes.all.peak", "allocation.all.allocated", "allocated_bytes.all.freed")
    # each copy through Tensor.__deepcopy__ (halves, weights, gradient) holds a 4 B 0-dim block
    assert [fake.memory_stats()[k] for k in keys] == [real.memory_stats()[k] for k in keys]
    # freed: the table and its copy, the three 40 B sources, and the four 0-dim blocks
    assert real.memory_stats()["allocated_bytes.all.freed"] == 2 * 65536 + 3 * 40 + 4 * 4
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad and param.grad is None
    assert isinstance(copied, FakeTensor) and copied.fake_mode is mode and copied.is_leaf
    assert copied.requires_grad and copied.grad.shape == (10,)


def test_views_deep_copied_together_share_one_copy_of_their_storage():
    with FakeTensorMode(), fake_deepcopy():
        table = torch.zeros(256, 64)
        halves = copy.deepcopy([table[:128], table[128:]])
    assert halves[0].untyped_storage()._cdata == halves[1].untyped_storage()._cdata
    assert (halves[1].storage_offset(), halves[1].shape) == (128 * 64, (128, 64))
