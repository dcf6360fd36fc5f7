"""Which kernel ``scaled_dot_product_attention`` runs on a target GPU, and the tensors it keeps.

:func:`select_backend` follows ``select_sdp_backend`` of
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` for a GPU of a given compute capability;
:func:`memlab.estimate.attention_run.run_backend` then calls the chosen kernel as
``scaled_dot_product_attention`` in ``aten/src/ATen/native/transformers/attention.cpp`` does:
PyTorch's own CUDA-side ops, whose meta kernels run on fake and ``meta`` tensors, so a tracker
counts what they allocate.

The rules were read from pytorch/pytorch's ``sdp_utils.cpp`` at commit 001f694 (the stored version
nearest to the installed torch 2.13; it is a little newer: its dense checks take a ``supports_mqa``
template argument that 2.13's ``sdp_utils_cpp.h`` lacks, added with memory-efficient GQA by
pytorch/pytorch#191085), the shared checks from the installed 2.13
``ATen/native/transformers/sdp_utils_cpp.h`` and the default order from its ``ATen/Context.h``.

Grouped-query attention (``enable_gqa=True``, fewer key/value heads than query heads), as torch
2.13 has it: ``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``
(``sdp_utils_cpp.h`` lines 397-446, with ``check_grouped_query_attention`` lines 357-395) lets
flash take it (``<true>``: key and value heads equal, query heads a multiple of them) and cuDNN
(``<true, false>``, pytorch/pytorch#150337: query heads a multiple of the key heads and of the
value heads), not memory-efficient attention (``<false>`` until #191085; 2.13's meta kernel of its
backward still gives key/value gradients the query's heads). ``attention.cpp`` passes the
unrepeated key and value to the fused kernel, so a fused GQA call keeps them as they are; only
the math path repeats them (``pre_process_group_query_attention_input``: ``repeat_interleave``).
cuDNN's version decides part of the choice and is unknown without a CUDA build of PyTorch:
:data:`ASSUMED_CUDNN_VERSION` and :data:`ASSUMED_CUDA_MAJOR` stand in for it (see there).
"""

from __future__ import annotations

import math
import os

import torch

from memlab._torch_version import torch_at_least

__all__ = [
    "ASSUMED_CUDA_MAJOR",
    "ASSUMED_CUDNN_VERSION",
    "BACKEND_OPS",
    "FRONTEND_D256_RULE_SINCE",
    "cudnn_version",
    "prefers_cudnn",
    "priority_order",
    "select_backend",
]

#: The cuDNN version assumed where PyTorch has no cuDNN to ask (a CPU-only build), encoded as
#: ``cudnnGetVersion`` does (major * 10000 + minor * 100 + patch): 9.15.1. sdp_utils.cpp puts
#: cuDNN attention first on sm90/sm100 only above 9.15.0 (``check_prefer_cudnn_attention``: "cuDNN
#: 9.15.1 required for seq_len not divisible by 128 fix, CUDA <= 12.9 wheels ship with older
#: cuDNN"), so this is the oldest cuDNN with which an H100 picks cuDNN attention, as recent wheels
#: do; with it, cuDNN takes head dims up to 128 (192 for query/key with 128 for value on sm90/sm10x),
#: not the 256 of cuDNN newer than 9.22 built with cudnn-frontend 1.24. Under torch 2.8: 9.10.2, the
#: cuDNN its CUDA wheels ship (torch 2.8.0's METADATA: ``nvidia-cudnn-cu12==9.10.2.21``).
ASSUMED_CUDNN_VERSION = 91501 if torch_at_least(2, 9) else 91002
#: The CUDA major version assumed likewise: 13, the CUDA of the wheels that carry such a cuDNN.
#: Under CUDA 12 sdp_utils.cpp prefers cuDNN only on minor versions 0 and 3 (sm90, sm100, sm103).
ASSUMED_CUDA_MAJOR = 13

