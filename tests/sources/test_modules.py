"""Memory per module: ``TensorTracker.by_module()`` against references that share none of its code.

Exact bytes (``allocator=None``) unless a test says otherwise. The model is an ``embed`` layer and
two residual blocks (``fc1``, ``act``, ``fc2``) and a ``head``, with a batch of 32 rows of 64
float32 (8 KiB): ``fc1``'s output is 32 x 256 float32 (32 KiB).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memlab
from memlab.sources.module_paths import ModulePaths
from memlab.sources.module_table import ModuleRow, ModuleTable

ROOT = Path(__file__).resolve().parents[2]
BATCH = 32 * 64 * 4
HIDDEN = 32 * 256 * 4
FC1 = 256 * 64 * 4 + 256 * 4  # weight and bias
FC2 = 64 * 256 * 4 + 64 * 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model_and_batch() -> tuple[TwoBlocks, torch.Tensor]:
    torch.manual_seed(0)
    return TwoBlocks(), torch.randn(32, 64)


class ExactBytes(TorchDispatchMode):
    """The reference: bytes of the storages that ops create and that are alive, the running
    maximum of each interval opened with :meth:`begin`, read by :meth:`end`."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.live: dict[int, Any] = {}
        self.running: dict[str, int] = {}
        self.peaks: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = id(storage)
                if key not in given and key not in self.live:
                    self.live[key] = weakref.ref(
                        storage, functools.partial(self._freed, key, storage.nbytes())
                    )
                    self.now += storage.nbytes()
        for name, peak in self.running.items():
            self.running[name] = max(peak, self.now)
        return out

    def _freed(self, key: int, nbytes: int, ref: Any) -> None:
        del self.live[key]
        self.now -= nbytes

    def begin(self, name: str) -> None:
        self.running[name] = self.now

    def end(self, name: str) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0), self.running.pop(name))


def in_forward(step: Any) -> Any:
    """``step`` as a forward hook that does nothing in a backward pass (where activation
    checkpointing runs forwards again) and returns ``None`` (the module's arguments and result stay)."""

    def hook(*args: Any) -> None:
        if torch._C._current_graph_task_id() == -1:
            step()

    return hook


def hook_blocks(model: TwoBlocks, reference: ExactBytes) -> list[Any]:
    """Each block's own forward and full backward hooks, opening and closing its intervals."""
    handles = []
    for i, block in enumerate(model.layers):
        fw, bw = f"layers.{i} forward", f"layers.{i} backward"
        handles += [
            block.register_forward_pre_hook(in_forward(functools.partial(reference.begin, fw))),
            block.register_forward_hook(in_forward(functools.partial(reference.end, fw))),
            block.register_full_backward_pre_hook(lambda m, g, bw=bw: reference.begin(bw)),
            block.register_full_backward_hook(lambda m, gi, go, bw=bw: reference.end(bw)),
        ]
    return handles


def test_block_peaks_equal_independent_hooks_over_exact_bytes() -> None:
    model, x = model_and_batch()
    reference = ExactBytes()
    handles = hook_blocks(model, reference)
    with memlab.TensorTracker(allocator=None, model=model) as tracker, reference:
        model(x).sum().backward()
    for handle in handles:
        handle.remove()
    frame = tracker.by_module()
    for i in (0, 1):
        assert frame.loc[f"layers.{i}", "forward_peak"] == reference.peaks[f"layers.{i} forward"]
        assert frame.loc[f"layers.{i}", "backward_peak"] == reference.peaks[f"layers.{i} backward"]
    # the second block's forward runs on top of everything the first one saved
    assert reference.peaks["layers.1 forward"] > reference.peaks["layers.0 forward"]


def test_recomputation_under_checkpointing_counts_in_backward() -> None:
    model, x = model_and_batch()
    reference = ExactBytes()
    handles = hook_blocks(model, reference)
    with memlab.TensorTracker(allocator=None, model=model) as tracker, reference:
        h = model.embed(x)
        for block in model.layers:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        model.head(h).sum().backward()
    for handle in handles:
        handle.remove()
    frame = tracker.by_module()
    assert frame.loc["layers.0":"layers.1.fc2", "calls"].tolist() == [1] * 8  # the recomputation is no call
    for i in (0, 1):
        assert frame.loc[f"layers.{i}", "forward_peak"] == reference.peaks[f"layers.{i} forward"]
        assert frame.loc[f"layers.{i}", "backward_peak"] == reference.peaks[f"layers.{i} backward"]
    # checkpoint's own saved-tensor hooks are innermost: the tracker sees no activation of the blocks
    assert frame.loc["layers.0":"layers.1.fc2", "activation"].sum() == 0


