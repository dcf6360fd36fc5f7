"""TensorTracker: counts what a run allocates, on any device, with the numbers a GPU would show."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils import _python_dispatch

import memlab
from memlab._torch_version import torch_at_least
from memlab.sources import workspaces
from memlab.sources.tracker import active_tracker

MiB = 1024 * 1024


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every distinct storage reachable from a tensor that ``gc`` knows, with gradients."""
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # isinstance would touch lazy modules in gc
            continue
        tensors = [obj]
        if obj.is_leaf and obj.requires_grad and obj.grad is not None:
            tensors.append(obj.grad)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            found[id(storage)] = storage
    return found


class GroundTruth:
    """Bytes of live storages created after construction, found by walking ``gc``.

    Objects that existed before are frozen out of ``gc``'s generations (``gc.freeze``) so each walk
    only visits what was created since; call :meth:`close` to unfreeze them.
    """

    def __init__(self) -> None:
        gc.collect()
        self.before = live_storages()  # held, so their ids cannot be reused
        gc.freeze()

    def allocated(self) -> int:
        return sum(s.nbytes() for key, s in live_storages().items() if key not in self.before)

    def close(self) -> None:
        gc.unfreeze()


# -- the published check --------------------------------------------------------------------------


def test_linear_100_gives_the_numbers_a_gpu_shows():
    with memlab.TensorTracker() as tracker:
        torch.nn.Linear(100, 100)
    stats = tracker.memory_stats()
    assert stats["active_bytes.all.peak"] == 40960
    assert stats["reserved_bytes.all.peak"] == 2097152
    assert stats["requested_bytes.all.peak"] == 40400
    assert stats["allocation.all.allocated"] == 2


def test_stats_have_the_keys_of_torch_cuda_memory_stats():
    with memlab.TensorTracker() as tracker:
        torch.ones(3)
    assert list(tracker.memory_stats()) == list(memlab.STAT_KEYS)


# -- what counts as an allocation -----------------------------------------------------------------


def test_exact_mode_counts_nbytes_of_new_storages():
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.empty(10, 10)
        b = torch.empty(3, dtype=torch.float64)
    assert tracker.memory_allocated() == 400 + 24
    assert tracker.memory_reserved() == 424
    assert tracker.memory_stats()["requested_bytes.all.current"] == 424
    del a, b


def test_views_and_in_place_results_count_zero_times():
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.zeros(10, 10)
        views = [a.view(100), a.t(), a[2:], a.unsqueeze(0), a.detach(), *a.split(5)]
        a.add_(1).mul_(2)
        torch.add(a, 1, out=a)
    assert tracker.memory_allocated() == 400
    assert tracker.memory_stats()["allocation.all.allocated"] == 1
    del views


def test_tensor_literals_are_counted():
    with memlab.TensorTracker(allocator=None) as tracker:
        x = torch.tensor([1.0, 2.0, 3.0])
    assert tracker.memory_allocated() == 12
    del x


def test_pre_existing_storages_are_not_counted_even_when_freed():
    before = torch.zeros(1000)
    with memlab.TensorTracker(allocator=None) as tracker:
        before.add_(1)
        view = before.view(10, 100)
        doubled = before * 2
        del before, view
    stats = tracker.memory_stats()
    assert stats["allocated_bytes.all.current"] == 4000
    assert stats["allocated_bytes.all.freed"] == 0
    del doubled


def test_release_is_counted_also_after_the_block():
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.empty(256)
    assert tracker.memory_allocated() == 1024
    del a
    assert tracker.memory_allocated() == 0
    assert tracker.max_memory_allocated() == 1024


def test_resize_grows_the_storage():
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.empty(0)
        a.resize_(100)
        assert tracker.memory_allocated() == 400
        a.resize_(300)
    stats = tracker.memory_stats()
    assert stats["allocated_bytes.all.current"] == 1200
    assert stats["allocated_bytes.all.peak"] == 1600  # old and new block coexist during the copy
    del a


def test_resize_of_a_pre_existing_storage_counts_the_new_size():
    a = torch.empty(0)
    with memlab.TensorTracker(allocator=None) as tracker:
        a.resize_(10)
    assert tracker.memory_allocated() == 40
    del a


