"""An estimate never changes the user's state: steps that write outside their arguments (a global EMA
of the weights updated in place, lists appended to, dicts assigned, attributes set, counters in
globals, closures and a trainer's ``self``, the random number generators) leave every user tensor
bit-identical and no fake tensor anywhere, for ``steps`` 1 to 3, on fake, ``meta`` and real CPU
runs, and through ``max_batch_size``. The walk that checks it is the test's own."""

from __future__ import annotations

import copy
import random
import types
from typing import Any

import numpy
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import memlab
from memlab.estimate.estimate import run_estimate
from memlab.history import categories

STEPS = (1, 2, 3)
KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")

# The user's program state, made anew for each test by the `state` fixture.
MODEL: torch.nn.Module
OPTIMIZER: torch.optim.Optimizer
EMA: dict[str, torch.Tensor]
LOSSES: list[torch.Tensor]
STATS: dict[str, Any]
COUNTER = 0
HELPERS: dict[str, torch.nn.Module]
DRAWS: list[Any]


@pytest.fixture(autouse=True)
def state():
    global MODEL, OPTIMIZER, EMA, LOSSES, STATS, COUNTER, HELPERS, DRAWS
    torch.manual_seed(0)
    MODEL = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    OPTIMIZER = torch.optim.AdamW(MODEL.parameters(), lr=1e-3)
    EMA = {name: value.detach().clone() for name, value in MODEL.state_dict().items()}
    LOSSES, STATS, COUNTER, DRAWS = [], {"seen": 0}, 0, []
    norm = torch.nn.LayerNorm(4).requires_grad_(False)  # frozen: reached through a global dict
    HELPERS = {"norm": norm}
    yield
    # no tensor of these outlives the test (later tests list the live tensors)
    del MODEL, OPTIMIZER, EMA, LOSSES, STATS, HELPERS, DRAWS
    COUNTER = 0


# -- the test's own walk over the user's objects ---------------------------------------------------
def reachable(*roots: Any) -> list[Any]:
    """Every object reachable from ``roots`` through containers, attributes, closure cells and the
    globals a function names (not into modules or classes)."""
    seen: dict[int, Any] = {}
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(
            obj, type | types.ModuleType | str | int | float | bool | type(None)
        ):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, torch.Tensor):
            if obj.is_leaf and obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            todo.extend(obj)
        if isinstance(obj, types.FunctionType):
            todo.extend(obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__)
            todo.extend(cell.cell_contents for cell in obj.__closure__ or ())
        elif isinstance(obj, types.MethodType):
            todo.extend((obj.__self__, obj.__func__))
        elif isinstance(getattr(obj, "__dict__", None), dict):
            todo.extend(vars(obj).values())
    return list(seen.values())


def snapshot(*roots: Any) -> list[tuple[Any, ...]]:
    """Each user tensor with a copy of its values, its version, its gradient's copy, its device
    and requires_grad."""
    found = []
    for tensor in reachable(*roots):
        if isinstance(tensor, torch.Tensor):
            grad = tensor.grad if tensor.is_leaf else None
            found.append(
                (
                    tensor,
                    tensor.detach().clone(),
                    tensor._version,
                    grad,
                    None if grad is None else grad.clone(),
                    tensor.device,
                    tensor.requires_grad,
                )
            )
    return found


def assert_untouched(before: list[tuple[Any, ...]], *roots: Any) -> None:
    for tensor, values, version, grad, grad_values, device, requires_grad in before:
        assert torch.equal(tensor, values)
        assert (tensor._version, tensor.device, tensor.requires_grad) == (version, device, requires_grad)
        if tensor.is_leaf:
            assert tensor.grad is grad
            assert grad is None or torch.equal(grad, grad_values)
    assert [obj for obj in reachable(*roots) if isinstance(obj, FakeTensor)] == []


def user_state() -> tuple[Any, ...]:
    return (MODEL, OPTIMIZER, EMA, LOSSES, STATS, HELPERS, DRAWS)


# -- steps that write outside their arguments ------------------------------------------------------
def ema_step(x):
    """A training step that keeps an EMA of the weights in a global dict, updated in place."""
    loss = MODEL(x).square().mean()
    loss.backward()
    OPTIMIZER.step()
    OPTIMIZER.zero_grad()
    for name, value in MODEL.state_dict().items():
        EMA[name].mul_(0.5).add_(value.detach(), alpha=0.5)
    return loss


def logging_step(model, optimizer, x):
    """Appends to a global list, assigns dict keys, sets a module attribute, counts in a global."""
    global COUNTER
    out = model(x)
    loss = HELPERS["norm"](out).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    LOSSES.append(loss.detach())
    STATS["last"] = loss.detach()
    STATS["seen"] += 1
    model.last = out
    HELPERS["norm"].last = out.detach()
    COUNTER += 1
    return loss


