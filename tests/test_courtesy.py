"""Courtesy on CPU with a directory: tensors leave memory in place and come back bit-exact."""

from __future__ import annotations

import copy
import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from memlab import Courtesy, _offload
from memlab._parked_guard import ParkedParameter, ParkedTensor
from memlab.courtesy import ParkedTensorError
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
    data = _raw(tensors[2])
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    hidden = _file_holding(workdir, data)
    os.rename(hidden, tmp_path / "hidden.bin")
    with pytest.raises(OSError, match=r"could not bring back 1 storage;"):
        courtesy.restore()
    assert courtesy.yielded_bytes == 408  # only the storage of the missing file is still parked
    assert torch.isnan(tensors[2]).all() and tensors[3].eq(3.0).all()
    os.rename(tmp_path / "hidden.bin", hidden)
    assert courtesy.restore() == 408 < moved
    assert courtesy.yielded_bytes == 0 and not workdir.exists()
    for i, (tensor, view) in enumerate(zip(tensors, views, strict=True)):
        assert tensor.shape == (100 + i,) and tensor.eq(float(i)).all()
        assert view.untyped_storage() is tensor.untyped_storage() and view.storage_offset() == 1


def _raw(tensor: torch.Tensor) -> bytes:
    # Of a copy: .numpy() shares a storage with NumPy for good, and Courtesy then leaves it in place.
    return tensor.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes()


def _file_holding(workdir: Path, data: bytes) -> Path:
    """The offload file that holds ``data`` (the tests give each tensor distinct values)."""
    (path,) = [path for path in workdir.iterdir() if path.read_bytes() == data]
    return path


def test_a_missing_and_a_truncated_file_hold_back_only_their_own_tensors(tmp_path: Path):
    lost = torch.full((1000,), 7.25)  # 4000 B
    cut = torch.full((500,), 3.5, dtype=torch.float64)  # 4000 B
    cut_view = cut[10:20]
    kept = [torch.full((300 + i,), float(i)) for i in range(4)]
    before = [t.clone() for t in kept]
    lost_bytes, cut_bytes = _raw(lost), _raw(cut)
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    lost_file, cut_file = _file_holding(workdir, lost_bytes), _file_holding(workdir, cut_bytes)
    lost_file.unlink()
    cut_file.write_bytes(cut_bytes[:100])
    causes = {
        lost_file: f"{lost_file} (4000 B, tensor float32 [1000]): No such file or directory",
        cut_file: f"{cut_file} (4000 B, tensors float64 [500], float64 [10]): the file holds 100 "
        "bytes, 4000 were written: it was truncated or changed",
    }
    expected = (
        "Courtesy.restore() could not bring back 2 storages; their tensors stay parked (placeholders "
        "that read NaN or 0) and everything else is restored. Fix the cause (put the file back, free "
        "memory) and call restore() again: " + "; ".join(causes[path] for path in sorted(causes))
    )
    for _ in range(2):  # a retry with the files still broken loses nothing more
        with pytest.raises(OSError) as raised:
            courtesy.restore()
        assert str(raised.value) == expected
        assert courtesy.yielded_bytes == 8000
        assert all(_bit_identical(a, b) for a, b in zip(kept, before, strict=True))
        assert torch.isnan(lost).all() and torch.isnan(cut_view).all()
        assert sorted(workdir.iterdir()) == [cut_file]  # the truncated file is kept as it is
        assert cut_file.read_bytes() == cut_bytes[:100]
    lost_file.write_bytes(lost_bytes)
    cut_file.write_bytes(cut_bytes)
    assert courtesy.restore() == 8000 < moved
    assert lost.eq(7.25).all() and cut.eq(3.5).all() and cut_view.untyped_storage() is cut.untyped_storage()
    assert courtesy.yielded_bytes == 0 and not workdir.exists()