def test_wrapper_subclasses_are_flattened_to_their_storages():
    pair = TwoTensor(torch.zeros(10), torch.zeros(10))
    with memlab.TensorTracker(allocator=None) as tracker:
        doubled = pair * 2
    assert isinstance(doubled, TwoTensor)
    assert tracker.memory_allocated() == 80
    assert tracker.memory_stats()["allocation.all.current"] == 2
    del doubled


def test_backward_and_optimizer_step_are_seen():
    model = torch.nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memlab.TensorTracker(allocator=None) as tracker:
        model(torch.ones(4, 10)).sum().backward()
        assert tracker.memory_allocated() == 440  # weight.grad 400 B + bias.grad 40 B
        optimizer.step()
        assert tracker.memory_allocated() == 880  # plus one momentum buffer per parameter
        optimizer.zero_grad(set_to_none=True)
    assert tracker.memory_allocated() == 440


def test_devices_are_kept_apart():
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.empty(100)
        m = torch.empty(1000, device="meta")
    assert tracker.memory_allocated("cpu") == 400
    assert tracker.memory_allocated("meta") == 4000
    assert tracker.memory_allocated(torch.device("meta")) == 4000
    assert tracker.devices == [torch.device("cpu"), torch.device("meta")]
    del a, m


def test_no_device_means_the_one_device_seen_even_outside_its_device_context():
    with memlab.TensorTracker(allocator=None) as tracker, torch.device("meta"):
        m = torch.empty(16)
        assert tracker.memory_allocated() == 64
    assert tracker.memory_allocated() == 64  # the README's meta example reads its numbers here
    assert tracker.memory_allocated("cpu") == 0
    del m


def test_no_device_means_the_default_device_once_several_were_seen():
    with memlab.TensorTracker(allocator=None) as tracker:
        c = torch.empty(8)
        with torch.device("meta"):
            m = torch.empty(16)
            assert tracker.memory_allocated() == 64
        assert tracker.memory_allocated() == 32
    del c, m


def test_holds_no_strong_reference_to_tensors():
    with memlab.TensorTracker() as tracker:
        a = torch.empty(100)
        b = a * 2
        alive = weakref.ref(b)
    del a, b
    assert alive() is None
    assert tracker.memory_allocated() == 0


def test_active_tracker_is_the_innermost():
    assert active_tracker() is None
    with memlab.TensorTracker() as outer:
        assert active_tracker() is outer
        with memlab.TensorTracker() as inner:
            assert active_tracker() is inner
        assert active_tracker() is outer
    assert active_tracker() is None


# -- statistics ------------------------------------------------------------------------------------


def test_helpers_and_resets():
    with memlab.TensorTracker(allocator=None) as tracker:
        a = torch.empty(1000)
        b = torch.empty(1000)
        del a
    assert tracker.memory_allocated() == 4000
    assert tracker.max_memory_allocated() == 8000
    assert tracker.memory_reserved() == 4000
    assert tracker.max_memory_reserved() == 8000
    tracker.reset_peak_memory_stats()
    assert tracker.max_memory_allocated() == 4000
    tracker.reset_accumulated_memory_stats()
    assert tracker.memory_stats()["allocated_bytes.all.allocated"] == 0
    assert tracker.memory_allocated() == 4000
    del b


def test_sampler_reads_interval_peaks_without_touching_the_user_peak():
    with memlab.TensorTracker(allocator=None) as tracker:
        sample = tracker.sampler(["allocated_bytes.all.peak", "allocated_bytes.all.current"])
        a = torch.empty(1000)
        del a
        assert sample() == (4000, 0)
        b = torch.empty(10)
        assert sample() == (40, 40)
        assert sample() == (40, 40)
    assert tracker.max_memory_allocated() == 4000
    del b


def test_cuda_model_caches_freed_blocks():
    with memlab.TensorTracker() as tracker:
        a = torch.empty(1000)
        del a
        b = torch.empty(1000)
    stats = tracker.memory_stats()
    assert stats["allocated_bytes.all.current"] == 4096
    assert stats["reserved_bytes.all.current"] == 2 * MiB
    assert stats["segment.all.allocated"] == 1
    tracker.empty_cache()
    assert tracker.memory_reserved() == 2 * MiB  # b still lives in it
    del b
    tracker.empty_cache()
    assert tracker.memory_reserved() == 0


# -- capacity --------------------------------------------------------------------------------------


