"""Courtesy on CPU with a directory: tensors leave memory in place and come back bit-exact."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from memlab import Courtesy
from memlab.sources.tracker import TensorTracker


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = model(batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def _model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of every parameter, gradient and optimizer state tensor, by name."""
    state = {}
    for name, param in model.named_parameters():
        state[name] = param.detach().clone()
        state[f"{name}.grad"] = param.grad.clone()
        for key, value in optimizer.state[param].items():
            state[f"{name}.{key}"] = value.clone()
    return state


def _bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    )


# parameters, gradients, exp_avg, exp_avg_sq, a 4-byte step counter per parameter, and the batch
_TRACKED_BYTES = 4 * (32 * 64 + 64 + 64 * 8 + 8) * 4 + 4 * 4 + 16 * 32 * 4


def test_tracked_memory_of_the_model_drops_to_zero_and_returns(tmp_path: Path):
    with TensorTracker(allocator=None) as tracker:
        batch = torch.randn(16, 32)
        model, optimizer = _model_and_optimizer()
        _train_step(model, optimizer, batch)
        gc.collect()
        assert tracker.memory_allocated("cpu") == _TRACKED_BYTES == 44_176
        courtesy = Courtesy(device="cpu", offload=tmp_path)
        moved = courtesy.yield_memory()
        assert tracker.memory_allocated("cpu") == 0
        # every CPU tensor of the process moved; the restored storages are new allocations
        assert courtesy.restore() == moved >= _TRACKED_BYTES
        assert tracker.memory_allocated("cpu") == moved