def test_files_that_cannot_be_deleted_after_reading_them_back_are_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    data = torch.full((1000,), 2.5)
    gc.collect()  # no tensor of an earlier test may die meanwhile: every parked one comes back
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    files = sorted(workdir.iterdir())
    real_unlink = Path.unlink

    def read_only(path: Path, missing_ok: bool = False) -> None:
        # What a directory without write permission answers (root would ignore a chmod).
        if path.parent == workdir:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        real_unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.warns(UserWarning) as warned:
        assert courtesy.restore() == moved
    assert [str(w.message) for w in warned] == [
        f"Courtesy could not delete {len(files)} offload file{'s' * (len(files) != 1)} after use (the "
        "tensors are fine); delete them yourself: "
        + ", ".join(f"{path} (Permission denied)" for path in files)
    ]
    assert data.eq(2.5).all() and courtesy.yielded_bytes == 0
    assert sorted(workdir.iterdir()) == files
    assert courtesy.restore() == 0


def _disk_full_after(count: int, written: list[Path]) -> Any:
    """A writer that writes ``count`` files, then leaves part of the next one and fails as a full disk."""
    real = _offload.write_bytes

    def write(path: Path, storage: torch.UntypedStorage) -> int:
        if len(written) == count:
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        written.append(path)
        return real(path, storage)

    return write


def test_a_yield_that_fails_part_way_puts_every_tensor_back_and_removes_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    tensors = [torch.full((200 + i,), float(i)) for i in range(6)]
    views = [t[1:3] for t in tensors]
    storages = [t.untyped_storage() for t in tensors]
    step = torch.tensor(5.0)  # a 0-d step counter
    written: list[Path] = []
    monkeypatch.setattr(_offload, "write_bytes", _disk_full_after(4, written))
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    with pytest.raises(OSError) as raised:
        with courtesy:
            pytest.fail("the block ran although parking failed")
    assert raised.value.errno == errno.ENOSPC
    assert len(written) == 4 and list(tmp_path.iterdir()) == []
    assert courtesy.yielded_bytes == 0 and courtesy.restore() == 0
    for i, (tensor, view, storage) in enumerate(zip(tensors, views, storages, strict=True)):
        assert tensor.untyped_storage() is storage and view.untyped_storage() is storage
        assert tensor.tolist() == [float(i)] * (200 + i) and view.storage_offset() == 1
    assert step.item() == 5.0 and step.add_(1).item() == 6.0


def test_a_second_yield_that_fails_undoes_only_its_own_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    first = torch.full((300,), 1.5)
    gc.collect()  # no tensor of an earlier test may die meanwhile: every parked one comes back
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    files = sorted(workdir.iterdir())
    later = [torch.full((400 + i,), float(i)) for i in range(3)]
    monkeypatch.setattr(_offload, "write_bytes", _disk_full_after(1, []))
    with pytest.raises(OSError, match="No space left on device"):
        courtesy.yield_memory()
    assert courtesy.yielded_bytes == moved and sorted(workdir.iterdir()) == files
    assert torch.isnan(first).all() and [t[0].item() for t in later] == [0.0, 1.0, 2.0]
    monkeypatch.undo()
    assert courtesy.restore() == moved and first.eq(1.5).all() and not workdir.exists()


@pytest.mark.parametrize("interrupt", ["raised", "signal"])
def test_ctrl_c_while_parking_puts_every_tensor_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: str, ctrl_c: None
):
    tensors = [torch.full((250 + i,), float(i)) for i in range(5)]
    storages = [t.untyped_storage() for t in tensors]
    written: list[Path] = []
    real = _offload.write_bytes

    def write(path: Path, storage: torch.UntypedStorage) -> int:
        written.append(path)
        checksum = real(path, storage)
        if len(written) == 3 and interrupt == "raised":
            raise KeyboardInterrupt
        if len(written) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt at its next check
        return checksum

    monkeypatch.setattr(_offload, "write_bytes", write)
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        courtesy.yield_memory()
    assert len(written) == 3 and list(tmp_path.iterdir()) == [] and courtesy.yielded_bytes == 0
    for i, (tensor, storage) in enumerate(zip(tensors, storages, strict=True)):
        assert tensor.untyped_storage() is storage and tensor.eq(float(i)).all()