def test_capacity_raises_out_of_memory_where_the_gpu_would():
    with memlab.TensorTracker(capacity="30 MiB") as tracker:
        a = torch.empty(12 * MiB, dtype=torch.uint8)
        b = torch.empty(12 * MiB, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 12\.00 MiB"):
            torch.empty(12 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(12 * MiB, dtype=torch.uint8)  # fits in the cached block of a
    stats = tracker.memory_stats()
    assert stats["num_ooms"] == 1
    assert stats["num_alloc_retries"] == 1
    assert stats["reserved_bytes.all.current"] == 24 * MiB
    del b, c


# -- bad input -------------------------------------------------------------------------------------


def test_unknown_allocator_is_a_value_error():
    with pytest.raises(ValueError, match=r"allocator must be 'cuda' .* or None .*got 'exact'"):
        memlab.TensorTracker(allocator="exact")


def test_capacity_must_be_a_size():
    with pytest.raises(ValueError, match="capacity 'lots' is not a size"):
        memlab.TensorTracker(capacity="lots")
    with pytest.raises(TypeError, match="capacity must be an int number of bytes"):
        memlab.TensorTracker(capacity=1.5)
    with pytest.raises(ValueError, match="capacity must be >= 0 bytes, got -1"):
        memlab.TensorTracker(capacity=-1)


def test_bad_allocator_environment_fails_at_construction(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        memlab.TensorTracker()
    assert isinstance(memlab.TensorTracker(allocator=None), memlab.TensorTracker)


def test_allocator_environment_is_honoured(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4")
    with memlab.TensorTracker() as tracker:
        a = torch.empty(1100 * 1024, dtype=torch.uint8)  # 1.07 MiB -> next 1/4 power-of-two step
    assert tracker.memory_allocated() == 1280 * 1024
    del a


def test_bad_device_names_are_errors():
    tracker = memlab.TensorTracker()
    with pytest.raises(ValueError) as error:
        tracker.memory_stats("gpu0")
    assert str(error.value) == (
        "device 'gpu0' is not a device; valid: 'cpu', 'meta', 'cuda', 'cuda:1', a CUDA index (0, 1, ...) "
        "or a torch.device"
    )
    with pytest.raises(TypeError) as error:
        tracker.memory_stats(1.0)
    assert str(error.value) == (
        "device must be 'cpu', 'meta', 'cuda', 'cuda:1', a CUDA index (0, 1, ...) or a torch.device; "
        "got float 1.0"
    )


def test_unknown_stat_key_in_sampler():
    tracker = memlab.TensorTracker()
    with pytest.raises(ValueError, match=r"unknown statistic 'active\.peak'; valid keys are: "):
        tracker.sampler(["active.peak"])


# -- ground truth ---------------------------------------------------------------------------------


OPS = st.sampled_from(
    [
        "new",
        "new_double",
        "add",
        "inplace",
        "view",
        "transpose",
        "clone",
        "contiguous",
        "cat",
        "sum",
        "to_double",
        "resize",
        "literal",
        "drop",
        "drop",
    ]
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(OPS, st.integers(0, 1000), st.integers(1, 64)), min_size=1, max_size=15))
def test_exact_bytes_equal_live_storages_over_random_ops(program):
    pool: list[torch.Tensor] = []
    truth = GroundTruth()
    with contextlib.closing(truth), memlab.TensorTracker(allocator=None) as tracker:
        for op, pick, n in program:
            some = pool[pick % len(pool)] if pool else None
            if op == "new" or some is None:
                pool.append(torch.randn(n, 3))
            elif op == "new_double":
                pool.append(torch.zeros(n, dtype=torch.float64))
            elif op == "add":
                pool.append(some + some)
            elif op == "inplace":
                some.mul_(0.5)
            elif op == "view":
                pool.append(some.view(some.shape))
            elif op == "transpose":
                pool.append(some.t() if some.dim() == 2 else some.unsqueeze(0))
            elif op == "clone":
                pool.append(some.clone())
            elif op == "contiguous":
                pool.append(some.unsqueeze(-1).transpose(0, -1).contiguous())
            elif op == "cat":
                pool.append(torch.cat([some.reshape(-1), some.reshape(-1)]))
            elif op == "sum":
                pool.append(some.sum())
            elif op == "to_double":
                pool.append(some.to(torch.float64))
            elif op == "resize":
                pool.append(torch.empty(0).resize_(n))
            elif op == "literal":
                pool.append(torch.tensor([float(n)] * n))
            elif op == "drop":
                pool.pop(pick % len(pool))
            del some
            assert tracker.memory_allocated() == truth.allocated()
    pool.clear()
    assert tracker.memory_allocated() == 0


def training_step(
    device: str,
    tracker: memlab.TensorTracker,
    checkpoints: list | None = None,
    optimizer_class=torch.optim.AdamW,
    step_device: str | None = None,
):
    """One training step of a tiny MLP with every tensor made under ``torch.device(device)``; the
    optimizer's step under ``torch.device(step_device)`` instead where one is given."""
    truth = GroundTruth() if checkpoints is not None else None
    with torch.device(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        optimizer = optimizer_class(model.parameters(), lr=1e-3)
        inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))

        def check():
            if truth is not None:
                checkpoints.append((tracker.memory_allocated(device), truth.allocated()))

        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        del loss
        check()
        with torch.device(step_device) if step_device else contextlib.nullcontext():
            optimizer.step()
        check()
        optimizer.zero_grad(set_to_none=True)
        check()
    if truth is not None:
        truth.close()
    return model, optimizer


def test_training_step_matches_live_storages_at_every_checkpoint():
    checkpoints: list = []
    with memlab.TensorTracker(allocator=None) as tracker:
        model, _ = training_step("cpu", tracker, checkpoints)
    assert len(checkpoints) == 3
    for tracked, truth in checkpoints:
        assert tracked == truth
    params = sum(p.nbytes for p in model.parameters())
    # after zero_grad: parameters, exp_avg, exp_avg_sq, 4-byte step counters, the batch
    assert checkpoints[-1][0] == 3 * params + 4 * len(list(model.parameters())) + 32 * 64 * 4 + 32 * 8


def sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@pytest.mark.parametrize("allocator", [None, "cuda"])
def test_meta_run_matches_cpu_run(allocator):
    with memlab.TensorTracker(allocator=allocator) as on_cpu:
        _kept_on_cpu = training_step("cpu", on_cpu, optimizer_class=sgd)
    with memlab.TensorTracker(allocator=allocator) as on_meta:
        _kept_on_meta = training_step("meta", on_meta, optimizer_class=sgd)
    cpu, meta = on_cpu.memory_stats("cpu"), on_meta.memory_stats("meta")
    # 6 inputs and parameters, 6 forward, 9 backward, 4 momenta; the CUDA model adds the cuBLAS
    # workspaces of the forward's thread and of the autograd thread that runs backward on a GPU,
    # and, where cuBLASLt keeps its own workspace (torch 2.11's default), the forward's bias
    # addmm's cuBLASLt workspace
    own_lt = workspaces.keeps_own_cublaslt()
    assert cpu["allocation.all.allocated"] == (25 if allocator is None else 27 + own_lt)
    for key in (
        "allocation.all.allocated",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.peak",
        "requested_bytes.all.peak",
        "segment.all.peak",
        "allocated_bytes.all.current",
    ):
        assert meta[key] == cpu[key], key
    assert on_meta.memory_stats("cpu")["allocation.all.allocated"] == 0


def test_meta_run_keeps_adamw_step_counters_on_cpu_like_a_gpu_run():
    # Non-capturable AdamW keeps its `step` counters on the CPU whatever the parameters' device,
    # on a GPU as on meta: a meta run shows exactly that split. Before torch 2.13 its Adam makes
    # them with `torch.tensor(0.0, dtype=...)` (torch/optim/adam.py of 2.8 and 2.11; 2.13 adds
    # `device="cpu"`): on the default device, so under `torch.device("cuda")` they land on the GPU
    # and under `torch.device("meta")` on meta, where PyTorch's own `.item()` on them fails. There
    # the split holds for a step taken outside the device context, which is what is run.
    step_device = None if torch_at_least(2, 13) else "cpu"
    with memlab.TensorTracker(allocator=None) as on_cpu:
        _kept_on_cpu = training_step("cpu", on_cpu, step_device=step_device)
    with memlab.TensorTracker(allocator=None) as on_meta:
        _kept_on_meta = training_step("meta", on_meta, step_device=step_device)
    cpu, meta, meta_host = (
        on_cpu.memory_stats("cpu"),
        on_meta.memory_stats("meta"),
        on_meta.memory_stats("cpu"),
    )
    assert meta_host["allocated_bytes.all.current"] == 4 * 4
    assert (
        meta["allocation.all.allocated"] + meta_host["allocation.all.allocated"]
        == cpu["allocation.all.allocated"]
    )
    assert meta["allocated_bytes.all.peak"] + 16 == cpu["allocated_bytes.all.peak"]


# -- adoption: tensors that existed before the tracker was entered -------------------------------------
def test_adopt_counts_live_tensors_as_allocated_rounded_as_the_cuda_allocator_would():
    with torch.device("meta"):
        layer = torch.nn.Linear(100, 100)
    with memlab.TensorTracker(adopt=True) as tracker:
        stats = tracker.memory_stats("meta")
        # weight 40 000 B -> 40 448 B, bias 400 B -> 512 B, in one 2 MiB small-pool segment
        assert stats["allocated_bytes.all.current"] == 40_960
        assert stats["requested_bytes.all.current"] == 40_400
        assert stats["reserved_bytes.all.current"] == 2 * MiB
        del layer
        assert tracker.memory_stats("meta")["allocated_bytes.all.current"] == 0  # released as any other


def test_adopted_storages_are_released_after_the_tracker_is_left():
    with torch.device("meta"):
        block = torch.empty(1000, dtype=torch.uint8)
    tracker = memlab.TensorTracker(allocator=None)
    with tracker:
        assert tracker.adopt("meta") == (1, 1000)
    del block
    assert tracker.memory_stats("meta")["allocated_bytes.all.current"] == 0
    assert tracker.memory_stats("meta")["allocated_bytes.all.freed"] == 1000


def test_adopt_counts_a_shared_storage_once_and_finds_gradients_and_view_bases():
    with torch.device("meta"):
        weight = torch.nn.Parameter(torch.empty(256))
        weight.grad = torch.empty(256)  # an existing .grad whose Python object was read
        view = torch.empty(1024)[:10]  # only the view is referenced; its 4 KiB base is alive
        alias = weight.detach()
    tracker = memlab.TensorTracker(allocator=None)
    with tracker:
        assert tracker.adopt("meta") == (3, 1024 + 1024 + 4096)
        assert tracker.adopt("meta") == (0, 0)  # idempotent: known storages are not adopted again
    assert tracker.adoptions == [(3, 6144)]
    del weight, view, alias


def test_without_adopt_storages_that_existed_before_are_never_counted():
    with torch.device("meta"):
        block = torch.empty(1000, dtype=torch.uint8)
    with memlab.TensorTracker(allocator=None) as tracker:
        assert tracker.memory_allocated("meta") == 0
    del block
    assert tracker.memory_stats("meta")["allocated_bytes.all.freed"] == 0
    assert tracker.adoptions == []


def test_adopt_must_be_a_bool():
    with pytest.raises(TypeError, match="adopt must be True or False, got str 'yes'"):
        memlab.TensorTracker(adopt="yes")


def test_entering_a_tracker_imports_what_the_first_op_would_so_no_line_pays_for_it(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys, torch, memlab\n"
        "before = 'torch._dynamo' in sys.modules\n"
        "with memlab.TensorTracker():\n"
        "    entered = set(sys.modules)\n"
        "    torch.ones(2) + 1\n"
        "    print(before, 'torch._dynamo' in sys.modules, sorted(set(sys.modules) - entered))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    # torch 2.8's first op under a dispatch mode imports nothing: nothing to import at the entry
    assert result.stdout == f"False {torch_at_least(2, 9)} []\n", result.stderr


CTRL_C_DURING_WARM_UP = """\
import importlib.abc, os, signal, sys
import torch
import memlab

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started ignoring it

events = []


class CtrlCAtDynamo(importlib.abc.MetaPathFinder):
    \"\"\"Ctrl-C arrives half-way through importing torch._dynamo (hundreds of modules): as its
    submodule guards starts, after config, utils and others were imported.\"\"\"

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo.guards":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            events.append("import started")
            os.kill(os.getpid(), signal.SIGINT)
            execute(module)
            events.append("import done")

        spec.loader.exec_module = exec_module
        return spec


import importlib.util
sys.meta_path.insert(0, CtrlCAtDynamo())
try:
    with memlab.TensorTracker():
        events.append("entered")
except KeyboardInterrupt:
    events.append("KeyboardInterrupt")
orphans = sorted(
    name
    for name in list(sys.modules)
    if name.startswith("torch._dynamo.") and name.rpartition(".")[0] not in sys.modules
)
with memlab.TensorTracker(allocator=None) as tracker:
    block = torch.empty(1000, dtype=torch.uint8)
print(events, orphans[:3], tracker.memory_allocated())
"""


@pytest.mark.skipif(
    not torch_at_least(2, 9), reason="torch 2.8's first op under a dispatch mode imports nothing to interrupt"
)
def test_ctrl_c_while_the_first_entry_imports_torch_dynamo_is_raised_after_the_import(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_WARM_UP], capture_output=True, text=True, timeout=120
    )
    # The import ran to its end, no submodule lost its package (without the hold: torch._dynamo is
    # gone, torch._dynamo.config and others stay), and Ctrl-C stopped the entry after.
    assert result.stdout == "['import started', 'import done', 'KeyboardInterrupt'] [] 1000\n", result.stderr


def test_trackers_exited_out_of_order_never_count_into_the_exited_one():
    outer, inner = memlab.TensorTracker(allocator=None), memlab.TensorTracker(allocator=None)
    outer.__enter__()
    inner.__enter__()
    both = torch.empty(1000, dtype=torch.uint8)
    outer.__exit__(None, None, None)  # out of order: inner is still active
    after = torch.empty(2000, dtype=torch.uint8)
    assert (outer.memory_allocated(), inner.memory_allocated()) == (1000, 3000)
    assert active_tracker() is inner
    inner.__exit__(None, None, None)
    assert _python_dispatch._get_current_dispatch_mode_stack() == []  # both are off torch's stack
    assert not _python_dispatch._is_in_torch_dispatch_mode
    later = torch.empty(4000, dtype=torch.uint8)
    assert (outer.memory_allocated(), inner.memory_allocated()) == (1000, 3000)
    with outer:  # and it can be entered again
        torch.empty(8, dtype=torch.uint8)
    assert outer.memory_stats()["allocated_bytes.all.allocated"] == 1008
    del both, after, later


def test_a_tracker_left_under_a_mode_still_active_cannot_be_entered_again():
    class Passing(_python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    tracker = memlab.TensorTracker(allocator=None)
    tracker.__enter__()
    with Passing():
        tracker.__exit__(None, None, None)
        torch.empty(100, dtype=torch.uint8)
        with pytest.raises(RuntimeError) as error:
            tracker.__enter__()
    assert str(error.value) == (
        "this TensorTracker was exited before a dispatch mode entered after it, which is still active; "
        "exit that mode before entering the tracker again"
    )
    assert tracker.memory_allocated() == 0
    with tracker:  # the mode above it is gone: it was taken off and can be entered
        torch.empty(10, dtype=torch.uint8)
    assert tracker.memory_allocated() == 0 and tracker.memory_stats()["allocated_bytes.all.allocated"] == 10
    assert _python_dispatch._get_current_dispatch_mode_stack() == []


def test_resume_counts_on_from_an_allocator_in_a_given_state():
    allocator = memlab.CachingAllocatorModel()
    occupied = allocator.malloc(4 * MiB)  # a 20 MiB segment; the storage below occupies this block
    allocator.malloc(MiB)  # a 2 MiB small segment held by memory the tracker does not see
    allocator.free(allocator.malloc(6 * MiB))  # 16 MiB cached after the 4 MiB block
    x = torch.empty(MiB, device="meta")  # 4 MiB
    tracker = memlab.TensorTracker()
    tracker.resume(allocator, [(x.untyped_storage(), occupied)])
    with tracker:
        y = torch.empty(6 * MiB // 4, device="meta")  # from the cached block: nothing reserved
    assert tracker.memory_allocated("meta") == 11 * MiB
    assert tracker.max_memory_reserved("meta") == 22 * MiB
    del x  # its block is freed with it
    assert tracker.memory_allocated("meta") == 7 * MiB
    assert y.numel() == 6 * MiB // 4
    with pytest.raises(ValueError, match="resume: the tracker has counted storages already"):
        tracker.resume(memlab.CachingAllocatorModel())


def test_resume_takes_each_storage_once_and_one_device():
    allocator = memlab.CachingAllocatorModel()
    first, second = allocator.malloc(512), allocator.malloc(512)
    x = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="resume: a storage of 16 bytes was given twice"):
        memlab.TensorTracker().resume(
            allocator, [(x.untyped_storage(), first), (x.untyped_storage(), second)]
        )
    with pytest.raises(ValueError, match="resume: every storage must be on one device; cpu is another"):
        memlab.TensorTracker().resume(
            allocator, [(x.untyped_storage(), first), (torch.empty(4).untyped_storage(), second)]
        )
