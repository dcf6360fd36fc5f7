"""memlab.autobatch: micro-batches give the full batch's gradients and fit where the full batch does not."""

from __future__ import annotations

import warnings

import pytest
import torch

import memlab

#: The two 32 MiB cuBLAS workspaces of the H100 that the trackers below model (the forward's
#: thread's and the autograd thread's), on top of each small GPU's memory for tensors.
WORKSPACES = 2 * 32 * 2**20


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 10),
    )


def full_batch_gradients(model, loss_fn, *batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(*batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize(("make", "shape"), [(mlp, (9, 256)), (small_cnn, (9, 3, 16, 16))])
def test_uneven_micro_batches_give_the_full_batch_gradients(make, shape):
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(*shape), torch.randint(0, 10, (9,))

    def loss_fn(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    expected_loss, expected = full_batch_gradients(model, loss_fn, x, y)
    wrapped = memlab.autobatch(loss_fn, micro_batch=4)  # 4 + 4 + 1
    loss = wrapped(x, y)
    assert wrapped.micro_batch_size == 4
    torch.testing.assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad)


def test_keyword_and_whole_arguments_and_batch_dim():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    x = torch.randn(5, 6, 16)  # batch along dim 1
    weight = torch.rand(4)  # not batch-shaped: passed whole

    def loss_fn(x, *, weight):
        return (model(x) * weight).mean()

    expected_loss, expected = full_batch_gradients(model, lambda x: loss_fn(x, weight=weight), x)
    wrapped = memlab.autobatch(batch_dim=1, micro_batch=4)(loss_fn)
    torch.testing.assert_close(wrapped(x, weight=weight), expected_loss)
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad)


def big_step():
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(8192, 256), torch.randint(0, 10, (8192,))

    def loss_fn(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    return model, loss_fn, x, y


def test_inside_a_capacity_where_the_full_batch_fails_the_wrapped_step_fits():
    model, loss_fn, x, y = big_step()
    expected_loss, expected = full_batch_gradients(model, loss_fn, x, y)
    with memlab.TensorTracker(capacity=64 * 2**20 + WORKSPACES) as tracker:
        tracker.adopt(roots=[model, x, y])
        with pytest.raises(torch.OutOfMemoryError):
            loss_fn(x, y).backward()
    model.zero_grad(set_to_none=True)

    with memlab.TensorTracker(capacity=64 * 2**20 + WORKSPACES) as tracker:
        tracker.adopt(roots=[model, x, y])
        wrapped = memlab.autobatch(loss_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the estimate's choice fits: no out-of-memory retry
            loss = wrapped(x, y)
        peak = tracker.max_memory_reserved()
    assert 1 < wrapped.micro_batch_size < 8192
    assert peak <= 64 * 2**20 + WORKSPACES
    torch.testing.assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad)


def test_on_a_model_with_gradients_the_chosen_micro_batch_fits_and_one_more_does_not():
    """The choice holds for the whole micro-batch loop (every micro-batch after the first runs with
    the gradients of the ones before), and one more sample per micro-batch runs out of memory."""

    def run(micro_batch):
        model, loss_fn, x, y = big_step()
        loss_fn(x[:16], y[:16]).backward()  # the model has gradients already
        with memlab.TensorTracker(capacity=40 * 2**20 + WORKSPACES) as tracker:
            tracker.adopt(roots=[model, x, y])
            wrapped = memlab.autobatch(loss_fn, budget=40 * 2**20 + WORKSPACES, micro_batch=micro_batch)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrapped(x, y)
        return wrapped.micro_batch_size, [str(w.message) for w in caught]

    chosen, warned = run(None)
    assert 1 < chosen < 8192 and warned == []
    assert run(chosen) == (chosen, [])
    _, warned = run(chosen + 1)
    assert warned[0].startswith(f"autobatch: out of memory with micro-batches of {chosen + 1} (of 8192)")


def test_out_of_memory_restores_gradients_halves_and_warns():
    model, loss_fn, x, y = big_step()
    _, expected = full_batch_gradients(model, loss_fn, x, y)
    before = [torch.full_like(p, 0.5) for p in model.parameters()]
    for param, grad in zip(model.parameters(), before, strict=True):
        param.grad = grad.clone()
    with memlab.TensorTracker(capacity=64 * 2**20 + WORKSPACES) as tracker:
        tracker.adopt(roots=[model, x, y])
        wrapped = memlab.autobatch(loss_fn, micro_batch=8192)
        with pytest.warns(RuntimeWarning) as caught:
            wrapped(x, y)
    assert [str(w.message) for w in caught] == [
        "autobatch: out of memory with micro-batches of 8192 (of 8192); gradients restored to their state "
        "before the step, retrying with micro-batches of 4096",
    ]
    assert wrapped.micro_batch_size == 4096
    for param, grad, old in zip(model.parameters(), expected, before, strict=True):
        torch.testing.assert_close(param.grad, old + grad)  # accumulated once, not twice


def test_batch_norm_in_training_mode_is_named_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def loss_fn(x):
        return model(x).mean()

    wrapped = memlab.autobatch(loss_fn, micro_batch=2)
    with pytest.warns(UserWarning) as caught:
        wrapped(torch.randn(6, 8))
    assert [str(w.message) for w in caught] == [
        "autobatch: 1 (BatchNorm1d) in training mode normalise over the whole batch, so micro-batches of 2 "
        "(of 6) give different outputs, running statistics and gradients than the full batch"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(torch.randn(6, 8))


def test_bad_use_is_a_typed_error():
    with pytest.raises(ValueError, match=r"micro_batch must be None .* or an int >= 1, got 0"):
        memlab.autobatch(lambda x: x.mean(), micro_batch=0)
    with pytest.raises(ValueError, match="batch_dim must be an int >= 0, got -1"):
        memlab.autobatch(lambda x: x.mean(), batch_dim=-1)
    wrapped = memlab.autobatch(lambda x: x, micro_batch=2)
    with pytest.raises(TypeError, match=r"must return a scalar tensor .*got \(2,\)"):
        wrapped(torch.ones(4))
    with pytest.raises(TypeError, match="was called without a tensor argument that has a dimension 0"):
        wrapped(3)


@pytest.mark.parametrize("micro_batch", [None, 4])
def test_an_empty_batch_gives_what_the_loss_function_gives_for_it(micro_batch):
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(9, 256), torch.randn(9, 10)

    def loss_fn(x, y):
        return torch.nn.functional.mse_loss(model(x), y)

    expected_loss, expected = full_batch_gradients(model, loss_fn, x[:0], y[:0])
    assert expected_loss.isnan() and all(bool((g == 0).all()) for g in expected)  # a mean over nothing
    wrapped = memlab.autobatch(loss_fn, micro_batch=micro_batch, budget="1 MiB")
    loss = wrapped(x[:0], y[:0])
    assert loss.isnan() and not loss.requires_grad
    assert wrapped.micro_batch_size == 0 and wrapped.micro_batch_sizes == {}
    for param, grad in zip(model.parameters(), expected, strict=True):
        assert torch.equal(param.grad, grad)