def test_ctrl_c_while_restoring_waits_until_every_tensor_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c: None
):
    tensors = [torch.full((150 + i,), float(i)) for i in range(5)]
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    reads: list[Path] = []
    real = _offload.read_bytes

    def read(path: Path, nbytes: int, checksum: int | None) -> torch.UntypedStorage:
        reads.append(path)
        if len(reads) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(path, nbytes, checksum)

    monkeypatch.setattr(_offload, "read_bytes", read)
    with pytest.raises(KeyboardInterrupt):
        courtesy.restore()
    assert len(reads) > 2 and courtesy.yielded_bytes == 0 and not workdir.exists()
    assert all(tensor.eq(float(i)).all() for i, tensor in enumerate(tensors))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# Each way to write to a tensor or change its shape, strides or storage in place, and the name
# the error gives it.
_WRITES: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "add_": (lambda t: t.add_(1), "add_"),
    "+=": (lambda t: t.__iadd__(1), "add_"),
    "fill_": (lambda t: t.fill_(1), "fill_"),
    "zero_": (lambda t: t.zero_(), "zero_"),
    "copy_": (lambda t: t.copy_(torch.ones(t.shape, dtype=t.dtype)), "copy_"),
    "setitem": (lambda t: t.__setitem__(..., 1), "__setitem__"),
    "out=": (lambda t: torch.mul(torch.ones(t.shape, dtype=t.dtype), 2, out=t), "mul(out=...)"),
    "resize_": (lambda t: t.resize_(100), "resize_"),
    "set_": (lambda t: t.set_(torch.zeros(3, dtype=t.dtype).untyped_storage()), "set_"),
    "unsqueeze_": (lambda t: t.unsqueeze_(0), "unsqueeze_"),
    "t_": (lambda t: t.t_(), "t_"),
    "as_strided_": (lambda t: t.as_strided_((1,), (1,)), "as_strided_"),
    "squeeze_": (lambda t: t.squeeze_(), "squeeze_"),
    "share_memory_": (lambda t: t.share_memory_(), "share_memory_"),
    "nn.init (by keyword)": (lambda t: nn.init.constant_(t, 2), "constant_"),
    "inplace=True": (lambda t: torch.nn.functional.relu(t, inplace=True), "relu(inplace=True)"),
    "torch.ops": (lambda t: torch.ops.aten.add_.Scalar(t, 1), "add_.Scalar"),
    "_foreach_": (lambda t: torch._foreach_add_([t], 1), "_foreach_add_"),
}


def _parked_message(tensor: torch.Tensor, how: str) -> str:
    return (
        f"tensor {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} is parked by "
        f"memlab.Courtesy until restore(): {how} would write to it or change its shape, strides or "
        "storage in place; call restore() first"
    )


@pytest.mark.parametrize("write", sorted(_WRITES))
@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (3,), (2, 3)])
def test_every_write_to_a_parked_tensor_raises_whatever_its_shape(
    tmp_path: Path, shape: tuple[int, ...], write: str
):
    target = torch.full(shape, 4.0)
    integer = torch.full(shape, 9, dtype=torch.int64)
    other = torch.full((5,), 6.0)
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    placeholders = [t.untyped_storage() for t in (target, integer, other)]
    op, how = _WRITES[write]
    for tensor in (target, integer):
        with pytest.raises(ParkedTensorError) as raised:
            op(tensor)
        assert str(raised.value) == _parked_message(tensor, how)
        assert isinstance(raised.value, RuntimeError)
    assert (target.shape, integer.shape, target.stride()) == (shape, shape, (0,) * len(shape))
    assert [t.untyped_storage() for t in (target, integer, other)] == placeholders
    assert [s.nbytes() for s in placeholders] == [4, 8, 4]  # nothing grew
    assert torch.isnan(other).all() and torch.isnan(target).all() and integer.eq(0).all()
    courtesy.restore()
    assert target.eq(4.0).all() and integer.eq(9).all() and other.eq(6.0).all()
    assert type(target) is torch.Tensor and target.shape == shape