# at::SDPBackend values, as torch._C._get_sdp_priority_order() reports them.
_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_DEFAULT_ORDER = [1, 2, 0, 3, 4]  # ATen/Context.h: sdp_priority_order
_CUDNN_FIRST = [3, 1, 2, 0, 4]  # sdp_utils.cpp: priority_order, when check_prefer_cudnn_attention()
_HALF = (torch.float16, torch.bfloat16)
_FRONTEND_SUPPORTS_D256 = False  # sdp_utils.cpp: kCuDNNFrontendSupportsD256 (cudnn-frontend >= 1.24)
#: The first torch whose cuDNN attention takes head dims above 128 only with a cudnn-frontend that
#: supports d256 (pytorch/pytorch#185553, after 2.12's release): 2.13. Before it (torch 2.11.0's
#: ``check_cudnn_tensor_shapes``, read from its ``libtorch_cuda.so``; an H100 with torch 2.11.0 and
#: cuDNN 9.19 ran cuDNN attention for float16 and bfloat16 at every head dim up to 256, with and
#: without grad, causal or not, grouped-query or not) the limit is 256 on compute capability 9.x
#: with cuDNN 9.10.0 or newer, 192 for query/key with 128 for value on 10.x with cuDNN 9.11.0 or
#: newer, else 128, and no backward rule for d256.
FRONTEND_D256_RULE_SINCE = (2, 13)

#: The aten op each backend runs.
BACKEND_OPS = {
    "cudnn": "aten._scaled_dot_product_cudnn_attention",
    "flash": "aten._scaled_dot_product_flash_attention",
    "efficient": "aten._scaled_dot_product_efficient_attention",
    "math": "aten._scaled_dot_product_attention_math",
}


