"""cuBLAS and cuBLASLt workspaces: the memory PyTorch takes from the caching allocator at a matmul.

On a GPU, the first op that takes a cuBLAS handle (a matmul, ``dot``, a triangular solve) on a
(handle, stream) pair allocates that pair's workspace through the CUDA caching allocator, and keeps
it for the life of the process: ``torch.cuda.empty_cache()`` does not return it (it is allocated,
not cached). A handle belongs to one thread and device (``DeviceThreadHandlePool::reserve``), so the
autograd engine's device thread, which runs backward on a GPU, gets its own. The rules and sizes
follow PyTorch's ``aten/src/ATen/cuda/CublasHandlePool.cpp`` in the version that ships with torch
2.13 (the one whose ``WorkspaceMapWithMutex`` maps ``(handle, stream)`` to ``(workspace, size)``,
with ``set/resetChosenWorkspaceSize``, as ``ATen/cuda/CUDAContextLight.h`` of the installed torch
declares): :func:`workspace_sizes` reads ``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE``
and ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` as that file does in the installed torch (whether cuBLASLt
shares the cuBLAS workspace by default changed in 2.12: :data:`UNIFIED_BY_DEFAULT_SINCE`), and
:class:`CublasWorkspaces` decides, op by op, which workspace an op needs and whether it exists yet.

A tracker that models a GPU for tensors that are not on one (a CPU or ``meta`` run, or an estimate's
fake tensors) allocates these workspaces in its allocator model; on a real GPU the real allocator
holds them and the tracker does not invent them.

Under torch 2.8 (read from its ``libtorch_cuda.so``: 2.8 has no ``getCUDABlasLtWorkspace`` nor
``cublaslt_handle_stream_to_workspace``; ``CUDABlas.cpp``'s ``CublasLtWorkspace``): cuBLASLt has no
workspace per handle. Each cuBLASLt call allocates its own (1 MiB unless ``CUBLASLT_WORKSPACE_SIZE``)
through the caching allocator and frees it when the call returns; only
``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it use the cuBLAS workspace (``check_env(...) == true``:
unset is not unified). Its handle is the cuBLAS handle (``getCurrentCUDABlasLtHandle`` calls
``getCurrentCUDABlasHandle``, which gives the (handle, stream) its cuBLAS workspace), and the default
cuBLAS workspace is 32 MiB on sm90 only (``parseChosenWorkspaceSize``: ``major == 9 && minor == 0``).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memlab._gpus import GPU
from memlab._tensors import storages_of
from memlab._torch_version import torch_at_least

__all__ = [
    "BLAS_OPS",
    "CONVOLUTION_OPS",
    "CUBLASLT_OPS",
    "UNIFIED_BY_DEFAULT_SINCE",
    "CublasWorkspaces",
    "WorkspaceSizes",
    "cublas_workspace_size",
    "cublaslt_workspace_size",
    "default_cublas_workspace_size",
    "keeps_own_cublaslt",
    "unified_workspaces",
    "workspace_ops",
    "workspace_sizes",
]

_KiB = 1024
_SIZE_T = 2**64  # size_t arithmetic wraps modulo 2**64
_INT_MAX = 2**31 - 1

#: The aten ops (overload packets, as a ``TorchDispatchMode`` sees them) whose CUDA kernels take a
#: cuBLAS handle, and so the workspace of its (handle, stream): from
#: ``aten/src/ATen/native/cuda/Blas.cpp`` (``addmm_out_cuda_impl`` for ``mm``, ``addmm`` and
#: ``_addmm_activation``; ``baddbmm_out_cuda_impl`` for ``bmm``, ``baddbmm`` and ``addbmm``;
#: ``addmv_out_cuda`` for ``addmv`` and ``mv``; ``dot_cuda``, ``vdot_cuda``; ``_int_mm_out_cuda``;
#: ``_scaled_mm_out_cuda``), ``aten/src/ATen/native/cuda/linalg/BatchLinearAlgebraLib.cpp``
#: (``triangular_solve`` and ``linalg_solve_triangular``: cuBLAS ``trsm``), and the composite ops a
#: dispatch mode sees whole whose CUDA kernels call those (``_trilinear`` of ``F.bilinear``,
#: ``_euclidean_dist`` of ``torch.cdist``, the transformer fast paths). ``linear``, ``matmul``,
#: ``einsum`` and ``tensordot`` reach the dispatcher as these. Linear algebra that PyTorch sends to
#: cuBLAS only by a size heuristic (batched LU, QR, least squares) is not listed; grouped matmuls
#: run CUTLASS kernels.
BLAS_OPS = (
    "mm",
    "addmm",
    "_addmm_activation",
    "bmm",
    "baddbmm",
    "addbmm",
    "addmv",
    "mv",
    "dot",
    "vdot",
    "_int_mm",
    "_scaled_mm",
    "_scaled_mm_v2",
    "triangular_solve",
    "linalg_solve_triangular",
    "_trilinear",
    "_euclidean_dist",
    "_native_multi_head_attention",
    "_transformer_encoder_layer_fwd",
)
#: Those whose CUDA kernel always runs through cuBLASLt (``at::cuda::blas::scaled_gemm``,
#: ``int8_gemm``, which take ``getCUDABlasLtWorkspace()``).
CUBLASLT_OPS = ("_int_mm", "_scaled_mm", "_scaled_mm_v2")
#: The convolutions that cuDNN runs on CUDA, each call with a workspace of the algorithm cuDNN picks
#: (``aten/src/ATen/native/cudnn/Conv_v8.cpp``: the workspace is allocated through the caching
#: allocator for the call and freed after it): named in caveats, never given a size.
CONVOLUTION_OPS = (
    "convolution",
    "_convolution",
    "convolution_backward",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
)
# The matrix operands (positional arguments) whose emptiness makes the CUDA kernel return before
# taking a cuBLAS handle; the other ops always take one (dot_cuda has no early return for empty
# vectors, _int_mm and _scaled_mm check their shapes).
_MATRIX_ARGS = {
    "mm": (0, 1),
    "addmm": (1, 2),
    "_addmm_activation": (1, 2),
    "bmm": (0, 1),
    "baddbmm": (1, 2),
    "addbmm": (1, 2),
    "addmv": (1, 2),
    "mv": (0, 1),
}
_LT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CONFIG = re.compile(r":([0-9]+):([0-9]+)")  # CublasHandlePool.cpp: parseChosenWorkspaceSize's regex
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")  # what std::stoi reads of a string's start
#: torch 2.8's cuBLASLt workspaces: one per call, freed when the call returns (see the module docstring).
_LT_PER_CALL = not torch_at_least(2, 9)
_CONVOLUTION_CAVEAT = (
    "{ops} ran: on CUDA, cuDNN allocates a workspace through the caching allocator for each "
    "convolution call (forward and backward) and frees it when the call returns; its size depends on "
    "the algorithm cuDNN picks at run time (torch.backends.cudnn.benchmark, the free memory), so it is "
    "not modelled and can raise the peak by the largest such workspace "
    "(aten/src/ATen/native/cudnn/Conv_v8.cpp)."
)


def default_cublas_workspace_size(gpu: GPU) -> int:
    """The cuBLAS workspace per handle and stream without ``CUBLAS_WORKSPACE_CONFIG``, in bytes:
    32 MiB (``:4096:8``) on compute capability 9.x, 10.x and 12.x (Hopper, Blackwell), else
    ``:4096:2:16:8`` = 8,519,680 B (``CublasHandlePool.cpp``: ``parseChosenWorkspaceSize``). Under
    torch 2.8 32 MiB on compute capability 9.0 only (its ``parseChosenWorkspaceSize``)."""
    if gpu.capability[0] in (9, 10, 12) if torch_at_least(2, 9) else gpu.capability == (9, 0):
        return 4096 * 8 * _KiB
    return 4096 * _KiB * 2 + 16 * _KiB * 8


def cublas_workspace_size(gpu: GPU, config: str | None) -> int:
    """The cuBLAS workspace per handle and stream on ``gpu`` for a ``CUBLAS_WORKSPACE_CONFIG`` of
    ``config`` (``None``: unset), in bytes, read as PyTorch's ``parseChosenWorkspaceSize`` reads it:
    every ``:SIZE:COUNT`` found anywhere in the string adds SIZE KiB times COUNT (``":4096:2:16:8"``
    is 8,519,680 B; ``":4096:2:16"`` reads only ``:4096:2``); a string without one warns as PyTorch
    does and gives the default (:func:`default_cublas_workspace_size`). ``ValueError`` for a number
    PyTorch's ``std::stoull`` cannot hold (64 bits), which fails PyTorch's first matmul."""
    default = default_cublas_workspace_size(gpu)
    if config is None:
        return default
    matches = list(_CONFIG.finditer(config))
    if not matches:
        warnings.warn(
            f"Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of {default} bytes.",
            UserWarning,
            stacklevel=2,
        )
        return default
    total = 0
    for match in matches:
        size, count = int(match.group(1)), int(match.group(2))
        if size >= _SIZE_T or count >= _SIZE_T:
            raise ValueError(
                f"CUBLAS_WORKSPACE_CONFIG={config!r}: {max(size, count)} does not fit in 64 bits, so "
                "PyTorch's parser fails at the first matmul; valid: ':SIZE:COUNT' pairs, SIZE in KiB "
                "(':4096:8' is 32 MiB)"
            )
        total = (total + size * _KiB * count) % _SIZE_T
    return total


#: The first torch whose cuBLASLt shares the cuBLAS workspace when ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
#: is unset, and whose cuBLASLt workspace defaults to the cuBLAS size: 2.12 (PyTorch PRs #175879, one
#: ``unified_cublas_and_lt_workspaces()`` read as ``check_env(...).value_or(true)`` by the size and the
#: workspace alike, and #173002, merged after 2.11's branch cut). torch 2.11.0's
#: ``CublasHandlePool.cpp`` (read from its ``libtorch_cuda.so``, and measured on an H100) reads the
#: variable twice: ``getCUDABlasLtWorkspace`` as ``value_or(false)`` (cuBLASLt keeps its own workspace
#: per handle and stream) and ``getCUDABlasLtWorkspaceSize`` as ``value_or(true)`` (that workspace is
#: at most the cuBLAS one), with ``parseCUDABlasLtWorkspaceSize``'s default of 1,024 KiB.
UNIFIED_BY_DEFAULT_SINCE = (2, 12)


def _unified_by_default() -> bool:
    return torch_at_least(*UNIFIED_BY_DEFAULT_SINCE)


def unified_workspaces(value: str | None, default: bool | None = None) -> bool:
    """Whether cuBLASLt shares the cuBLAS workspace, for a ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` of
    ``value`` (``None``: unset), as PyTorch reads it outside fbcode (``c10::utils::check_env``: only
    ``"0"`` and ``"1"`` are valid; another value warns as PyTorch does and counts as unset). Unset
    gives ``default``, which is the installed torch's when ``None``: shared from torch 2.12 on, cuBLASLt's
    own before (:data:`UNIFIED_BY_DEFAULT_SINCE`)."""
    if default is None:
        default = _unified_by_default()
    if value in ("0", "1"):
        return value == "1"
    if value is not None:
        warnings.warn(
            f"Ignoring invalid value for boolean flag TORCH_CUBLASLT_UNIFIED_WORKSPACE: {value}valid values "
            "are 0 or 1.",
            UserWarning,
            stacklevel=2,
        )
    return default


def keeps_own_cublaslt(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a cuBLASLt op (a ``Linear`` with bias) keeps a workspace of its own, besides its
    handle's cuBLAS workspace, under ``environ`` (default ``os.environ``): on torch 2.9-2.11 unless
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``, from 2.12 only with ``=0``; never on torch 2.8, whose
    cuBLASLt workspace lives for one call."""
    env = os.environ if environ is None else environ
    return not _LT_PER_CALL and not unified_workspaces(env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"))


def cublaslt_workspace_size(value: str | None, unified: bool, cublas: int, chosen_default: int) -> int:
    """The cuBLASLt workspace in bytes for a ``CUBLASLT_WORKSPACE_SIZE`` of ``value`` (KiB;
    ``None``: unset), as ``parseCUDABlasLtWorkspaceSize`` and ``getCUDABlasLtWorkspaceSize`` give
    it: default ``chosen_default`` (the cuBLAS size parsed from the environment) when ``unified``,
    else 1 MiB; the value read by ``std::stoi`` (leading blanks and a sign, then digits; a value it
    cannot read, or one beyond ``int``, warns and keeps the default; a negative one wraps as
    ``size_t``); when ``unified``, at most ``cublas``, the workspace it shares. Under torch 2.8 the
    default is 1 MiB unified or not, and an unreadable value warns "invalid CUBLASLT_WORKSPACE_SIZE"
    (its ``CUDABlas.cpp``: ``_parseChosenWorkspaceSize``)."""
    kib = chosen_default // _KiB if unified and torch_at_least(2, 9) else 1024
    if value is not None:
        match = _STOI.match(value)
        read = None if match is None else int(match.group(1))
        if read is None or not -_INT_MAX - 1 <= read <= _INT_MAX:
            what = "invalid" if read is None else "out of range"
            name = f"CUBLASLT_WORKSPACE_SIZE {what}"
            if read is None and not torch_at_least(2, 9):
                name = "invalid CUBLASLT_WORKSPACE_SIZE"
            warnings.warn(
                f"{name}, using default workspace size of {kib} KiB.",
                UserWarning,
                stacklevel=2,
            )
        else:
            kib = read % _SIZE_T
    size = kib * _KiB % _SIZE_T
    return min(size, cublas) if unified else size


@dataclass(frozen=True)
class WorkspaceSizes:
    """What a process's environment makes of the workspaces on one GPU: ``cublas`` bytes per
    (handle, stream); ``cublaslt`` the bytes cuBLASLt asks for; ``unified`` whether cuBLASLt uses
    the cuBLAS workspace (then it allocates none of its own) or its own one per (handle, stream)."""

    cublas: int
    cublaslt: int
    unified: bool


def workspace_sizes(gpu: GPU, environ: Mapping[str, str] | None = None) -> WorkspaceSizes:
    """The :class:`WorkspaceSizes` on ``gpu`` under ``environ`` (default ``os.environ``):
    ``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE`` and
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` read as PyTorch reads them at a process's first matmul
    (warnings and errors as :func:`cublas_workspace_size` and friends give them). Sizes set with
    ``torch.backends.cuda.cublas_workspace_size(n)`` (CUDA builds) are not seen."""
    env = os.environ if environ is None else environ
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    cublas = cublas_workspace_size(gpu, config)
    flag = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    lt_kib = env.get("CUBLASLT_WORKSPACE_SIZE")
    if _unified_by_default():
        unified = unified_workspaces(flag, default=True)
        return WorkspaceSizes(cublas, cublaslt_workspace_size(lt_kib, unified, cublas, cublas), unified)
    if _LT_PER_CALL:  # torch 2.8 (CUDABlas.cpp): shared only with "1"; else 1 MiB, not capped
        unified = flag == "1"
        return WorkspaceSizes(cublas, cublaslt_workspace_size(lt_kib, unified, cublas, cublas), unified)
    # torch 2.11: the size capped unless the flag is "0", the workspace shared only when it is "1"
    capped = unified_workspaces(flag, default=True)
    lt = cublaslt_workspace_size(lt_kib, capped, cublas, chosen_default=_KiB * _KiB)
    return WorkspaceSizes(cublas, lt, flag == "1")


def _packets(names: tuple[str, ...]) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


@functools.cache
def workspace_ops() -> frozenset[Any]:
    """The overload packets of :data:`BLAS_OPS` and :data:`CONVOLUTION_OPS`: the ops a tracker hands
    to :meth:`CublasWorkspaces.after_op` (one set lookup per op)."""
    return _packets(BLAS_OPS) | _packets(CONVOLUTION_OPS)


def _handle() -> str | int:
    """Which cuBLAS handle an op gets on a GPU: the autograd engine's device thread's while backward
    runs (``torch/csrc/autograd/engine.cpp`` runs CUDA nodes on one thread per device), else the
    calling thread's (``DeviceThreadHandlePool``: one handle per thread and device)."""
    if torch._C._current_autograd_node() is not None:
        return "autograd"
    return threading.get_ident()


