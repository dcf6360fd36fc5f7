"""cuBLAS/cuBLASLt workspaces: the sizes PyTorch's CublasHandlePool.cpp gives, allocated where it does.

Sizes follow ``aten/src/ATen/cuda/CublasHandlePool.cpp`` of torch 2.13: ``parseChosenWorkspaceSize``
(``:4096:8`` = 32 MiB on sm90/sm100/sm120, else ``:4096:2:16:8`` = 8,519,680 B; every ``:SIZE:COUNT``
of ``CUBLAS_WORKSPACE_CONFIG`` adds SIZE KiB x COUNT), ``parseCUDABlasLtWorkspaceSize`` and
``unified_cublas_and_lt_workspaces``; a workspace is allocated per (handle, stream), a handle per
thread and device (``DeviceThreadHandlePool::reserve``). Under torch 2.8 (its ``libtorch_cuda.so``,
see memlab.sources.workspaces): 32 MiB on sm90 only, cuBLASLt unified only with
``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``, and its own workspace (1 MiB) allocated for each call.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import memlab
from memlab._gpus import GPUS, resolve_gpu
from memlab._torch_version import torch_at_least
from memlab.sources import workspaces
from memlab.sources.workspaces import (
    cublas_workspace_size,
    cublaslt_workspace_size,
    default_cublas_workspace_size,
    unified_workspaces,
    workspace_sizes,
)

MiB = 2**20
H100_WORKSPACE = 4096 * 8 * 1024  # :4096:8
A100_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8  # :4096:2:16:8
TORCH_2_8 = not torch_at_least(2, 9)  # torch 2.8's CublasHandlePool.cpp / CUDABlas.cpp
ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in (*ENV, "DISABLE_ADDMM_CUDA_LT"):
        monkeypatch.delenv(name, raising=False)


# -- sizes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gpu", "size"),
    [
        ("H100", H100_WORKSPACE),  # torch 2.8: 32 MiB on sm90 only
        ("B200", A100_WORKSPACE if TORCH_2_8 else H100_WORKSPACE),
        ("sm120", A100_WORKSPACE if TORCH_2_8 else H100_WORKSPACE),
        ("A100", 8_519_680),
        ("L4", 8_519_680),
        ("V100", 8_519_680),
        ("T4", 8_519_680),
    ],
)
def test_the_default_workspace_is_32_mib_on_hopper_and_blackwell_else_4096_2_16_8(gpu, size):
    assert default_cublas_workspace_size(resolve_gpu(gpu)) == size
    assert A100_WORKSPACE == 8_519_680


@pytest.mark.parametrize(
    ("config", "size"),
    [
        (":4096:2", 8_388_608),
        (":4096:8", 33_554_432),
        (":4096:2:16:8", 8_519_680),
        (":4096:2:16", 8_388_608),  # the trailing :16 has no count: not a match
        (":16:8", 131_072),
        ("x:16:8y:4096:1", 131_072 + 4_194_304),  # matches anywhere, as std::sregex_iterator finds them
        (":0:0", 0),
        (":007:2", 14_336),
    ],
)
def test_cublas_workspace_config_is_read_as_pytorchs_regex_reads_it(config, size):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cublas_workspace_size(GPUS["H100"], config) == size


@pytest.mark.parametrize("config", ["", "4096:8", ":4096", ":-1:8", "4096"])
def test_a_config_without_size_count_pairs_warns_and_keeps_the_default(config):
    with pytest.warns(UserWarning) as caught:
        assert cublas_workspace_size(GPUS["A100"], config) == A100_WORKSPACE
    assert [str(w.message) for w in caught] == [
        "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of 8519680 bytes."
    ]


def test_a_number_beyond_64_bits_is_a_value_error_naming_the_variable():
    with pytest.raises(ValueError) as raised:
        cublas_workspace_size(GPUS["H100"], ":18446744073709551616:1")
    assert str(raised.value) == (
        "CUBLAS_WORKSPACE_CONFIG=':18446744073709551616:1': 18446744073709551616 does not fit in 64 bits, "
        "so PyTorch's parser fails at the first matmul; valid: ':SIZE:COUNT' pairs, SIZE in KiB "
        "(':4096:8' is 32 MiB)"
    )
    assert cublas_workspace_size(GPUS["H100"], ":18446744073709551615:1") == 2**64 - 1024  # size_t wraps


def test_unified_workspaces_reads_0_and_1_and_unset_gives_the_releases_default():
    assert unified_workspaces(None, default=True) is True
    assert unified_workspaces(None, default=False) is False
    assert unified_workspaces("1", default=False) is True
    assert unified_workspaces("0", default=True) is False
    with pytest.warns(UserWarning) as caught:
        assert unified_workspaces("false", default=True) is True
        assert unified_workspaces("false", default=False) is False
    assert str(caught[0].message) == (
        "Ignoring invalid value for boolean flag TORCH_CUBLASLT_UNIFIED_WORKSPACE: false"
        "valid values are 0 or 1."
    )


def test_cublaslt_shares_the_cublas_workspace_by_default_from_torch_2_12_on():
    # torch 2.11.0's getCUDABlasLtWorkspace reads the flag as value_or(false) (its libtorch_cuda.so,
    # and an H100 run: a separate 1 MiB workspace per handle); 2.12 made it value_or(true)
    assert workspaces.UNIFIED_BY_DEFAULT_SINCE == (2, 12)
    assert unified_workspaces(None) is torch_at_least(2, 12)


def test_cublaslt_workspace_size_is_kib_read_by_stoi_capped_by_the_cublas_one_when_unified():
    def lt(value, unified):
        return cublaslt_workspace_size(
            value, unified=unified, cublas=A100_WORKSPACE, chosen_default=A100_WORKSPACE
        )

    assert lt(None, unified=True) == (MiB if TORCH_2_8 else A100_WORKSPACE)  # 2.8: 1 MiB default
    assert lt(None, unified=False) == MiB
    assert lt(" +512kib", unified=False) == 512 * 1024
    assert lt("65536", unified=False) == 64 * MiB
    assert lt("65536", unified=True) == A100_WORKSPACE
    assert lt("-1", unified=False) == 2**64 - 1024
    with pytest.warns(UserWarning) as caught:
        assert lt("big", unified=False) == MiB
        assert lt("2147483648", unified=False) == MiB
    invalid = "invalid CUBLASLT_WORKSPACE_SIZE" if TORCH_2_8 else "CUBLASLT_WORKSPACE_SIZE invalid"
    assert [str(w.message) for w in caught] == [
        f"{invalid}, using default workspace size of 1024 KiB.",
        "CUBLASLT_WORKSPACE_SIZE out of range, using default workspace size of 1024 KiB.",
    ]


def test_workspace_sizes_reads_the_three_variables_from_the_environment():
    environ = {"CUBLAS_WORKSPACE_CONFIG": ":4096:2", "CUBLASLT_WORKSPACE_SIZE": "256"}
    sizes = workspaces.WorkspaceSizes
    unified = torch_at_least(2, 12)
    assert workspace_sizes(GPUS["H100"], environ) == sizes(8_388_608, 256 * 1024, unified)
    environ["TORCH_CUBLASLT_UNIFIED_WORKSPACE"] = "0"
    assert workspace_sizes(GPUS["H100"], environ) == sizes(8_388_608, 256 * 1024, False)
    environ["TORCH_CUBLASLT_UNIFIED_WORKSPACE"] = "1"
    assert workspace_sizes(GPUS["H100"], environ) == sizes(8_388_608, 256 * 1024, True)


def as_if(monkeypatch, release: tuple[int, int]) -> None:
    """Make memlab.sources.workspaces read the rules of torch ``release`` whatever torch is installed."""
    monkeypatch.setattr(workspaces, "torch_at_least", lambda *version: version <= release)
    monkeypatch.setattr(workspaces, "_LT_PER_CALL", release < (2, 9))


def test_from_torch_2_12_cublaslt_defaults_to_the_cublas_size_and_shares_it(monkeypatch):
    as_if(monkeypatch, (2, 12))
    sizes = workspaces.WorkspaceSizes
    assert workspace_sizes(GPUS["A100"], {}) == sizes(A100_WORKSPACE, A100_WORKSPACE, True)
    assert workspace_sizes(GPUS["H100"], {}) == sizes(H100_WORKSPACE, H100_WORKSPACE, True)
    no_lt = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert workspace_sizes(GPUS["H100"], no_lt) == sizes(H100_WORKSPACE, MiB, False)


def test_on_torch_2_11_cublaslt_has_its_own_1_mib_capped_by_cublas_unless_the_flag_is_0(monkeypatch):
    as_if(monkeypatch, (2, 11))
    sizes = workspaces.WorkspaceSizes
    assert workspace_sizes(GPUS["A100"], {}) == sizes(A100_WORKSPACE, MiB, False)
    assert workspace_sizes(GPUS["H100"], {}) == sizes(H100_WORKSPACE, MiB, False)
    # getCUDABlasLtWorkspaceSize caps it by the cuBLAS workspace unless the flag is "0"
    small = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert workspace_sizes(GPUS["H100"], small) == sizes(131_072, 131_072, False)
    small["TORCH_CUBLASLT_UNIFIED_WORKSPACE"] = "0"
    assert workspace_sizes(GPUS["H100"], small) == sizes(131_072, 4 * MiB, False)
    assert workspace_sizes(GPUS["H100"], {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}) == sizes(0, 0, False)


def test_on_torch_2_8_cublaslt_has_1_mib_per_call_not_capped_and_shares_only_with_the_flag_1(monkeypatch):
    as_if(monkeypatch, (2, 8))
    sizes = workspaces.WorkspaceSizes
    assert workspace_sizes(GPUS["H100"], {}) == sizes(H100_WORKSPACE, MiB, False)
    small = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert workspace_sizes(GPUS["H100"], small) == sizes(131_072, 4 * MiB, False)
    # CUBLAS_WORKSPACE_CONFIG=:0:0 alone leaves cuBLASLt's 1 MiB per call (its CUDABlas.cpp)
    assert workspace_sizes(GPUS["H100"], {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}) == sizes(0, MiB, False)
    shared = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}
    assert workspace_sizes(GPUS["H100"], shared) == sizes(H100_WORKSPACE, MiB, True)  # 1 MiB of it


# -- where a tracker allocates them -------------------------------------------------------------------
def linear_forward(tracker: memlab.TensorTracker, *shapes: tuple[int, int]) -> list[torch.Tensor]:
    outputs = []
    for rows, features in shapes:
        layer = torch.nn.Linear(features, features, bias=False)
        x = torch.randn(rows, features)
        with tracker:
            outputs.append(layer(x))
    return outputs


def test_the_first_matmul_allocates_the_modelled_gpus_workspace_once():
    tracker = memlab.TensorTracker(gpu="A100", history=True)
    kept = linear_forward(tracker, (64, 1024), (8, 256))  # two matmuls, one thread, one stream
    stats = tracker.memory_stats()
    assert stats["allocation.all.allocated"] == 3  # two outputs, one workspace
    assert stats["allocated_bytes.all.current"] == 64 * 1024 * 4 + 8 * 256 * 4 + A100_WORKSPACE
    assert tracker.by_category()["workspace"] == A100_WORKSPACE
    assert len(tracker.workspaces.keys) == 1
    del kept


def test_the_workspace_is_allocated_after_the_matmuls_output():
    tracker = memlab.TensorTracker(gpu="H100", history=True)
    _kept = linear_forward(tracker, (64, 1024))
    allocs = [e for e in tracker.snapshot()["device_traces"][0] if e["action"] == "alloc"]
    assert [(e["size"], e["category"]) for e in allocs] == [
        (262_144, "unknown"),
        (H100_WORKSPACE, "workspace"),
    ]


def test_an_h100_and_an_a100_differ_by_their_workspaces():
    h100, a100 = memlab.TensorTracker(gpu="H100"), memlab.TensorTracker(gpu="sm80")
    _h, _a = linear_forward(h100, (64, 1024)), linear_forward(a100, (64, 1024))
    assert h100.max_memory_allocated() - a100.max_memory_allocated() == H100_WORKSPACE - A100_WORKSPACE
    # 32 MiB is a segment of its own; 8,519,680 B (< 10 MiB) takes a 20 MiB one
    assert h100.max_memory_reserved() == 2 * MiB + 32 * MiB
    assert a100.max_memory_reserved() == 2 * MiB + 20 * MiB


def test_cublas_workspace_config_sets_the_size(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    tracker = memlab.TensorTracker(gpu="H100", history=True)
    _kept = linear_forward(tracker, (64, 1024))
    assert tracker.by_category()["workspace"] == 4096 * 1024 * 2


def test_a_run_without_a_matmul_allocates_no_workspace():
    with memlab.TensorTracker(history=True) as tracker:
        x = torch.randn(64, 1024)
        y = (x.relu() * 2).sum(0).softmax(0)
    assert tracker.by_category()["workspace"] == 0
    assert tracker.memory_stats()["allocation.all.allocated"] == 5
    del x, y


def test_a_matmul_with_an_empty_operand_returns_before_taking_a_handle():
    with memlab.TensorTracker(history=True) as tracker:
        a = torch.randn(0, 16) @ torch.randn(16, 8)  # empty result
        b = torch.randn(4, 0) @ torch.randn(0, 8)  # empty reduction dimension: zeros, no cuBLAS
        c = torch.randn(0, 16) @ torch.randn(16)  # mv of an empty matrix
    assert tracker.workspaces.keys == []
    d = torch.randn(0)
    with tracker:
        e = torch.dot(d, d)  # dot_cuda calls cuBLAS even for empty vectors
    assert len(tracker.workspaces.keys) == 1
    del a, b, c, e


@pytest.mark.parametrize(
    "op",
    [
        lambda: torch.randn(2, 3, 4) @ torch.randn(2, 4, 5),  # bmm
        lambda: torch.einsum("bij,bjk->bik", torch.randn(2, 3, 4), torch.randn(2, 4, 5)),
        lambda: torch.randn(3, 4) @ torch.randn(4),  # mv
        lambda: torch.randn(4) @ torch.randn(4),  # dot
        lambda: torch.baddbmm(torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5)),
        lambda: torch.addmv(torch.randn(3), torch.randn(3, 4), torch.randn(4)),
        lambda: torch.nn.functional.bilinear(torch.randn(2, 3), torch.randn(2, 4), torch.randn(5, 3, 4)),
        lambda: torch.cdist(torch.randn(30, 4), torch.randn(40, 4)),  # _euclidean_dist
        lambda: torch.linalg.solve_triangular(torch.eye(3), torch.randn(3, 2), upper=True),
    ],
)
def test_every_op_that_takes_a_cublas_handle_allocates_the_workspace(op):
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        result = op()
    assert tracker.by_category()["workspace"] == A100_WORKSPACE
    del result


def test_backward_runs_on_the_autograd_threads_own_handle_and_gets_its_own_workspace():
    layer = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256)
    with memlab.TensorTracker(gpu="A100", history=True, model=layer) as tracker:
        layer(x).sum().backward()
        layer(x).sum().backward()  # the second step reuses both
    assert [key[3] for key in tracker.workspaces.keys][1] == "autograd"
    assert tracker.by_category()["workspace"] == 2 * A100_WORKSPACE
    # both fit in one 20 MiB segment: 2 x 8,519,680 B < 20 MiB
    assert tracker.memory_stats()["segment.large_pool.current"] == 1


def test_another_thread_has_its_own_handle_and_workspace():
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        kept = [torch.randn(4, 4) @ torch.randn(4, 4)]
        worker = threading.Thread(target=lambda: kept.append(torch.randn(4, 4) @ torch.randn(4, 4)))
        worker.start()
        worker.join()
    assert len(kept) == 2
    assert tracker.by_category()["workspace"] == 2 * A100_WORKSPACE


def test_a_second_stream_gets_its_own_workspace(monkeypatch):
    stream = 0
    monkeypatch.setattr(workspaces, "_stream", lambda device: stream)  # a CPU run has one stream
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        a = torch.randn(4, 4) @ torch.randn(4, 4)
        stream = 7  # as inside torch.cuda.stream(other) on a GPU
        b = torch.randn(4, 4) @ torch.randn(4, 4)
        c = torch.randn(4, 4) @ torch.randn(4, 4)
        stream = 0
        d = torch.randn(4, 4) @ torch.randn(4, 4)
    assert [key[2] for key in tracker.workspaces.keys] == [0, 7]
    assert tracker.by_category()["workspace"] == 2 * A100_WORKSPACE
    del a, b, c, d


def test_each_device_has_its_own_workspaces():
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        on_cpu = torch.randn(4, 4) @ torch.randn(4, 4)
        on_meta = torch.randn(4, 4, device="meta") @ torch.randn(4, 4, device="meta")
    assert tracker.by_category("cpu")["workspace"] == A100_WORKSPACE
    assert tracker.by_category("meta")["workspace"] == A100_WORKSPACE
    del on_cpu, on_meta


def test_empty_cache_keeps_the_workspace_it_is_allocated_not_cached():
    with memlab.TensorTracker(gpu="H100", history=True) as tracker:
        y = torch.randn(64, 64) @ torch.randn(64, 64)
    del y
    tracker.empty_cache()
    stats = tracker.memory_stats()
    assert (stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]) == (32 * MiB, 32 * MiB)
    assert tracker.by_category() == {**dict.fromkeys(tracker.by_category(), 0), "workspace": 32 * MiB}


def test_the_snapshot_shows_the_workspace_as_an_active_block_with_its_line():
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        y = torch.randn(8, 8) @ torch.randn(8, 8)
    (block,) = [b for s in tracker.snapshot()["segments"] for b in s["blocks"] if b["size"] == A100_WORKSPACE]
    assert block["state"] == "active_allocated"
    assert block["category"] == "workspace"
    assert (
        block["frames"][0]["name"]
        == test_the_snapshot_shows_the_workspace_as_an_active_block_with_its_line.__name__
    )
    del y


def test_with_unified_workspaces_off_cublaslt_allocates_its_own(monkeypatch):
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "2048")
    layer = torch.nn.Linear(16, 16)  # a bias addmm CUDA runs through cuBLASLt (gemm_and_bias)
    x = torch.randn(8, 16)
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        y = layer(x)
        if TORCH_2_8:  # the handle's cuBLAS workspace; cuBLASLt's own only while the call runs
            assert tracker.by_category()["workspace"] == A100_WORKSPACE
            assert tracker.memory_stats()["allocated_bytes.all.peak"] == 512 + A100_WORKSPACE + 2 * MiB
        else:  # its handle is the cuBLAS handle, with the cuBLAS workspace; then cuBLASLt's own
            assert tracker.by_category()["workspace"] == A100_WORKSPACE + 2 * MiB
        z = x @ layer.weight  # mm: cuBLAS, whose workspace this thread has
    assert tracker.by_category()["workspace"] == A100_WORKSPACE + (0 if TORCH_2_8 else 2 * MiB)
    assert [key[0] for key in tracker.workspaces.keys] == (
        ["cublas"] if TORCH_2_8 else ["cublas", "cublaslt"]
    )
    del y, z


def test_with_unified_workspaces_cublaslt_allocates_and_shares_the_cublas_workspace(monkeypatch):
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    with memlab.TensorTracker(gpu="A100", history=True) as tracker:
        y = layer(x)
        z = x @ layer.weight
    assert tracker.by_category()["workspace"] == A100_WORKSPACE
    del y, z


def test_a_bias_linear_on_the_default_environment_takes_the_releases_workspaces():
    # measured on an H100 with torch 2.11.0 (benchmarks/gpu_fidelity.py, mlp): the first Linear
    # with bias (addmm through cuBLASLt) allocates the 32 MiB cuBLAS workspace of its handle and a
    # 1,048,576 B cuBLASLt workspace of its own; from 2.12 on cuBLASLt shares the cuBLAS one
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    # (torch 2.8: cuBLASLt's 1 MiB only while each call runs)
    lt = MiB if torch_at_least(2, 9) and not torch_at_least(2, 12) else 0
    with memlab.TensorTracker(gpu="H100", history=True) as tracker:
        y = layer(x)
        assert tracker.by_category()["workspace"] == H100_WORKSPACE + lt
        z = x @ layer.weight
    assert tracker.by_category()["workspace"] == H100_WORKSPACE + lt
    assert [key[0] for key in tracker.workspaces.keys] == (["cublas", "cublaslt"] if lt else ["cublas"])
    del y, z


def test_a_cublaslt_workspace_of_0_bytes_allocates_nothing(monkeypatch):
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")
    layer = torch.nn.Linear(16, 16)
    with memlab.TensorTracker(gpu="H100") as tracker:
        y = layer(torch.randn(8, 16))
    # the input and output, and the cuBLAS workspace of the handle cuBLASLt runs on
    assert tracker.memory_stats()["allocated_bytes.all.current"] == 1024 + H100_WORKSPACE
    del y


def test_an_addmm_whose_bias_cannot_be_fused_or_lt_disabled_runs_cublas(monkeypatch):
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    with memlab.TensorTracker(gpu="A100") as tracker:
        y = torch.addmm(torch.randn(8, 16), x, w)  # a 2-D bias without an activation
    assert [key[0] for key in tracker.workspaces.keys] == ["cublas"]
    monkeypatch.setenv("DISABLE_ADDMM_CUDA_LT", "1")
    with memlab.TensorTracker(gpu="A100") as tracker:
        z = torch.addmm(torch.randn(16), x, w)
    assert [key[0] for key in tracker.workspaces.keys] == ["cublas"]
    del y, z


def test_the_workspace_can_run_the_modelled_gpu_out_of_memory():
    tracker = memlab.TensorTracker(gpu="H100", capacity="16 MiB")
    with tracker, pytest.raises(torch.OutOfMemoryError):
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert tracker.memory_stats()["num_ooms"] == 1


def test_exact_bytes_model_no_gpu_and_take_no_gpu():
    with memlab.TensorTracker(allocator=None) as tracker:
        y = torch.randn(8, 8) @ torch.randn(8, 8)
    assert (tracker.gpu, tracker.workspaces) == (None, None)
    assert tracker.memory_allocated() == 256
    with pytest.raises(ValueError, match=r"^gpu='A100' needs allocator='cuda': allocator=None models no GPU"):
        memlab.TensorTracker(allocator=None, gpu="A100")
    with pytest.raises(ValueError, match=r"^gpu 'Z80' is not a GPU memlab knows"):
        memlab.TensorTracker(gpu="Z80")
    del y


def test_the_tracker_names_the_gpu_it_models():
    assert memlab.TensorTracker().gpu is GPUS["H100"]
    assert memlab.TensorTracker(gpu=(8, 9)).gpu is GPUS["L4"]


@pytest.mark.cuda
def test_a_tracker_on_a_real_gpu_allocates_no_workspace_the_gpus_allocator_holds_it():
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    with memlab.TensorTracker(history=True) as tracker:
        c = a @ b
    assert tracker.by_category("cuda")["workspace"] == 0
    assert tracker.workspaces.keys == []
    del c


# -- grad modes: the GPU's first matmul takes the workspace whatever the mode ---------------------------
def mlp_forward_peak(mode: type) -> tuple[int, int, int]:
    """Peak and current allocated bytes, and the workspace bytes, of a two-Linear forward under
    ``mode()`` (``torch.no_grad`` or ``torch.inference_mode``), tracked on an H100 model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with mode(), memlab.TensorTracker(gpu="H100", history=True) as tracker:
        out = model(x)
    stats = tracker.memory_stats()
    assert out.shape == (32, 64)
    workspace = tracker.by_category()["workspace"]
    return stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"], workspace


def test_inference_mode_takes_the_workspace_as_no_grad_does():
    # Under inference mode aten.linear reaches the tracker whole (autograd, which decomposes it into
    # t and addmm, is skipped); the tracker decomposes it and sees the addmm that takes the handle.
    # Peak: the first Linear's output (32x256 float32 = 32,768 B), the workspace, and ReLU's output.
    # The bias addmm runs through cuBLASLt: the cuBLAS workspace it shares from torch 2.12 on; on
    # 2.9-2.11 the cuBLAS workspace of its handle and 1 MiB of its own; on 2.8 the cuBLAS workspace,
    # and at the second Linear's cuBLASLt call, with ReLU's output, its own output (32x64 float32 =
    # 8,192 B) and the 1 MiB cuBLASLt workspace of the call.
    own = MiB if torch_at_least(2, 9) and not torch_at_least(2, 12) else 0
    workspace = H100_WORKSPACE + own
    expected = 32_768 + workspace + (8_192 + MiB if TORCH_2_8 else 32_768)
    assert mlp_forward_peak(torch.no_grad) == (expected, 8_192 + workspace, workspace)
    assert mlp_forward_peak(torch.inference_mode) == (expected, 8_192 + workspace, workspace)
