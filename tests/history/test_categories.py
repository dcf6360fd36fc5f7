"""Categories of blocks: parameters, buffers, gradients, optimizer state, activations, inputs, temporaries."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab import TensorTracker
from memlab.history.categories import CATEGORIES, category_code
from memlab.history.recorder import History
from memlab.sources.allocator import CachingAllocatorModel


def _blocks(nbytes: int) -> int:
    """Bytes of the allocator's block for ``nbytes``: rounded up to 512 B."""
    return -(-nbytes // 512) * 512


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).pow(2).sum()
    loss.backward(retain_graph=True)  # the graph and its saved activations live on through the step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Block bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(map(_blocks, storages.values()))


def test_the_category_names_are_pytorchs_plus_buffer_and_workspace():
    assert CATEGORIES == (
        "unknown",
        "parameter",
        "buffer",
        "gradient",
        "optimizer_state",
        "activation",
        "input",
        "workspace",
        "temporary",
    )


def test_an_unknown_category_is_a_value_error_naming_the_valid_ones():
    valid = "unknown, parameter, buffer, gradient, optimizer_state, activation, input, workspace, temporary"
    with pytest.raises(ValueError, match=f"category must be one of {valid}; got 'weights'"):
        category_code("weights")


def test_bytes_by_category_at_the_peak_of_a_training_step_equal_sums_computed_independently():
    with TensorTracker(history=True) as tracker:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.add_model(model)
        tracker.add_optimizer(optimizer)
        x = torch.randn(4, 64)
        _training_step(model, optimizer, x)
    peak = tracker.by_category(at="peak")

    # The same step untracked, its saved tensors seen by the innermost (here: the only) pack hook,
    # which keeps (address, bytes) of each storage: the retained graph keeps them alive, so
    # addresses stay distinct (holding the tensors would make a cycle through the graph).
    twin, saved = _model(), {}
    twin_optimizer = torch.optim.AdamW(twin.parameters())

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = twin(x.clone()).pow(2).sum()
    loss.backward(retain_graph=True)
    gradients = [p.grad for p in twin.parameters()]
    twin_optimizer.step()
    for p in twin.parameters():
        saved.pop(p.untyped_storage().data_ptr(), None)  # a saved weight is a parameter
    state = [v for s in optimizer.state.values() for v in s.values()]

    assert {k: peak[k] for k in ("parameter", "gradient", "optimizer_state", "activation")} == {
        "parameter": _storage_bytes(list(model.parameters())),
        "gradient": _storage_bytes(gradients),
        "optimizer_state": _storage_bytes(state),
        "activation": sum(map(_blocks, saved.values())),
    }
    assert (peak["parameter"], peak["gradient"], peak["optimizer_state"]) == (25_600, 25_600, 53_248)
    assert (peak["buffer"], peak["input"]) == (0, 0)
    assert sum(peak.values()) == tracker.max_memory_allocated()


def test_bytes_by_category_now_are_the_live_blocks_and_a_model_made_before_entry_is_not_counted():
    model = _model()  # its parameters existed before the tracker: pre-existing, never counted
    with TensorTracker(history=True, model=model) as tracker:
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.add_optimizer(optimizer)
        _training_step(model, optimizer, torch.randn(4, 64))
    now = tracker.by_category()
    assert (now["parameter"], now["gradient"], now["optimizer_state"], now["temporary"]) == (0, 0, 53_248, 0)
    assert sum(now.values()) == tracker.memory_allocated()