def test_an_optimizer_step_on_parked_state_raises_and_changes_nothing(tmp_path: Path):
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, torch.randn(16, 32))
    before = _state(model, optimizer)
    assert before["0.weight.step"].shape == ()  # AdamW's 0-d step counter
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    with pytest.raises(ParkedTensorError) as raised:
        optimizer.step()
    assert str(raised.value) == _parked_message(before["0.weight.step"], "add_")  # AdamW's step += 1
    courtesy.restore()
    after = _state(model, optimizer)
    assert all(_bit_identical(after[name], before[name]) for name in before)


def test_tensors_sharing_memory_with_numpy_or_other_processes_stay_in_place(tmp_path: Path):
    array = np.arange(6, dtype=np.float32)
    from_numpy = torch.from_numpy(array)
    shared = torch.full((4,), 2.0).share_memory_()
    plain = torch.full((7,), 1.0)
    storages = (from_numpy.untyped_storage(), shared.untyped_storage())
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    with pytest.warns(UserWarning) as warned:
        courtesy.yield_memory()
    (message,) = {str(w.message) for w in warned}
    assert (
        message.startswith("Courtesy left ")
        and " storages on cpu in place: their memory is shared, " in message
    )
    assert (
        "tensor float32 [6] (24 B, memory shared outside PyTorch (torch.from_numpy, .numpy(), frombuffer, "
        "DLPack, a memory map))"
    ) in message
    assert "tensor float32 [4] (16 B, in shared memory (share_memory_()): other processes see it)" in message
    assert courtesy.skipped >= 2 and torch.isnan(plain).all()
    assert (from_numpy.untyped_storage(), shared.untyped_storage()) == storages
    courtesy.restore()
    array[0] = 10.0
    assert from_numpy[0].item() == 10.0 and from_numpy.untyped_storage() is storages[0]
    assert shared.is_shared() and shared.untyped_storage() is storages[1] and plain.eq(1.0).all()


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


@pytest.mark.cuda
def test_cuda_yield_to_a_directory_writes_raw_bytes_and_restores_on_the_gpu(tmp_path: Path):
    weight = torch.arange(1000.0, device="cuda")
    step = torch.tensor(3.0, device="cuda")
    with Courtesy(device="cuda", offload=tmp_path) as courtesy:
        assert courtesy.yielded_bytes == 4004 and torch.cuda.memory_allocated() == 0
        assert weight.device.type == "cpu" and torch.isnan(weight).all()
        with pytest.raises(ParkedTensorError) as raised:
            step.add_(1)
        assert str(raised.value) == _parked_message(step, "add_")
    assert weight.device.type == "cuda" and weight.cpu().tolist() == [float(i) for i in range(1000)]
    assert step.item() == 3.0 and list(tmp_path.iterdir()) == []


# -- issue 25: a file changed in place, views taken while parked, inference tensors, every dtype --