def cudnn_version() -> int:
    """The cuDNN version sdp_utils.cpp reads (``versionRuntimeCuDNN``): the loaded cuDNN's where
    this PyTorch has one, else :data:`ASSUMED_CUDNN_VERSION`."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return version or ASSUMED_CUDNN_VERSION


def _cuda_major() -> int:
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else ASSUMED_CUDA_MAJOR


def prefers_cudnn(capability: tuple[int, int]) -> bool:
    """Whether PyTorch puts cuDNN attention first on a GPU of this compute capability
    (sdp_utils.cpp: ``check_prefer_cudnn_attention``): not with ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``;
    cuDNN newer than 9.15.0; sm9x or sm10x, under CUDA 12 only sm90, sm100 and sm103. Never under
    torch 2.8, where cuDNN attention is opt-in on every GPU (pytorch/pytorch#138522; the default came
    back for sm90/sm100 with #162073, in 2.9): 2.8's ``select_sdp_backend`` (its ``libtorch_cuda.so``)
    tries backends in ``at::Context::sDPPriorityOrder()``'s order as it is, and 2.8 has no
    ``check_prefer_cudnn_attention`` state nor any ``TORCH_CUDNN_SDPA_*`` preference variable, which
    2.9.1 has (``TORCH_CUDNN_SDPA_PREFERRED``) and 2.11 on (``TORCH_CUDNN_SDPA_DEPRIORITIZED``)."""
    if not torch_at_least(2, 9):
        return False
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":  # c10::utils::check_env: "1" only
        return False
    major, minor = capability
    if cudnn_version() <= 91500 or major not in (9, 10):
        return False
    return _cuda_major() >= 13 or minor in (0, 3)


def priority_order(capability: tuple[int, int]) -> list[str]:
    """The backends in the order ``select_sdp_backend`` tries them on this GPU: the order set with
    ``torch.nn.attention.sdpa_kernel(..., set_priority=True)`` if the user changed it, else the
    default (flash, efficient, math, cudnn), with cuDNN first where :func:`prefers_cudnn`. Each
    backend once, at its first place: torch 2.8's Context.h lists four backends in an array of five
    (no ``overrideable``), so its fifth entry reads 0, math again, which ``select_sdp_backend`` only
    tries a second time."""
    order = list(torch._C._get_sdp_priority_order())
    if order == _DEFAULT_ORDER and prefers_cudnn(capability):
        order = _CUDNN_FIRST
    return [_NAMES[code] for code in dict.fromkeys(order)]


def _between(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= capability <= high  # sdp_utils.cpp: check_sm_version, bounds included


def _requires_grad(*tensors: torch.Tensor) -> bool:
    # sdp_utils_cpp.h: input_requires_grad
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _heads_fit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gqa: str | None,
) -> bool:
    """sdp_utils_cpp.h (torch 2.13): ``check_batch_size_and_num_heads_dense``: the same batch size;
    the same heads, unless ``gqa`` (the backend's grouped-query rule, used only when the call
    passed ``enable_gqa=True``): ``"same_kv"`` (flash: key and value heads equal and dividing the
    query heads, ``check_grouped_query_attention<true>``) or ``"any_kv"`` (cuDNN: key heads and
    value heads each dividing the query heads, ``check_grouped_query_attention<false>``)."""
    if not query.size(0) == key.size(0) == value.size(0):
        return False
    q_heads, k_heads, v_heads = query.size(-3), key.size(-3), value.size(-3)
    if gqa is None:
        return q_heads == k_heads == v_heads
    if gqa == "same_kv" and k_heads != v_heads:
        return False
    return q_heads % k_heads == 0 and (gqa == "same_kv" or q_heads % v_heads == 0)


def _dense_common(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    ignore_singleton_dim: bool,
    gqa: str | None = None,
) -> bool:
    """The dense checks every fused backend runs (sdp_utils_cpp.h): non-zero sequence lengths,
    last-dim stride 1 (the mask's too on a GPU), same batch size and heads (or the backend's
    grouped-query rule ``gqa``, see :func:`_heads_fit`)."""
    if query.size(-2) == 0 or key.size(-2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    strides = all(t.stride(-1) == 1 for t in (query, key, value))  # check_last_dim_stride_equals_1_dense
    if ignore_singleton_dim:
        strides = strides or query.size(-1) == 1
    if not strides or (attn_mask is not None and attn_mask.stride(-1) != 1):
        return False
    return _heads_fit(query, key, value, gqa)  # check_batch_size_and_num_heads_dense


def _can_use_cudnn(
    capability: tuple[int, int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    enable_gqa: bool = False,
) -> bool:
    """sdp_utils.cpp: ``can_use_cudnn_attention`` for dense inputs, with :func:`cudnn_version`."""
    version = cudnn_version()
    if dropout_p > 0.0 and 91100 < version < 91400:  # "does not support dropout in SDPA (9.11 - 9.13)"
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():  # check_runtime_disabled_cudnn
        return False
    if torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    ):  # check_cudnn_deterministic
        return False
    if query.dtype not in _HALF or not query.dtype == key.dtype == value.dtype:  # check_dtypes_low_precision
        return False
    if not _mask_shape_fits(query, key, attn_mask):  # check_attn_mask_shape
        return False
    if not _between(capability, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0):  # check_cudnn_dropout: multiples of 1/16
        return False
    gqa = "any_kv" if enable_gqa else None  # check_batch_size_and_num_heads_dense<true, false>
    if not _dense_common(query, key, value, attn_mask, ignore_singleton_dim=True, gqa=gqa):
        return False
    return _cudnn_shapes_fit(capability, query, key, value, dropout_p, version)


def _mask_shape_fits(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """sdp_utils_cpp.h: ``check_attn_mask_shape``: a mask that does not require grad, 2-D
    (L or 1, S or 1) or 4-D (B or 1, H or 1, L or 1, S or 1)."""
    if attn_mask is None:
        return True
    if attn_mask.requires_grad:
        return False

    def fits(size: int, target: int) -> bool:
        return size in (target, 1)

    if not (fits(attn_mask.size(-2), query.size(2)) and fits(attn_mask.size(-1), key.size(2))):
        return False
    if attn_mask.dim() == 2:
        return True
    return (
        attn_mask.dim() == 4
        and fits(attn_mask.size(0), query.size(0))
        and fits(attn_mask.size(1), query.size(1))
    )


def _cudnn_shapes_fit(
    capability: tuple[int, int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    version: int,
) -> bool:
    """sdp_utils.cpp: ``check_cudnn_tensor_shapes`` and ``check_cudnn_d256_bprop_head_dim``."""
    batch, heads, s_q, d_qk = query.shape
    s_k, d_v = key.size(2), value.size(3)
    if batch > 65535 or heads > 65535 or version < 8903 or (version < 8906 and dropout_p != 0.0):
        return False
    major, minor = capability
    sm90_or_sm10x = (major == 9 and minor == 0) or major == 10
    unsupported_sm107 = major == 10 and minor == 7 and version <= 92500
    supports_d256 = sm90_or_sm10x and not unsupported_sm107 and version > 92200 and _FRONTEND_SUPPORTS_D256
    limit = 128
    if not torch_at_least(2, 9):  # torch 2.8's: 128, and 192/128 on sm90/sm10x with cuDNN 9.11
        supports_d256 = False
        if sm90_or_sm10x and version >= 91100 and (d_qk, d_v) == (192, 128):
            limit = 192
    elif not torch_at_least(*FRONTEND_D256_RULE_SINCE):  # torch 2.11's rule (FRONTEND_D256_RULE_SINCE)
        supports_d256 = False
        if version >= 91000 and major == 9:
            limit = 256
        elif version >= 91100 and major == 10 and (d_qk, d_v) == (192, 128):
            limit = 192
    elif supports_d256:
        limit = 256
    elif sm90_or_sm10x and version >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if version < 8906 and s_k % 64:
        return False
    if version < 90000 and (s_q < 64 or (dropout_p != 0.0 and (s_q % 64 or s_k % 64))):
        return False
    if s_k == 1 or (dropout_p != 0.0 and s_q == 1):
        return False
    if supports_d256 and _requires_grad(query, key, value):  # check_cudnn_d256_bprop_head_dim
        return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return True


def _can_use_flash(
    capability: tuple[int, int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool = False,
) -> bool:
    """sdp_utils.cpp: ``can_use_flash_attention`` for dense inputs."""
    head = query.size(-1)
    if not torch.backends.cuda.flash_sdp_enabled() or attn_mask is not None:  # check_for_attn_mask
        return False
    if not head == key.size(-1) == value.size(-1) or head > 256:  # check_head_dim_size_flash
        return False
    if not _between(capability, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: backward fails there
    narrow = _between(capability, (8, 6), (8, 9)) or _between(capability, (12, 0), (12, 1))
    if (
        narrow
        and _requires_grad(query, key, value)
        and not (head <= 192 or (dropout_p == 0.0 and head > 224))
    ):
        return False
    if is_causal and query.size(-2) != key.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    dtypes = _HALF if capability[0] >= 8 else (torch.float16,)  # check_dtypes_flash_attention
    if query.dtype not in dtypes or not query.dtype == key.dtype == value.dtype:
        return False
    gqa = "same_kv" if enable_gqa else None  # check_batch_size_and_num_heads_dense<true>
    return _dense_common(query, key, value, None, ignore_singleton_dim=True, gqa=gqa)


def _gemm_alignment(capability: tuple[int, int], dtype: torch.dtype) -> int:
    """sdp_utils.cpp: ``minimum_gemm_alignment`` (with ``use_tensor_cores``), in elements."""
    half = dtype in _HALF
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and half)
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _can_use_efficient(
    capability: tuple[int, int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
) -> bool:
    """sdp_utils.cpp: ``can_use_mem_efficient_attention`` for dense inputs."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    if not _between(capability, (5, 0), (12, 1)):  # check_mem_efficient_hardware_support
        return False
    alignment = _gemm_alignment(capability, query.dtype)
    head, value_head = query.size(-1), value.size(-1)
    if not (head == key.size(-1) and head > 0 and value_head > 0):  # check_head_dim_size_mem_efficient
        return False
    if head % alignment or value_head % alignment:
        return False
    if capability[0] >= 8:  # check_data_ptr_alignment_mem_efficient: storage offsets, in elements here
        if any(t.numel() and t.storage_offset() % alignment for t in (query, key, value)):
            return False
    if not _dense_common(query, key, value, attn_mask, ignore_singleton_dim=False):
        return False
    dtypes = (
        (torch.float16, torch.float32, torch.bfloat16)
        if capability[0] >= 8
        else (torch.float16, torch.float32)
    )
    return query.dtype in dtypes and query.dtype == key.dtype == value.dtype


def select_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    capability: tuple[int, int],
    enable_gqa: bool = False,
) -> str:
    """The backend ``select_sdp_backend`` picks for these dense inputs on a GPU of compute
    ``capability``: ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``, or ``"error"`` when no
    enabled backend fits (PyTorch raises "No available kernel"). Reads the backends enabled with
    ``torch.backends.cuda`` / ``torch.nn.attention.sdpa_kernel`` and the priority order as PyTorch
    does. ``enable_gqa``: the call's flag; with it, query heads a multiple of the key/value heads
    fit flash (key and value heads equal) and cuDNN, never memory-efficient attention (torch 2.13,
    see the module docstring); without it the heads must be equal. Inputs that are not 4-D or are
    nested never get a fused backend here."""
    backends = torch.backends.cuda
    enabled = (
        backends.math_sdp_enabled(),
        backends.flash_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(),
        backends.cudnn_sdp_enabled(),
    )
    if not any(enabled):
        return "error"
    fused = all(t.dim() == 4 and not t.is_nested for t in (query, key, value))  # check_tensor_shapes
    for backend in priority_order(capability):
        if backend == "math" and backends.math_sdp_enabled():
            return "math"
        if not fused:
            continue
        if backend == "cudnn" and _can_use_cudnn(
            capability, query, key, value, attn_mask, dropout_p, enable_gqa
        ):
            return "cudnn"
        if backend == "flash" and _can_use_flash(
            capability, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa
        ):
            return "flash"
        if backend == "efficient" and _can_use_efficient(capability, query, key, value, attn_mask):
            return "efficient"
    return "error"