MEMTRACKER = """
import json, torch, memlab
from torch.distributed._tools.mem_tracker import MemTracker, _ModState
from tests.sources.test_modules import model_and_batch

model, x = model_and_batch()
theirs = MemTracker()
theirs.track_external(model, x)
with memlab.TensorTracker(allocator=None, model=model) as tracker:
    tracker.adopt(roots=[model, x])  # MemTracker counts the model and the batch too
    with theirs:
        model(x).sum().backward()
frame, cpu, found = tracker.by_module(), torch.device("cpu"), {}
for i, block in enumerate(model.layers):
    snapshots = theirs.memory_tracking[block].snapshots
    for phase, state in (("forward", _ModState.PEAK_FW), ("backward", _ModState.PEAK_BW)):
        found[f"layers.{i} {phase}"] = [
            int(frame.loc[f"layers.{i}", f"{phase}_peak"]), snapshots[state][-1][cpu]["Total"]
        ]
print(json.dumps(found))
"""


def test_block_peaks_equal_pytorch_memtracker() -> None:
    """PyTorch's own ``MemTracker`` measures the same peaks. In a process of its own: in this torch,
    MemTracker leaves the model's parameters alive after it exits, and later tests that walk
    ``gc`` for tensors would find them."""
    done = subprocess.run(
        [sys.executable, "-c", MEMTRACKER], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert sorted(found) == ["layers.0 backward", "layers.0 forward", "layers.1 backward", "layers.1 forward"]
    for ours, theirs in found.values():
        assert ours == theirs


def test_own_parameters_gradients_optimizer_state_and_activations() -> None:
    model, x = model_and_batch()
    optimizer = torch.optim.Adam(model.parameters())
    with memlab.TensorTracker(allocator=None, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model, x])
        model(x).sum().backward()
        optimizer.step()
    frame = tracker.by_module()
    assert list(frame.index) == [
        "",
        "embed",
        "layers",
        "layers.0",
        "layers.0.fc1",
        "layers.0.act",
        "layers.0.fc2",
        "layers.1",
        "layers.1.fc1",
        "layers.1.act",
        "layers.1.fc2",
        "head",
    ]
    block = frame.loc[
        "layers.0.fc1":"layers.0.fc2", ["parameter", "gradient", "optimizer_state", "activation"]
    ]
    assert block.values.tolist() == [
        # exp_avg and exp_avg_sq of weight and bias, and a 4-byte step counter each
        [FC1, FC1, 2 * FC1 + 2 * 4, BATCH],  # fc1 saved its input
        [0, 0, 0, HIDDEN],  # ReLU saved its output
        [FC2, FC2, 2 * FC2 + 2 * 4, 0],  # fc2 saved ReLU's output too: counted once, where first saved
    ]
    assert frame.loc["embed", "activation"] == BATCH  # the batch itself
    assert frame.loc["head", ["parameter", "activation"]].tolist() == [64 * 4 + 4, BATCH]
    assert frame.loc[["", "layers", "layers.0"], "activation"].tolist() == [0, 0, 0]  # no op of their own
    assert frame["calls"].tolist() == [1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # a ModuleList never runs
    assert frame.loc["layers", ["forward_peak", "backward_peak"]].isna().all()


def test_dataframe_types() -> None:
    model, x = model_and_batch()
    with memlab.TensorTracker(allocator=None, model=model) as tracker:
        model(x)
    frame = tracker.by_module()
    assert frame.index.name == "module"
    assert list(frame.columns) == [
        "type",
        "calls",
        "forward_peak",
        "backward_peak",
        "parameter",
        "gradient",
        "optimizer_state",
        "activation",
    ]
    assert str(frame["forward_peak"].dtype) == "Int64" and str(frame["parameter"].dtype) == "int64"
    assert frame.loc["", "type"] == "TwoBlocks" and frame.loc["layers.0.act", "type"] == "ReLU"
    assert frame["backward_peak"].isna().all()  # no backward ran
    assert frame["parameter"].sum() == 0  # made before the tracker was entered, not adopted: not counted
    assert frame.loc["", "forward_peak"] == frame["forward_peak"].max()  # the root's forward holds them all


def test_peaks_are_the_maximum_over_steps_and_the_cuda_model_counts_blocks() -> None:
    model, x = model_and_batch()
    with memlab.TensorTracker(model=model) as tracker, torch.no_grad():
        tracker.adopt(roots=[model])
        model(x)
        first = tracker.by_module()
        model(x[:1])  # a smaller batch: lower peaks
    frame = tracker.by_module()
    assert frame["calls"].tolist() == [2 * c for c in first["calls"].tolist()]
    assert frame[["forward_peak", "backward_peak"]].equals(first[["forward_peak", "backward_peak"]])
    assert frame.loc["layers.0.fc1", "parameter"] == 65536 + 1024  # both multiples of 512 B
    assert frame.loc["head", "parameter"] == 512 + 512  # 256 B and 4 B, one 512-byte block each


def test_gradients_are_unchanged() -> None:
    model, x = model_and_batch()
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with memlab.TensorTracker(model=model):
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))