def test_a_file_changed_in_place_is_refused_named_and_restored_once_put_back(tmp_path: Path):
    changed = torch.arange(1000, dtype=torch.float32)  # 4000 B
    changed_view = changed[100:200]
    kept = [torch.full((300 + i,), float(i)) for i in range(4)]
    before = [t.clone() for t in kept]
    data = _raw(changed)
    gc.collect()  # no tensor of an earlier test may die meanwhile
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    moved = courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    path = _file_holding(workdir, data)
    corrupt = bytearray(data)
    corrupt[2000:2004] = b"\x00\x00\xc0\x7f"  # one float in the middle becomes NaN; the size is the same
    path.write_bytes(bytes(corrupt))
    expected = (
        "Courtesy.restore() could not bring back 1 storage; its tensors stay parked (placeholders that "
        "read NaN or 0) and everything else is restored. Fix the cause (put the file back, free memory) "
        f"and call restore() again: {path} (4000 B, tensors float32 [1000], float32 [100]): its bytes "
        f"changed after they were written (CRC-32 {zlib.crc32(corrupt):#010x}, {zlib.crc32(data):#010x} "
        "was written): it was overwritten or corrupted"
    )
    for _ in range(2):  # a retry with the file still changed loses nothing more
        with pytest.raises(OSError) as raised:
            courtesy.restore()
        assert str(raised.value) == expected
        assert courtesy.yielded_bytes == 4000 < moved
        assert all(_bit_identical(a, b) for a, b in zip(kept, before, strict=True))
        assert torch.isnan(changed).all() and type(changed) is ParkedTensor
        assert sorted(workdir.iterdir()) == [path] and path.read_bytes() == corrupt
    path.write_bytes(data)
    assert courtesy.restore() == 4000 and courtesy.yielded_bytes == 0 and not workdir.exists()
    assert _raw(changed) == data and type(changed) is torch.Tensor
    assert (
        changed_view.untyped_storage() is changed.untyped_storage() and changed_view.storage_offset() == 100
    )