def counting_step(x):
    """Names no copied object (its function is not rebuilt): `global` writes reach the module."""
    global COUNTER
    COUNTER += 1
    DRAWS.append(x.sum())
    return x * 2


def closure_step():
    count = 0
    scale = torch.ones(())  # a step counter kept as a tensor
    seen: list[torch.Tensor] = []

    def step(model, x):
        nonlocal count
        count += 1
        scale.add_(1)
        loss = model(x).sum() * scale
        seen.append(loss.detach())
        loss.backward()
        return loss

    return step


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.history: list[torch.Tensor] = []
        self.metrics: dict[str, Any] = {}
        self.step = 0

    def train_step(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.history.append(loss.detach())
        self.metrics["loss"] = loss
        self.step += 1
        self.log(loss)
        return loss

    def log(self, loss):
        """Reached by attribute from train_step: its global is found through the class."""
        STATS["last"] = loss.detach()


def random_step(model, x):
    torch.manual_seed(1234)
    out = torch.nn.functional.dropout(model(x), p=0.5, training=True)
    DRAWS.append((random.random(), numpy.random.rand()))
    return out.sum()


# -- the battery -----------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", STEPS)
def test_a_global_ema_updated_in_place_is_left_as_it_was(steps):
    before = snapshot(*user_state())

    estimate = memlab.estimate(ema_step, torch.randn(8, 16), steps=steps)

    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert_untouched(before, *user_state())
    assert not OPTIMIZER.state


def test_the_ema_step_estimate_equals_a_tracked_real_run():
    x = torch.randn(8, 16)
    estimate = memlab.estimate(ema_step, x, steps=2)
    ema_before = {name: value.clone() for name, value in EMA.items()}

    with memlab.TensorTracker(history=True, model=MODEL, optimizer=OPTIMIZER) as tracker:
        tracker.adopt(roots=[MODEL])
        tracker.adopt(roots=[OPTIMIZER])
        tracker.adopt(roots=[x], category=categories.INPUT)
        for _ in range(2):
            loss = ema_step(x)
        real = tracker.memory_stats()
    del loss

    assert {key: estimate.stats[key] for key in KEYS} == {key: real[key] for key in KEYS}
    # the real run did change the EMA: the estimate's copy is what stood in for it
    assert not torch.equal(EMA["0.weight"], ema_before["0.weight"])


@pytest.mark.parametrize("steps", STEPS)
def test_appends_dict_keys_attributes_and_global_counters_are_undone(steps):
    model = copy.deepcopy(MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(*user_state(), model, optimizer)

    memlab.estimate(logging_step, model, optimizer, torch.randn(8, 16), steps=steps)

    assert_untouched(before, *user_state(), model, optimizer)
    assert (LOSSES, STATS, COUNTER) == ([], {"seen": 0}, 0)
    assert not hasattr(model, "last") and not hasattr(HELPERS["norm"], "last")


@pytest.mark.parametrize("steps", STEPS)
def test_a_global_counter_in_a_function_that_is_not_rebuilt_is_undone(steps):
    memlab.estimate(counting_step, torch.randn(4), steps=steps)

    assert (COUNTER, DRAWS) == (0, [])
    assert "COUNTER" in globals()


@pytest.mark.parametrize("steps", STEPS)
def test_nonlocal_counters_closure_lists_and_closure_tensors_are_left_as_they_were(steps):
    step = closure_step()
    model = torch.nn.Linear(16, 4)
    before = snapshot(step, model)

    estimate = memlab.estimate(step, model, torch.randn(8, 16), steps=steps)

    assert estimate.method == "fake"
    assert_untouched(before, step, model)
    count, scale, seen = (cell.cell_contents for cell in step.__closure__)
    assert (count, scale.item(), scale._version, seen) == (0, 1.0, 0, [])


@pytest.mark.parametrize("steps", STEPS)
def test_the_attributes_of_a_bound_methods_owner_are_left_as_they_were(steps):
    trainer = Trainer(MODEL, OPTIMIZER)
    before = snapshot(trainer)

    memlab.estimate(trainer.train_step, torch.randn(8, 16), steps=steps)

    assert_untouched(before, trainer)
    assert (trainer.history, trainer.metrics, trainer.step, STATS) == ([], {}, 0, {"seen": 0})


@pytest.mark.parametrize("steps", STEPS)
def test_the_random_number_generators_are_left_as_they_were(steps):
    model, x = torch.nn.Linear(16, 4), torch.randn(8, 16)
    torch.manual_seed(7)
    random.seed(7)
    numpy.random.seed(7)
    states = (torch.get_rng_state(), random.getstate(), numpy.random.get_state())

    memlab.estimate(random_step, model, x, steps=steps)

    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    after = numpy.random.get_state()
    assert (
        after[0] == states[2][0] and numpy.array_equal(after[1], states[2][1]) and after[2:] == states[2][2:]
    )
    assert DRAWS == []


@pytest.mark.parametrize("method", ["cpu", "meta"])
@pytest.mark.parametrize("steps", STEPS)
def test_real_cpu_and_meta_runs_leave_the_users_state_as_it_was(method, steps):
    model = copy.deepcopy(MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(*user_state(), model, optimizer)
    x = torch.randn(8, 16)

    def both(model, optimizer, x):
        logging_step(model, optimizer, x)
        return ema_step(x)

    estimate = run_estimate(
        both,
        lambda: ((model, optimizer, x), {}),
        torch.device(method),
        method=method,
        steps=steps,
    )

    assert estimate.method == method
    assert_untouched(before, *user_state(), model, optimizer)
    assert (LOSSES, STATS, COUNTER) == ([], {"seen": 0}, 0)


def test_a_step_forced_onto_a_real_cpu_run_leaves_the_users_state_as_it_was():
    def masked(x):
        loss = ema_step(x)
        LOSSES.append(MODEL(x)[MODEL(x) > 0].sum())  # a boolean mask: its size depends on values
        return loss

    before = snapshot(*user_state())

    memlab.estimate(masked, torch.randn(8, 16), steps=2)

    assert_untouched(before, *user_state())
    assert LOSSES == []


def test_max_batch_size_leaves_the_users_state_as_it_was():
    before = snapshot(*user_state())

    found = memlab.max_batch_size(
        lambda x: (ema_step(x), LOSSES.append(x.sum())),
        lambda b: torch.randn(b, 16),
        budget="200 MiB",
        high=64,
    )

    assert found.batch_size == 64
    assert_untouched(before, *user_state())
    assert LOSSES == []


def test_a_trainable_tensor_reached_outside_the_copies_is_an_error_on_every_method():
    holder = {"model": torch.nn.Linear(4, 4)}  # a model in a container: not copied

    def step(x):
        holder["model"](x).sum().backward()

    for method in ("fake", "meta", "cpu"):
        with pytest.raises(memlab.EstimateError, match="requires grad and is not among its arguments"):
            run_estimate(
                step,
                lambda: ((torch.randn(2, 4),), {}),
                torch.device("cpu" if method == "fake" else method),
                method=method,
            )
        assert holder["model"].weight.grad is None


def test_a_generator_the_step_advances_is_an_error_and_named():
    batches = (torch.randn(2, 4) for _ in range(3))

    def step():
        return next(batches) * 2

    with pytest.raises(memlab.EstimateError) as error:
        memlab.estimate(step)
    assert str(error.value) == (
        "the step advanced the generator closure variable 'batches' of "
        "test_a_generator_the_step_advances_is_an_error_and_named.<locals>.step "
        "(test_a_generator_the_step_advances_is_an_error_and_named.<locals>.<genexpr>), whose position "
        "an estimate cannot save and restore; pass the step the values it draws instead (its arguments, "
        "or a list)"
    )


def test_a_write_to_a_numpy_array_is_an_error_before_it_happens_naming_the_array_and_line():
    totals = numpy.zeros(3)

    def step(x):
        totals[0] += 1
        return x * 2

    with pytest.raises(memlab.EstimateError) as error:
        memlab.estimate(step, torch.randn(4))
    line = step.__code__.co_firstlineno + 1
    assert str(error.value) == (
        "the step wrote to a NumPy array it reaches outside its copies (closure variable 'totals' of "
        "test_a_write_to_a_numpy_array_is_an_error_before_it_happens_naming_the_array_and_line.<locals>"
        f".step) at {__file__}:{line}: totals[0] += 1; an estimate cannot copy NumPy arrays, and it never "
        "changes the user's objects: keep the values in a tensor instead (torch.from_numpy(array) shares "
        "them), which an estimate copies"
    )
    assert totals.tolist() == [0.0, 0.0, 0.0] and totals.flags.writeable


def test_autobatch_runs_the_loss_for_real_only_on_its_micro_batches():
    """The estimates that choose the micro-batch leave no trace: the user's list holds one real loss
    per micro-batch run, and the counter counts those calls only."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    x, y = torch.randn(4096, 256), torch.randint(0, 10, (4096,))
    calls = 0

    def loss_fn(x, y):
        nonlocal calls
        calls += 1
        loss = torch.nn.functional.cross_entropy(model(x), y)
        LOSSES.append(loss.detach())
        return loss

    wrapped = memlab.autobatch(loss_fn, budget=32 * 2**20 + 2 * 32 * 2**20)
    wrapped(x, y)

    micro_batches = -(-4096 // wrapped.micro_batch_size)
    assert 1 < micro_batches and calls == len(LOSSES) == micro_batches
    assert not any(isinstance(loss, FakeTensor) for loss in LOSSES)


def test_a_tensor_sharing_a_numpy_arrays_memory_is_copied_and_neither_changes():
    array = numpy.zeros(3, dtype=numpy.float32)
    totals = torch.from_numpy(array)

    def step(x):
        totals.add_(x.sum())
        return x * 2

    memlab.estimate(step, torch.randn(4), steps=2)

    assert array.tolist() == [0.0, 0.0, 0.0] and totals._version == 0 and array.flags.writeable


class Slotted:
    __slots__ = ("count", "last")

    def __init__(self):
        self.count = 0


def test_every_kind_of_container_and_slot_is_put_back():
    import collections

    seen_ids, recent = {1, 2}, collections.deque([0.0], maxlen=3)
    ordered, grouped = collections.OrderedDict(a=1, b=2), collections.defaultdict(list)
    slotted, raw, nested = Slotted(), bytearray(b"ab"), ([], {"inner": []})
    state = types.SimpleNamespace(global_step=0, log=[])

    def step(model, x):
        loss = model(x).sum()
        seen_ids.add(3)
        recent.append(loss.detach())
        ordered.move_to_end("a")
        ordered["c"] = loss.detach()
        grouped["losses"].append(loss.detach())
        slotted.count += 1
        slotted.last = loss.detach()
        raw.extend(b"cd")
        nested[0].append(loss.detach())
        nested[1]["inner"].append(loss.detach())
        state.global_step += 1
        state.log.append(loss.detach())
        return loss

    objects = (seen_ids, recent, ordered, grouped, slotted, raw, nested, state)
    memlab.estimate(step, torch.nn.Linear(16, 4), torch.randn(8, 16), steps=2)

    assert seen_ids == {1, 2} and list(recent) == [0.0] and recent.maxlen == 3
    assert list(ordered.items()) == [("a", 1), ("b", 2)] and dict(grouped) == {}
    assert slotted.count == 0 and not hasattr(slotted, "last") and raw == b"ab"
    assert nested == ([], {"inner": []}) and vars(state) == {"global_step": 0, "log": []}
    assert_untouched([], *objects)


def test_random_generators_the_step_reaches_are_put_back():
    gen, rand, rng = torch.Generator().manual_seed(1), random.Random(1), numpy.random.default_rng(1)
    states = (gen.get_state(), rand.getstate(), rng.bit_generator.state)

    def step(x):
        gen.manual_seed(99)
        rand.random()
        rng.random()
        return x * 2

    memlab.estimate(step, torch.randn(4), steps=2)

    assert torch.equal(gen.get_state(), states[0])
    assert (rand.getstate(), rng.bit_generator.state) == states[1:]


@pytest.mark.parametrize("method", ["fake", "cpu"])
def test_an_ema_that_assigns_data_gets_its_own_storage_back(method):
    def step(x):
        loss = ema_step(x)
        for value in EMA.values():
            value.data = value * 0.5  # swaps the tensor's storage without an op
        return loss

    before = snapshot(*user_state())
    storages = {name: value.untyped_storage().data_ptr() for name, value in EMA.items()}

    estimate = run_estimate(step, lambda: ((torch.randn(8, 16),), {}), torch.device("cpu"), method=method)

    assert estimate.method == method
    assert_untouched(before, *user_state())
    assert {name: value.untyped_storage().data_ptr() for name, value in EMA.items()} == storages
    assert all(value.device.type == "cpu" for value in EMA.values())


def test_a_write_to_a_numpy_array_passed_as_an_argument_names_the_argument():
    def step(x, totals):
        totals += 1
        return x * 2

    with pytest.raises(memlab.EstimateError, match=r"outside its copies \(the arguments\[1\]\) at "):
        memlab.estimate(step, torch.randn(4), numpy.zeros(2))


def item_logging_step(model, optimizer, x):
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    LOSSES.append(loss.item())  # an unknown value: a symbol during a data-free run
    STATS["last"] = f"{LOSSES[-1]:.4f}"
    return loss


@pytest.mark.parametrize("steps", STEPS)
def test_values_read_with_item_stay_in_the_run_not_in_the_users_objects(steps):
    model = copy.deepcopy(MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(*user_state(), model, optimizer)

    estimate = memlab.estimate(item_logging_step, model, optimizer, torch.randn(8, 16), steps=steps)

    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert_untouched(before, *user_state(), model, optimizer)
    assert (LOSSES, STATS) == ([], {"seen": 0})