def test_hooks_are_removed_on_exit_also_when_the_forward_raises() -> None:
    model, x = model_and_batch()
    before = (dict(nn_module._global_forward_pre_hooks), dict(nn_module._global_forward_hooks))
    tracker = memlab.TensorTracker(allocator=None, model=model)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"), tracker:
        out = model.embed(x)  # kept with hooks on it: backward after the exit must record nothing
        model(torch.randn(32, 3))
    assert (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks) == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    recorder = tracker.module_recorder
    assert not recorder.active and recorder._open == []
    frame = tracker.by_module()
    assert frame.loc["", "calls"] == 1 and frame.loc["embed", "calls"] == 2  # the failed call ended too
    assert not pd.isna(frame.loc["", "forward_peak"])
    out.sum().backward()
    assert tracker.by_module()["backward_peak"].isna().all()


def test_modules_true_records_the_models_the_code_calls() -> None:
    model, x = model_and_batch()
    loss = nn.MSELoss()
    with memlab.TensorTracker(allocator=None, modules=True) as tracker:
        target = torch.zeros(32, 1)
        loss(model(x), target).backward()
        nn.MSELoss()(torch.ones(2), torch.zeros(2))  # a second model of the same class
    frame = tracker.by_module()
    assert list(frame.index[:2]) == ["", "embed"] and list(frame.index[-2:]) == ["MSELoss", "MSELoss#2"]
    assert frame.loc["MSELoss", "activation"] == 2 * 32 * 4  # it saved the prediction and the target
    assert frame.loc["layers.1.fc1", "calls"] == 1  # called inside the model: not a model of its own


def test_modules_outside_the_known_models_count_in_their_caller() -> None:
    model, x = model_and_batch()
    other = nn.Linear(64, 64)
    with memlab.TensorTracker(allocator=None, model=model.layers[0]) as tracker:
        model(x)
        other(x)
    assert list(tracker.by_module().index) == ["", "fc1", "act", "fc2"]


def test_model_added_while_active_is_recorded_from_then_on() -> None:
    model, x = model_and_batch()
    with memlab.TensorTracker(allocator=None) as tracker:
        model(x)
        tracker.add_model(model)
        model(x)
    assert tracker.by_module().loc["", "calls"] == 1


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({}, ValueError, "by_module needs a model: TensorTracker(model=...), tracker.add_model(model), or "),
        ({"modules": False, "model": "a Linear"}, ValueError, "; this tracker has modules=False"),
        (
            {"modules": "all"},
            TypeError,
            "modules must be None (the known models), True (also those called) or",
        ),
    ],
)
def test_bad_requests(options: dict[str, Any], error: type[Exception], message: str) -> None:
    if "model" in options:  # made here: a module made at collection would outlive every test
        options = {**options, "model": nn.Linear(1, 1)}
    with pytest.raises(error) as raised:
        memlab.TensorTracker(**options).by_module()
    assert message in str(raised.value)


ROWS = (
    ModuleRow("", "Net", 1, 3072, 4096, 0, 0, 0, 0),
    ModuleRow("embed", "Linear", 1, 2048, 4096, 1024, 1024, 2048, 512),
    ModuleRow("unused", "Linear", 0, None, None, 1024, 0, 0, 0),
    ModuleRow("head", "Linear", 1, 3072, 2048, 512, 512, 1024, 1536),
)


def test_text_sorts_by_peak() -> None:
    assert ModuleTable("cuda", ROWS).text().splitlines()[3:] == [
        "module  type    calls  forward  backward  parameter  gradient  optimizer  activation",
        "(root)  Net         1    3.00K     4.00K      0.00B     0.00B      0.00B       0.00B",
        "embed   Linear      1    2.00K     4.00K      1.00K     1.00K      2.00K     512.00B",
        "head    Linear      1    3.00K     2.00K    512.00B   512.00B      1.00K       1.50K",
        "unused  Linear      0        -         -      1.00K     0.00B      0.00B       0.00B",
    ]
    assert (
        ModuleTable("cuda", ()).text()
        == "memory per module on cuda, highest peak first: no module recorded\n"
    )


def test_html_sorts_by_peak() -> None:
    page = ModuleTable("cuda", ROWS).html()
    starts = [page.index(f">{name}</td>") for name in ("(root)", "embed", "head", "unused")]
    assert starts == sorted(starts)
    assert page.startswith("<p>memory per module on cuda, highest peak first</p>")


def test_paths_name_each_module_once_the_first_model_first() -> None:
    first, second, third = nn.Sequential(nn.Linear(1, 1)), nn.Sequential(nn.ReLU()), nn.Sequential(nn.ReLU())
    shared = first[0]
    second.append(shared)
    paths = ModulePaths(lambda: [first, second, third])
    assert [paths.path(m) for m in (first, shared, second, second[0], third[0])] == [
        "",
        "0",  # named in the first model, which holds it too
        "Sequential",
        "Sequential.0",
        "Sequential#2.0",
    ]
    assert paths.path(nn.Linear(1, 1), top=True) is None  # not discovering
    assert list(paths.named()) == ["", "0", "Sequential", "Sequential.0", "Sequential#2", "Sequential#2.0"]