# Aliases taken of parked tensors inside the block, each as a function of the tensors it is taken
# of: after restore it must be the same alias of the restored tensors, byte for byte.
_ALIASES: dict[str, Callable[[nn.Linear, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "weight[0]": lambda m, x, c: m.weight[0],
    "weight.detach()": lambda m, x, c: m.weight.detach(),
    "weight.data": lambda m, x, c: m.weight.data,
    "weight.view(2, 12)": lambda m, x, c: m.weight.view(2, 12),
    "weight.detach().view(-1)[5:]": lambda m, x, c: m.weight.detach().view(-1)[5:],
    "x.T": lambda m, x, c: x.T,
    "x.mT": lambda m, x, c: x.mT,
    "x[::2]": lambda m, x, c: x[::2],
    "x[1:][:, 2:][0]": lambda m, x, c: x[1:][:, 2:][0],
    "x.split(2)[1]": lambda m, x, c: x.split(2)[1],
    "list(x)[2]": lambda m, x, c: list(x)[2],
    "x.narrow(1, 2, 3)": lambda m, x, c: x.narrow(1, 2, 3),
    "x.diagonal()": lambda m, x, c: x.diagonal(),
    "x.unfold(1, 2, 2)": lambda m, x, c: x.unfold(1, 2, 2),
    "x[0:1].expand(3, 6)": lambda m, x, c: x[0:1].expand(3, 6),
    "x.as_strided((2, 2), (6, 1), 7)": lambda m, x, c: x.as_strided((2, 2), (6, 1), 7),
    "x.view(torch.uint8)": lambda m, x, c: x.view(torch.uint8),  # a placeholder cannot take this one
    "x.contiguous()": lambda m, x, c: x.contiguous(),
    "torch.view_as_real(c)": lambda m, x, c: torch.view_as_real(c),
    "c.imag": lambda m, x, c: c.imag,
}


@pytest.mark.parametrize("alias", sorted(_ALIASES))
def test_an_alias_taken_while_parked_reads_the_restored_data(tmp_path: Path, alias: str):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    x = torch.arange(24.0).reshape(4, 6)
    c = torch.randn(3, dtype=torch.complex64)
    make = _ALIASES[alias]
    expected = make(copy.deepcopy(model), x.clone(), c.clone())  # the same alias of copies of the data
    with TensorTracker(allocator=None) as tracker:
        with Courtesy(device="cpu", offload=tmp_path):
            taken = make(model, x, c)
            assert type(taken) is ParkedTensor and taken.untyped_storage().nbytes() <= 8  # a placeholder
            with pytest.raises(ParkedTensorError):
                taken.zero_()
        assert tracker.memory_allocated("meta") == 0  # the meta shadows are no user allocation
    source = make(model, x, c)  # the same alias of the restored tensors
    assert type(taken) is torch.Tensor
    assert taken.untyped_storage() is source.untyped_storage()
    assert (taken.storage_offset(), taken.stride(), taken.shape) == (
        source.storage_offset(),
        source.stride(),
        source.shape,
    )
    assert _values(taken) == _values(expected) and taken.dtype == expected.dtype


def _values(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``'s elements, in order."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone().numpy().tobytes()


def test_a_copy_made_while_parked_is_a_copy_and_a_replaced_tensor_is_left_as_made(tmp_path: Path):
    x = torch.arange(24.0).reshape(4, 6)
    model = nn.Linear(6, 4)
    with Courtesy(device="cpu", offload=tmp_path):
        flat = x.T.reshape(-1)  # a copy on real data, although a placeholder could view it
        model.weight.data = torch.ones(4, 6)
        assert type(model.weight) is nn.Parameter and type(model.bias) is ParkedParameter
        with torch.no_grad():
            torch.Tensor.set_(model.bias, torch.full((4,), 2.0))  # PyTorch asks no __torch_function__
    assert flat.untyped_storage() is not x.untyped_storage() and torch.isnan(flat).all()
    assert x.tolist() == torch.arange(24.0).reshape(4, 6).tolist()
    assert type(model.weight) is nn.Parameter and model.weight.eq(1).all()
    assert type(model.bias) is nn.Parameter and model.bias.eq(2).all()


def test_an_alias_made_out_of_sight_holds_its_storage_back_until_deleted(tmp_path: Path):
    x = torch.arange(24.0).reshape(4, 6)
    kept = torch.full((50,), 3.0)
    data = _raw(x)
    gc.collect()
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    path = _file_holding(workdir, data)
    hidden = x.as_subclass(torch.Tensor)  # PyTorch makes it without asking __torch_function__
    with pytest.raises(RuntimeError) as raised:
        courtesy.restore()
    assert type(raised.value) is RuntimeError and str(raised.value) == (
        "Courtesy.restore() could not bring back 1 storage; its tensors stay parked (placeholders that "
        "read NaN or 0) and everything else is restored. Fix the cause (put the file back, free memory) "
        f"and call restore() again: {path} (96 B, tensors float32 [24], float32 [4, 6], float32 [4, 6]): "
        "tensor float32 [4, 6] over its placeholder was made out of Courtesy's sight (not by a torch "
        "function: as_subclass, C++), so where it should go is unknown; delete it and call restore() again"
    )
    assert kept.eq(3.0).all() and torch.isnan(x).all() and courtesy.yielded_bytes == 96
    del hidden
    assert courtesy.restore() == 96 and _raw(x) == data


def test_inference_tensors_stay_inference_tensors_and_work_after_restore(tmp_path: Path):
    with torch.inference_mode():
        made = torch.arange(10.0)
        view = made[2:5]
    with Courtesy(device="cpu", offload=tmp_path):
        assert made.is_inference() and type(made) is ParkedTensor
        inside = made[1:3]
    for tensor in (made, view, inside):
        assert tensor.is_inference() and tensor.untyped_storage() is made.untyped_storage()
    assert (made + 1).tolist() == [float(i + 1) for i in range(10)]
    assert view.tolist() == [2.0, 3.0, 4.0] and inside.tolist() == [1.0, 2.0]
    with torch.inference_mode():
        made.add_(1)
    assert view.tolist() == [3.0, 4.0, 5.0]


def _every_dtype() -> dict[torch.dtype, torch.Tensor]:
    """A 4-element tensor of every dtype ``torch`` names that ``torch.empty`` can make, its bytes
    set to distinct values (quantized ones as they come)."""
    made = {}
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32 is experimental, quantized deprecated
                tensor = torch.empty(4, dtype=dtype)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        if not tensor.is_quantized:
            raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
            raw.copy_(torch.arange(raw.numel(), dtype=torch.uint8) * 7 + len(made))
        made[dtype] = tensor
    return made


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).tolist())


def test_every_dtype_is_parked_and_restored_byte_for_byte_or_named_and_left(tmp_path: Path):
    made = _every_dtype()
    assert {torch.float4_e2m1fn_x2, torch.bits8, torch.uint1, torch.int7, torch.float8_e8m0fnu} <= set(made)
    before = {dtype: _storage_bytes(tensor) for dtype, tensor in made.items()}
    storages = {dtype: tensor.untyped_storage() for dtype, tensor in made.items()}
    quantized = sorted((t for t in made.values() if t.is_quantized), key=lambda t: str(t.dtype))
    assert [t.dtype for t in quantized] == [
        torch.qint32,
        torch.qint8,
        torch.quint2x4,
        torch.quint4x2,
        torch.quint8,
    ]
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    with pytest.warns(UserWarning) as warned:
        courtesy.yield_memory()
    messages = [str(w.message) for w in warned if "quantized" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("Courtesy left ")
    assert "(it cannot re-point a quantized tensor at a copy): tensors " in messages[0]
    assert all(f"{str(t.dtype).removeprefix('torch.')} [4]" in messages[0] for t in quantized)
    for dtype, tensor in made.items():
        parked = tensor.untyped_storage() is not storages[dtype]
        assert parked is not tensor.is_quantized and tensor.dtype is dtype and tensor.shape == (4,)
    courtesy.restore()
    for dtype, tensor in made.items():
        assert tensor.dtype is dtype and _storage_bytes(tensor) == before[dtype], dtype
        assert (tensor.untyped_storage() is storages[dtype]) is tensor.is_quantized


def test_host_copies_carry_writes_shape_changes_and_views_back(tmp_path: Path):
    weight = torch.arange(24.0).reshape(4, 6)
    counts = torch.zeros(4, dtype=torch.int64)
    flat = torch.ones(6)
    storages = [t.untyped_storage() for t in (weight, counts, flat)]
    gc.collect()
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    courtesy.offload = "cpu"  # the path a GPU takes (to host memory), here from host memory to host memory
    courtesy.yield_memory()
    assert all(t.untyped_storage() is not s for t, s in zip((weight, counts, flat), storages, strict=True))
    assert list(tmp_path.iterdir()) == [] and type(weight) is torch.Tensor  # real tensors, no files
    row, transposed = weight[1], weight.T
    weight.add_(1)
    counts.resize_(8).fill_(3)  # grows its host copy
    flat.unsqueeze_(0)
    courtesy.restore()
    assert row.untyped_storage() is weight.untyped_storage() is transposed.untyped_storage()
    assert row.tolist() == [7.0, 8.0, 9.0, 10.0, 11.0, 12.0] and transposed.stride() == (1, 6)
    assert counts.tolist() == [3] * 8 and flat.shape == (1, 6) and flat.eq(1).all()
    assert all(t.untyped_storage() is not s for t, s in zip((weight, counts, flat), storages, strict=True))


@pytest.mark.cuda
def test_cuda_views_of_host_copies_and_inference_tensors_come_back_to_the_gpu():
    weight = torch.arange(24.0, device="cuda").reshape(4, 6)
    with torch.inference_mode():
        frozen = torch.arange(5.0, device="cuda")
    with Courtesy(device="cuda", offload="cpu"):
        row, detached = weight[1], weight.detach()
        assert row.device.type == "cpu" and frozen.is_inference()
        weight.add_(1)
    for tensor in (weight, row, detached, frozen):
        assert tensor.device.type == "cuda"
    assert row.untyped_storage() is weight.untyped_storage() is detached.untyped_storage()
    assert row.tolist() == [7.0, 8.0, 9.0, 10.0, 11.0, 12.0] and frozen.is_inference()
    assert (frozen + 1).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.cuda
def test_cuda_views_taken_of_placeholders_come_back_to_the_gpu(tmp_path: Path):
    weight = torch.arange(24.0, device="cuda").reshape(4, 6)
    with Courtesy(device="cuda", offload=tmp_path):
        row, transposed, raw = weight[1], weight.T, weight.view(torch.uint8)
        assert type(row) is ParkedTensor and torch.cuda.memory_allocated() == 0
    assert row.device.type == "cuda" and row.untyped_storage() is weight.untyped_storage()
    assert row.tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0] and transposed.stride() == (1, 6)
    assert raw.shape == (4, 24) and raw.untyped_storage() is weight.untyped_storage()


def test_what_needs_the_data_pointer_of_a_parked_tensor_says_it_is_parked(tmp_path: Path):
    weight = torch.full((2, 3), 4.0)
    with Courtesy(device="cpu", offload=tmp_path):
        for how, op in {"numpy": weight.numpy, "data_ptr": weight.data_ptr}.items():
            with pytest.raises(ParkedTensorError) as raised:
                op()
            assert str(raised.value) == (
                f"tensor float32 [2, 3] is parked by memlab.Courtesy until restore(): {how} needs its data "
                "pointer, which a placeholder does not hand out; call restore() first"
            )
        assert torch.isnan(weight).all() and type(weight) is ParkedTensor
    assert weight.clone().numpy().tolist() == [[4.0] * 3] * 2  # of a clone: .numpy() shares for good


def test_a_backward_pass_into_parked_gradients_raises_and_changes_nothing(tmp_path: Path):
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, torch.randn(16, 32))
    before = _state(model, optimizer)
    with Courtesy(device="cpu", offload=tmp_path):
        loss = model(torch.randn(2, 32)).sum()
        with pytest.raises(ParkedTensorError) as raised:
            loss.backward()
        assert str(raised.value) == _parked_message(model[2].bias.grad, "backward (accumulating into .grad)")
        assert all(len(p._backward_hooks) == 1 for p in model.parameters())
    after = _state(model, optimizer)
    assert all(_bit_identical(after[name], before[name]) for name in before)
    assert all(len(p._backward_hooks) == 0 for p in model.parameters())  # the guard's hooks are gone
    _train_step(model, optimizer, torch.randn(16, 32))