def test_tracked_memory_returns_exactly_in_a_process_where_the_tracker_saw_every_tensor(tmp_path: Path):
    script = textwrap.dedent(
        f"""
        import gc, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from tests.test_courtesy import _model_and_optimizer, _train_step
        from memlab import Courtesy, TensorTracker

        with TensorTracker(allocator=None) as tracker:
            model, optimizer = _model_and_optimizer()
            _train_step(model, optimizer, torch.randn(16, 32))
            gc.collect()
            courtesy = Courtesy(device="cpu", offload={str(tmp_path)!r})
            steps = [tracker.memory_allocated("cpu"), courtesy.yield_memory()]
            steps += [tracker.memory_allocated("cpu"), courtesy.restore(), tracker.memory_allocated("cpu")]
        print(steps)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    model_bytes = _TRACKED_BYTES - 16 * 32 * 4  # the batch is freed after the step
    assert out.strip() == str([model_bytes, model_bytes, 0, model_bytes, model_bytes])


def test_parameters_gradients_and_optimizer_state_come_back_bit_identical(tmp_path: Path):
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, torch.randn(16, 32))
    before = _state(model, optimizer)
    objects = [*model.parameters(), *(p.grad for p in model.parameters())]
    objects += [v for p in model.parameters() for v in optimizer.state[p].values()]
    ids = [id(obj) for obj in objects]
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    assert moved >= 42_128  # at least the model's own storages; other live CPU tensors move too
    assert model[0].weight.shape == (64, 32) and model[0].weight.dtype == torch.float32
    assert courtesy.restore() == moved
    after = _state(model, optimizer)
    assert sorted(after) == sorted(before)
    assert all(_bit_identical(after[name], before[name]) for name in before)
    same = [*model.parameters(), *(p.grad for p in model.parameters())]
    same += [v for p in model.parameters() for v in optimizer.state[p].values()]
    assert [id(obj) for obj in same] == ids


def test_training_after_restore_matches_a_run_that_never_yielded(tmp_path: Path):
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reference, reference_opt = _model_and_optimizer(seed=1)
    model, optimizer = _model_and_optimizer(seed=1)
    first = (_train_step(reference, reference_opt, batches[0]), _train_step(model, optimizer, batches[0]))
    assert first[0].item() == first[1].item()
    with Courtesy(device="cpu", offload=tmp_path):
        assert torch.isnan(model[0].weight).all()
    reference_loss = _train_step(reference, reference_opt, batches[1])
    loss = _train_step(model, optimizer, batches[1])
    assert loss.item() == reference_loss.item()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert _bit_identical(mine.detach(), theirs.detach())
        assert _bit_identical(optimizer.state[mine]["exp_avg_sq"], reference_opt.state[theirs]["exp_avg_sq"])


def test_views_still_share_storage_with_their_offsets(tmp_path: Path):
    weight = nn.Parameter(torch.arange(20.0).reshape(4, 5))
    row = weight[2]
    column = weight[:, 1]
    orphan_view = torch.arange(10.0)[3:7]  # its base has no Python name of its own
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    assert (row.shape, column.shape, orphan_view.shape) == ((5,), (4,), (4,))
    courtesy.restore()
    assert row.untyped_storage() is weight.untyped_storage() is column.untyped_storage()
    assert (row.storage_offset(), column.storage_offset(), column.stride()) == (10, 1, (5,))
    assert orphan_view.untyped_storage() is orphan_view._base.untyped_storage()
    assert orphan_view.tolist() == [3.0, 4.0, 5.0, 6.0] and orphan_view.storage_offset() == 3
    with torch.no_grad():
        weight[2, 1] = -1.0
    assert row[1].item() == column[2].item() == -1.0


def test_directory_offload_writes_each_storage_once_and_leaves_placeholders(tmp_path: Path):
    weight = torch.ones(1000, dtype=torch.float64)
    half = weight[:500]
    counts = torch.arange(300, dtype=torch.int32)
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    sizes = sorted(path.stat().st_size for path in workdir.iterdir())
    assert 8000 in sizes and 1200 in sizes and sizes.count(8000) == 1
    assert sum(sizes) == courtesy.yielded_bytes
    assert (weight.shape, weight.dtype, half.shape, counts.dtype) == (
        (1000,),
        torch.float64,
        (500,),
        torch.int32,
    )
    assert weight.untyped_storage().nbytes() == 8 and counts.untyped_storage().nbytes() == 4
    assert torch.isnan(weight).all() and counts.eq(0).all()
    with pytest.raises(RuntimeError):
        weight.add_(1)  # a placeholder cannot be written to
    courtesy.restore()
    assert not workdir.exists()
    assert weight.eq(1).all() and half.untyped_storage() is weight.untyped_storage()
    assert counts.tolist() == list(range(300))


def test_a_second_yield_is_harmless_and_restore_without_yield_does_nothing(tmp_path: Path):
    data = torch.randn(256)
    copy = data.clone()
    storage = data.untyped_storage()
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    assert courtesy.restore() == 0
    assert data.untyped_storage() is storage
    first = courtesy.yield_memory()
    assert first > 0 and courtesy.yield_memory() == 0
    assert courtesy.yielded_bytes == first
    assert courtesy.restore() == first and courtesy.restore() == 0
    assert _bit_identical(data, copy) and courtesy.yielded_bytes == 0


def test_restore_that_fails_part_way_loses_nothing_and_resumes(tmp_path: Path):
    tensors = [torch.full((100 + i,), float(i)) for i in range(5)]
    views = [t[1:3] for t in tensors]
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    files = sorted(workdir.iterdir())
    hidden = files[len(files) // 2]
    os.rename(hidden, tmp_path / "hidden.bin")
    with pytest.raises(FileNotFoundError):
        courtesy.restore()
    assert 0 < courtesy.yielded_bytes < moved
    os.rename(tmp_path / "hidden.bin", hidden)
    remaining = courtesy.yielded_bytes
    assert courtesy.restore() == remaining
    assert courtesy.yielded_bytes == 0 and not workdir.exists()
    for i, (tensor, view) in enumerate(zip(tensors, views, strict=True)):
        assert tensor.shape == (100 + i,) and tensor.eq(float(i)).all()
        assert view.untyped_storage() is tensor.untyped_storage() and view.storage_offset() == 1


def test_tensors_dropped_while_yielded_are_not_brought_back(tmp_path: Path):
    kept = torch.ones(1000)
    dropped = torch.ones(2000)
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    del dropped
    assert courtesy.restore() == moved - 8000
    assert kept.eq(1).all()


def test_cpu_courtesy_never_touches_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    data = torch.ones(10)
    with Courtesy(device="cpu", offload=tmp_path):
        pass
    assert calls == [] and not torch.cuda.is_initialized()
    assert data.eq(1).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize(("device", "asked"), [("cuda", "cuda"), (0, "cuda:0"), ("cuda:1", "cuda:1")])
def test_a_cuda_device_this_machine_lacks_is_refused_at_construction(device: object, asked: str):
    with pytest.raises(ValueError) as raised:
        Courtesy(device=device)
    assert str(raised.value) == (
        f"Courtesy(device='{asked}'): this machine has no such CUDA device, so there is nothing to "
        "yield; valid here: 'cpu' with a directory as offload"
    )
    assert not torch.cuda.is_initialized()


@pytest.mark.filterwarnings("ignore:Sparse")
def test_sparse_tensors_and_storages_shared_with_them_stay_in_place(tmp_path: Path):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,))
    values = sparse._values()  # gc sees this one, not the sparse tensor's own values tensor
    storage = values.untyped_storage()
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    assert courtesy.skipped >= 2  # the sparse tensor, and values whose storage it shares
    assert values.untyped_storage() is storage and values.tolist() == [1.0, 2.0]
    assert sparse.to_dense().tolist() == [1.0, 2.0, 0.0]
    courtesy.restore()
    assert values.untyped_storage() is sparse._values().untyped_storage() is storage
    assert repr(courtesy) == f"Courtesy(device='cpu', offload={str(tmp_path)!r}, yielded_bytes=0)"


def test_a_wrapper_subclass_stays_while_its_inner_tensors_move(tmp_path: Path):
    from torch.testing._internal.two_tensor import TwoTensor

    pair = TwoTensor(torch.full((10,), 2.0), torch.full((10,), 3.0))
    inner = pair.a
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    assert pair.a is inner and torch.isnan(pair.a).all() and inner.untyped_storage().nbytes() == 4
    assert courtesy.skipped >= 1  # the pair itself
    courtesy.restore()
    assert pair.a.tolist() == [2.0] * 10 and pair.b.tolist() == [3.0] * 10


def test_bad_input_gets_typed_errors_listing_what_is_valid(tmp_path: Path):
    forms = r"'cpu', 'meta', 'cuda', 'cuda:1', a CUDA index \(0, 1, \.\.\.\) or a torch\.device"
    with pytest.raises(ValueError, match=rf"^device 'gpu' is not a device; valid: {forms}$"):
        Courtesy(device="gpu")
    with pytest.raises(ValueError, match=r"^device 'meta' holds no memory to yield; valid here: .*'cpu'"):
        Courtesy(device="meta", offload=tmp_path)
    with pytest.raises(TypeError, match=rf"^device must be {forms}; got float 1\.5$"):
        Courtesy(device=1.5)
    with pytest.raises(TypeError, match=r"offload must be 'cpu' or the path of a directory; got int 3"):
        Courtesy(device="cpu", offload=3)
    with pytest.raises(
        ValueError, match=r"offload='cuda:1': tensors can only be offloaded to 'cpu' or to files"
    ):
        Courtesy(device="cpu", offload="cuda:1")
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=r"is neither 'cpu' nor an existing directory; create it first"):
        Courtesy(device="cpu", offload=missing)
    with pytest.raises(ValueError, match=r"would move host memory to host memory"):
        Courtesy(device="cpu", offload="cpu")


@pytest.mark.cuda
def test_cuda_yield_to_cpu_frees_the_device_and_restores_in_place():
    model = nn.Linear(1024, 1024, device="cuda")
    weight = model.weight
    expected = weight.detach().cpu()
    with Courtesy(device="cuda", offload="cpu") as courtesy:
        assert model.weight.device.type == "cpu" and courtesy.yielded_bytes == 4 * (1024 * 1024 + 1024)
        assert torch.cuda.memory_allocated() == 0
    assert model.weight is weight and weight.device.type == "cuda"
    assert torch.equal(weight.detach().cpu(), expected)