def test_parameters_created_in_the_tracker_are_parameters_in_the_snapshots_blocks_and_entries():
    with TensorTracker(history=True) as tracker:
        layer = torch.nn.Linear(100, 100)
        tracker.add_model(layer)
    snapshot = tracker.snapshot()
    blocks = [b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [(b["size"], b["category"]) for b in blocks] == [(40_448, "parameter"), (512, "parameter")]
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert [(e["size"], e["category"]) for e in allocs] == [(40_000, "parameter"), (400, "parameter")]


def test_a_gradient_made_by_backward_updates_its_alloc_entry():
    with TensorTracker(history=True) as tracker:
        holder = torch.nn.Module()
        holder.weight = torch.nn.Parameter(torch.ones(1000))
        tracker.add_model(holder)
        (holder.weight * 2).sum().backward()
    assert tracker.by_category()["gradient"] == 4096
    grad_entry = next(e for e in tracker.snapshot()["device_traces"][0] if e.get("category") == "gradient")
    assert (grad_entry["action"], grad_entry["size"]) == ("alloc", 4000)


def test_tensors_saved_for_backward_are_activations_and_freed_intermediates_temporaries():
    w = torch.ones(100, requires_grad=True)
    with TensorTracker(history=True) as tracker:
        h = (w * 3).exp()  # w * 3 (400 B) is saved by nothing and freed; exp saves its output h
        y = h.sum()  # the peak came before, while w * 3 and h were both alive
    assert (tracker.by_category()["activation"], tracker.by_category()["unknown"]) == (512, 512)
    peak = tracker.by_category(at="peak")
    assert (peak["activation"], peak["temporary"], peak["unknown"]) == (512, 512, 0)
    del h, y


def test_saved_leaves_are_activations_kept_without_a_detach_and_every_graph_is_freed():
    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with TensorTracker(history=True) as tracker, Ops() as ops:
        w, v = torch.ones(1000, requires_grad=True), torch.ones(1000, requires_grad=True)
        x = torch.ones(1000)  # a leaf that needs no gradient
        product = w * v  # saves the two leaves as they are: no op besides mul
        scaled = product * x  # saves x only (product is not needed: x needs no gradient)
        assert ops.names == ["ones.default"] * 3 + ["mul.Tensor"] * 2
        y = scaled.exp()  # saves its output, which refers to its own node: detached
        assert ops.names[5] == "exp.default" and "detach.default" in ops.names[6:]  # (2.8 detaches too)
        assert (tracker.by_category()["activation"], tracker.memory_allocated()) == (4 * 4096, 6 * 4096)
        del product, scaled, y  # the graph and the output it saved are freed (no reference cycle)
        assert tracker.memory_allocated() == 3 * 4096
    assert tracker.by_category()["activation"] == 3 * 4096


def test_categories_need_a_history():
    with TensorTracker() as tracker:
        torch.ones(10)
    with pytest.raises(ValueError, match=r"by_category needs TensorTracker\(history=True"):
        tracker.by_category()


def test_an_unknown_moment_is_a_value_error_naming_now_and_peak():
    with pytest.raises(ValueError, match="at must be one of 'now', 'peak'; got 'max'"):
        TensorTracker(history=True).by_category(at="max")


def test_a_tracker_that_allocated_nothing_has_nothing_at_its_peak():
    with TensorTracker(history=True) as tracker:
        pass
    assert tracker.by_category(at="peak") == dict.fromkeys(CATEGORIES, 0)
    estimate = memlab.estimate(lambda n: n * 2, 21)  # a step without tensors: its by_category peak too
    assert estimate.by_category("peak") == dict.fromkeys(CATEGORIES, 0)
    assert estimate.peak_reserved == 0


def test_the_peak_needs_the_whole_history():
    with TensorTracker(history=3) as tracker:
        a, b, c = torch.ones(10), torch.ones(10), torch.ones(10)
    with pytest.raises(ValueError, match="dropped 1 of 4 entries"):
        tracker.by_category(at="peak")
    del a, b, c


def test_without_history_no_hook_is_installed():
    model = (
        _model()
    )  # modules=False: memory per module installs the pack hook (tests/sources/test_modules.py)
    with TensorTracker(model=model, modules=False) as tracker:
        assert tracker._hooks == []
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert model.training


def test_a_bare_allocator_leaves_freed_blocks_unknown_and_sets_categories_once():
    history = History()
    m = CachingAllocatorModel(config="", history=history)
    kept, freed = m.malloc(1000), m.malloc(100)
    m.free(freed)
    addr = m.history_snapshot()["segments"][0]["blocks"][0]["address"]
    history.set_category(addr, "parameter")
    history.set_category(addr, "gradient")  # a block keeps its first category
    assert [(a, c) for a, _, _, _, _, c in history.entries() if a == "alloc"] == [
        ("alloc", "parameter"),
        ("alloc", "unknown"),
    ]
    assert kept


def _double(batch: torch.Tensor) -> torch.Tensor:
    return batch * 2


def test_tensors_adopted_from_a_profiled_calls_arguments_are_inputs():
    first = torch.ones(1000)  # alive when profiling starts: adopted by the walk of gc, category unknown
    tracker = TensorTracker(history=True, adopt=True)
    profiler = memlab.LineProfiler(_double, source=tracker)
    with profiler:
        _double(first)
    later = torch.ones(1000)  # made between profiled calls: adopted from the next call's arguments
    with profiler:
        _double(later)
    assert tracker.allocation_context(first)[1] == "unknown"
    assert tracker.allocation_context(later)[1] == "input"
    assert tracker.by_category()["input"] == 4096


def test_history_leaves_gradients_and_updated_parameters_unchanged():
    results = []
    for history in (None, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters())
        with TensorTracker(history=history, model=model, optimizer=optimizer):
            loss = model(torch.ones(4, 64)).pow(2).sum()
            loss.backward()
            gradients = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
        results.append((gradients, [p.detach().clone() for p in model.parameters()]))
    (grads_off, params_off), (grads_on, params_on) = results
    assert all(torch.equal(a, b) for a, b in zip(grads_off + params_off, grads_on + params_on, strict=True))


def test_exact_bytes_by_category_without_the_allocator_model():
    with TensorTracker(allocator=None, history=True) as tracker:
        layer = torch.nn.Linear(10, 10)
        tracker.add_model(layer)
        layer(torch.ones(2, 10)).sum().backward()
    now = tracker.by_category()
    assert (now["parameter"], now["gradient"]) == (440, 440)
    assert sum(now.values()) == tracker.memory_allocated()
    assert sum(tracker.by_category(at="peak").values()) == tracker.max_memory_allocated()