def test_ctrl_c_between_parking_a_tensor_and_guarding_it_puts_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from memlab import _parked_guard

    tensors = [torch.full((120 + i,), float(i)) for i in range(4)]
    storages = [t.untyped_storage() for t in tensors]
    calls: list[torch.Tensor] = []
    real = _parked_guard.follow

    def follow(parking: Any, tensor: torch.Tensor, view: Any) -> None:
        calls.append(tensor)
        if len(calls) == 3:  # the tensor sits on its placeholder, not yet remembered or guarded
            raise KeyboardInterrupt
        real(parking, tensor, view)

    monkeypatch.setattr(_parked_guard, "follow", follow)
    courtesy = Courtesy(device="cpu", offload=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        courtesy.yield_memory()
    assert len(calls) == 3 and list(tmp_path.iterdir()) == [] and courtesy.yielded_bytes == 0
    for tensor in calls:  # the third one above all: it was on its placeholder when Ctrl-C came
        assert tensor.untyped_storage().data_ptr() and type(tensor) in (torch.Tensor, nn.Parameter)
    for i, (tensor, storage) in enumerate(zip(tensors, storages, strict=True)):
        assert tensor.untyped_storage() is storage and type(tensor) is torch.Tensor
        assert tensor.eq(float(i)).all()