def _stream(device: torch.device) -> int:
    """The current stream of a fake or ``meta`` tensor's device: CUDA's current stream where CUDA
    runs, else 0 (a run without CUDA has one stream)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_stream(device).stream_id
    return 0


def _is_real_cuda(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return tensor.device.type == "cuda" and not isinstance(tensor, FakeTensor)


class CublasWorkspaces:
    """The cuBLAS/cuBLASLt workspaces of one modelled GPU run, by (device, stream, handle).

    :meth:`after_op` is called by the tracker after each op of :func:`workspace_ops` has run and its
    outputs were counted (PyTorch allocates an op's output before its kernel takes the cuBLAS
    handle): for an op that takes a handle on a (device, stream, handle) key without a workspace
    yet, it calls ``allocate(device, nbytes)`` and remembers the key. With unified workspaces (the
    default from torch 2.12 on, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` on 2.11) a cuBLASLt op uses
    the cuBLAS workspace of its key, and allocates it (of the cuBLAS size) when it is the first
    (``getCUDABlasLtWorkspace``'s unified branch: ``getNewWorkspace``); with
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` (or unset on 2.11) it takes the cuBLAS workspace of its
    key (its handle is the cuBLAS handle) and allocates its own of ``sizes.cublaslt`` bytes (none
    when that is 0). Under torch 2.8 that own workspace is for the call only (``allocate(device,
    nbytes, transient=True)``: allocated and freed at once, after the op's outputs). Which ops run
    through cuBLASLt:
    :data:`CUBLASLT_OPS`; ``addmm`` and ``_addmm_activation`` whose bias can be fused (``Blas.cpp``:
    ``isInputCompliesAddmmCudaLt``, unless ``DISABLE_ADDMM_CUDA_LT=1``); other float matmuls when
    ``torch.backends.cuda.preferred_blas_library()`` is cuBLASLt. An op whose operands are empty
    returns before taking a handle and allocates none.

    ``keys`` holds the keys with a workspace, in the order allocated (``nbytes``: the size of each,
    0 where ``CUBLAS_WORKSPACE_CONFIG=:0:0`` turned it off); :meth:`present` makes the
    first keys asked for on a device use workspaces an allocator already holds (a run resumed from
    a recorded state). ``convolutions`` names the convolution ops seen (see :meth:`caveats`).
    Ops on real CUDA tensors allocate nothing here: the GPU's own allocator does it.
    """

    def __init__(self, gpu: GPU, sizes: WorkspaceSizes | None = None) -> None:
        self.gpu = gpu
        self.sizes = sizes if sizes is not None else workspace_sizes(gpu)
        self.keys: list[tuple[str, torch.device, int, str | int]] = []
        self.nbytes: list[int] = []
        self.convolutions: list[str] = []
        self._present: dict[tuple[str, torch.device], int] = {}
        self._lt = _packets(CUBLASLT_OPS)
        self._convolution = _packets(CONVOLUTION_OPS)

    def present(self, device: torch.device, count: int, pool: str = "cublas") -> None:
        """Note that ``count`` workspaces of ``pool`` already exist on ``device``'s allocator: the
        next ``count`` keys that need one there take those instead of allocating (in a step, the
        forward pass's thread first, then the autograd thread, as PyTorch allocated them)."""
        self._present[(pool, device)] = self._present.get((pool, device), 0) + count

    def after_op(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        allocate: Callable[..., None],
    ) -> None:
        """Allocate, through ``allocate(device, nbytes)``, the workspace ``func(*args, **kwargs)``
        takes on a GPU when its key has none yet; note a convolution."""
        packet = func.overloadpacket
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or _is_real_cuda(tensors[0]):
            return
        name = packet.__name__
        if packet in self._convolution:
            if name not in self.convolutions:
                self.convolutions.append(name)
            return
        if not self._takes_handle(name, args):
            return
        # Every cuBLASLt op first takes its thread's cuBLAS handle (getCurrentCUDABlasLtHandle is
        # getCurrentCUDABlasHandle, which gives the handle its cuBLAS workspace), then, when cuBLASLt
        # does not share it, its own: on an H100 with torch 2.11 a Linear with bias as the first
        # matmul allocated 32 MiB and 1 MiB (benchmarks/gpu_fidelity.py, mlp).
        own_lt = not self.sizes.unified and self._uses_lt(packet, name, args, kwargs)
        where = self._where(tensors[0])
        self._take(("cublas", *where), allocate)
        if own_lt and _LT_PER_CALL:  # torch 2.8: cuBLASLt's workspace for this call only
            allocate(where[0], self.sizes.cublaslt, transient=True)
        elif own_lt:
            self._take(("cublaslt", *where), allocate)

    @staticmethod
    def _where(tensor: torch.Tensor) -> tuple[torch.device, int, str | int]:
        """The (device, stream, handle) of an op on ``tensor``."""
        # The tracker's device: its storage's (a fake tensor's is meta; a DTensor's, its local shard's).
        storages = storages_of(tensor)
        device = storages[0].device if storages else tensor.device
        return device, _stream(tensor.device), _handle()

    def _take(self, key: tuple[str, torch.device, int, str | int], allocate: Callable[..., None]) -> None:
        """Give ``key`` (pool, device, stream, handle) its workspace unless it has one."""
        if key in self.keys:
            return
        pool, device = key[0], key[1]
        nbytes = self.sizes.cublaslt if pool == "cublaslt" else self.sizes.cublas
        if self._present.get((pool, device), 0) > 0:
            self._present[(pool, device)] -= 1
        else:
            # a workspace that runs out of memory is not kept: the next op asks again, as PyTorch's
            # map of workspaces gets its entry only once getNewWorkspace() returned
            allocate(device, nbytes)
        self.keys.append(key)
        self.nbytes.append(nbytes)

    def caveats(self) -> list[str]:
        """One sentence naming the cuDNN convolution workspaces the run would have, if it had any."""
        if not self.convolutions:
            return []
        return [_CONVOLUTION_CAVEAT.format(ops=", ".join(f"aten.{name}" for name in self.convolutions))]

    @staticmethod
    def _takes_handle(name: str, args: tuple[Any, ...]) -> bool:
        """Whether the CUDA kernel reaches cuBLAS: ``Blas.cpp`` returns early, without a handle,
        for an empty result or an empty reduction dimension (an empty matrix operand)."""
        positions = _MATRIX_ARGS.get(name)
        if positions is None:
            return True
        operands = [args[i] for i in positions if i < len(args) and isinstance(args[i], torch.Tensor)]
        if name in ("mv", "addmv"):
            operands = operands[:1]  # addmv_out_cuda: only an empty matrix returns early
        return all(operand.numel() > 0 for operand in operands)

    def _uses_lt(self, packet: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
        if packet in self._lt:
            return True
        if name in ("addmm", "_addmm_activation") and _addmm_complies_lt(name, args, kwargs):
            return True
        if name not in _MATRIX_ARGS or name in ("addmv", "mv"):
            return False  # gemv, dot and the rest are cuBLAS calls whatever the preferred library
        # CUDABlas.cpp: gemm_internal / bgemm_internal take cuBLASLt when it is preferred
        operand = args[_MATRIX_ARGS[name][0]]
        return (
            torch._C._get_blas_preferred_backend() == torch._C._BlasBackend.Cublaslt
            and isinstance(operand, torch.Tensor)
            and operand.dtype in _LT_DTYPES
        )


def _addmm_complies_lt(name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """``Blas.cpp``: ``isInputCompliesAddmmCudaLt`` (CUDA 12.1+) and ``isGloballyDisabledAddmmCudaLt``
    for ``addmm(self, mat1, mat2, beta=1, alpha=1)`` into a new, contiguous result: a 1-D (or
    squeezable) contiguous bias of mat2's width, or with an activation a 2-D bias that expands to
    the result; beta 1; a float, half, bfloat16 or double mat1; every matrix dimension above 1."""
    if os.environ.get("DISABLE_ADDMM_CUDA_LT") == "1" or len(args) < 3:
        return False
    bias, mat1, mat2 = args[:3]
    if not all(isinstance(t, torch.Tensor) for t in (bias, mat1, mat2)) or mat1.dim() != 2 or mat2.dim() != 2:
        return False
    beta = (kwargs or {}).get("beta", args[3] if len(args) > 3 else 1)
    fusable = (
        bias.is_contiguous()
        and (bias.dim() == 1 or bias.squeeze().dim() == 1)
        and bias.shape[-1] == mat2.shape[1]
    )
    activated = name == "_addmm_activation" and bias.dim() == 2
    if activated:
        try:
            torch.broadcast_shapes(bias.shape, (mat1.shape[0], mat2.shape[1]))
        except RuntimeError:
            activated = False
    return (
        beta == 1
        and (fusable or activated)
        and mat1.dtype in _LT_DTYPES
        and min(*mat1.shape, *mat2.shape) > 1
    )
