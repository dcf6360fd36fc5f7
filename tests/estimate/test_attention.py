"""The attention kernel for a target GPU: sdp_utils.cpp's choice, and its saved tensors byte for byte."""

from __future__ import annotations

import contextlib
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import memlab
from memlab._gpus import GPUS
from memlab._torch_version import torch_at_least
from memlab.estimate import attention
from memlab.estimate.attention import prefers_cudnn, priority_order, select_backend
from memlab.estimate.kernels import CudaKernels

BLOCK = 512  # the CUDA caching allocator's rounding


@pytest.fixture(autouse=True)
def a_cpu_build(monkeypatch):
    """The choice as a CPU build of PyTorch makes it (cuDNN and CUDA versions assumed): a CUDA build run
    without a GPU would otherwise answer with the cuDNN and CUDA it ships."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


SM80, SM86, SM89, SM90, SM100 = (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)


# sdp_utils.cpp puts cuDNN first on an H100 or B200 from torch 2.9 (check_prefer_cudnn_attention,
# with cuDNN newer than 9.15.0 from 2.10); torch 2.8 never does (attention.prefers_cudnn says why).
# The H100/B200 rows below follow that order: where the installed torch (or its loaded cuDNN)
# keeps the default order there, cudnn_first() sets it as a user does, so the cuDNN rules are
# checked on every torch; test_the_default_order_on_an_h100_follows_the_torch_release checks the
# default itself. The cuDNN version as sdp_utils.cpp reads it: the loaded one on a CUDA build.
LOADED_CUDNN = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
CUDNN_VERSION = LOADED_CUDNN or (91501 if torch_at_least(2, 9) else 91002)
H100_PREFERS_CUDNN = torch_at_least(2, 9) and CUDNN_VERSION > 91500
#: cuDNN attention takes head dims up to 256 on sm9x in torch 2.9-2.12 (2.11's sdp_utils.cpp); 2.8's
#: and 2.13's keep it to 128 (192/128) with this cuDNN
D256_ON_SM9X = torch_at_least(2, 9) and not torch_at_least(2, 13)
CUDNN_ORDER = [3, 1, 2, 0]  # at::SDPBackend: cudnn, flash, efficient, math (sdp_utils.cpp's cudnn_order)


@contextlib.contextmanager
def cudnn_first(capability: tuple[int, int]):
    """Run with sdp_utils.cpp's cuDNN-first order on sm90/sm100 where PyTorch does not set it."""
    previous = torch._C._get_sdp_priority_order()
    default = previous[:4] == [1, 2, 0, 3]  # a test that set its own order keeps it
    if capability not in (SM90, SM100) or H100_PREFERS_CUDNN or not default:
        yield
        return
    torch._C._set_sdp_priority_order(CUDNN_ORDER)
    try:
        yield
    finally:
        torch._C._set_sdp_priority_order(previous)


@contextlib.contextmanager
def modelled(fake: FakeTensorMode, gpu: str):
    """``fake``, the GPU's SDPA order (:func:`cudnn_first`), a tracker with history and
    ``CudaKernels(gpu=gpu)``, entered in that order: yields ``(tracker, kernels)``."""
    with (
        fake,
        cudnn_first(GPUS[gpu].capability),
        memlab.TensorTracker(history=True) as tracker,
        CudaKernels(gpu=gpu) as kernels,
    ):
        yield tracker, kernels


def blocks(nbytes: int) -> int:
    return math.ceil(nbytes / BLOCK) * BLOCK


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def choose(
    capability: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
    head: int = 64,
    value_head: int | None = None,
    lengths: tuple[int, int] = (128, 128),
    mask: tuple[int, ...] | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    grad: bool = False,
    default_order: bool = False,
) -> str:
    lq, lk = lengths
    q, k = meta(2, 4, lq, head, dtype=dtype, grad=grad), meta(2, 4, lk, head, dtype=dtype, grad=grad)
    v = meta(2, 4, lk, value_head or head, dtype=dtype, grad=grad)
    attn_mask = meta(*mask, dtype=torch.bool) if mask else None
    with contextlib.nullcontext() if default_order else cudnn_first(capability):
        return select_backend(q, k, v, attn_mask, dropout_p, is_causal, capability=capability)


# -- the choice ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("capability", "kwargs", "expected"),
    [
        # sm80 (A100): the default order, flash, efficient, math, cuDNN (ATen/Context.h)
        (SM80, {}, "flash"),
        (SM80, {"dtype": torch.float32}, "efficient"),  # check_dtypes_flash_attention
        (SM80, {"head": 6}, "flash"),  # flash pads the head dim to 8
        (SM80, {"mask": (128, 128)}, "efficient"),  # check_for_attn_mask
        (SM80, {"lengths": (64, 128), "is_causal": True}, "efficient"),  # causal needs square lengths
        (SM80, {"head": 512}, "efficient"),  # check_head_dim_size_flash: <= 256
        (SM80, {"dtype": torch.float32, "head": 6}, "math"),  # efficient: head dim % 4 for float32
        (SM80, {"head": 12, "mask": (128, 128)}, "math"),  # efficient: head dim % 8 for bfloat16
        (SM80, {"dtype": torch.float64}, "math"),
        # sm90 (H100) with cuDNN first (see cudnn_first)
        (SM90, {}, "cudnn"),
        (SM90, {"dtype": torch.float16, "mask": (128, 128)}, "cudnn"),  # a 2-D mask fits cuDNN
        (SM90, {"mask": (2, 128, 128)}, "efficient"),  # check_attn_mask_shape: 2-D or 4-D only
        (SM90, {"dtype": torch.float32}, "efficient"),  # check_dtypes_low_precision
        (SM90, {"head": 6}, "flash"),  # check_cudnn_tensor_shapes: head dim % 8
        # head dim <= 256 on sm9x in torch 2.9-2.12 (2.11), <= 128 (192/128) in 2.8 and from 2.13 on
        (SM90, {"head": 160}, "cudnn" if D256_ON_SM9X else "flash"),
        (SM90, {"head": 256, "grad": True}, "cudnn" if D256_ON_SM9X else "flash"),
        (SM90, {"head": 264}, "efficient"),  # above 256: neither cuDNN nor flash
        (SM100, {"head": 160}, "flash"),  # 256 is sm9x's alone before 2.13
        # ... but 192/128 on sm90 with cuDNN >= 9.11 (torch 2.8 ships 9.10.2: efficient takes it)
        (SM90, {"head": 192, "value_head": 128}, "cudnn" if CUDNN_VERSION >= 91100 else "efficient"),
        (SM80, {"head": 192, "value_head": 128}, "efficient"),  # flash needs equal head dims
        (SM90, {"dropout_p": 0.1}, "flash"),  # check_cudnn_dropout: multiples of 1/16
        (SM90, {"dropout_p": 0.125}, "cudnn"),
        (SM90, {"lengths": (128, 1)}, "flash"),  # cuDNN: key length 1
        (SM90, {"lengths": (1, 128), "dropout_p": 0.125}, "flash"),  # cuDNN: query length 1 with dropout
        (SM100, {}, "cudnn"),  # B200
        # sm86/sm89: flash's backward fails for head dims in (192, 224] (and above with dropout)
        (SM89, {"head": 224, "grad": True}, "efficient"),
        (SM89, {"head": 224}, "flash"),  # no gradient, no backward
        (SM86, {"head": 256, "grad": True}, "flash"),
        (SM86, {"head": 256, "grad": True, "dropout_p": 0.1}, "efficient"),
        # before sm80 (V100, T4): no flash, no cuDNN; efficient without bfloat16
        ((7, 0), {"dtype": torch.float16}, "efficient"),
        ((7, 5), {}, "math"),
        ((7, 0), {"dtype": torch.float32, "head": 6}, "efficient"),  # alignment 1 without tensor cores
    ],
)
def test_backend_follows_sdp_utils(capability, kwargs, expected):
    assert choose(capability, **kwargs) == expected


def test_cudnn_is_refused_under_deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    try:
        assert choose(SM90) == "flash"  # check_cudnn_deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert choose(SM90) == "cudnn"
    finally:
        torch.use_deterministic_algorithms(False)


def test_disabled_backends_are_skipped():
    SDPBackend = torch.nn.attention.SDPBackend
    with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert choose(SM90) == "flash"
        assert choose(SM90, dtype=torch.float32) == "math"
    with torch.nn.attention.sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert choose(SM80, dtype=torch.float64) == "error"  # PyTorch: "No available kernel"


def test_priority_order_prefers_cudnn_only_where_sdp_utils_does():
    # Context.h's order; torch 2.8 has no overrideable in it (its fifth entry reads 0, math again)
    default = ["flash", "efficient", "math", "cudnn"]
    if 4 in torch._C._get_sdp_priority_order():
        default.append("overrideable")
    cudnn = ["cudnn", "flash", "efficient", "math", *default[4:]]
    assert priority_order(SM80) == default
    assert priority_order(SM90) == (cudnn if H100_PREFERS_CUDNN else default)
    assert [prefers_cudnn(gpu.capability) for gpu in GPUS.values()] == [
        H100_PREFERS_CUDNN and gpu.capability[0] in (9, 10) for gpu in GPUS.values()
    ]


def test_the_default_order_on_an_h100_follows_the_torch_release():
    # torch 2.8: flash, efficient, math, cuDNN on every GPU (cuDNN attention opt-in); 2.9 on: cuDNN
    # first on sm90/sm100 with a cuDNN newer than 9.15.0
    assert choose(SM90, default_order=True) == ("cudnn" if H100_PREFERS_CUDNN else "flash")
    assert choose(SM80, default_order=True) == "flash"


def test_a_priority_order_the_user_set_is_kept():
    SDPBackend = torch.nn.attention.SDPBackend
    order = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    with torch.nn.attention.sdpa_kernel(order, set_priority=True):
        assert priority_order(SM90)[:3] == ["efficient", "cudnn", "math"]
        assert choose(SM90) == "efficient"


def test_cudnn_preference_follows_the_cudnn_and_cuda_versions(monkeypatch):
    # the cuDNN and CUDA that sdp_utils.cpp reads, whether this torch loads them or not
    monkeypatch.setattr(attention, "cudnn_version", lambda: 91500)  # 9.15.0: not newer than 9.15.0
    monkeypatch.setattr(attention, "_cuda_major", lambda: 13)
    assert not prefers_cudnn(SM90)
    assert choose(SM90, default_order=True) == "flash"
    monkeypatch.setattr(attention, "cudnn_version", lambda: 91501)
    assert prefers_cudnn((10, 1)) == torch_at_least(2, 9)  # torch 2.8: never (see prefers_cudnn)
    monkeypatch.setattr(attention, "_cuda_major", lambda: 12)  # CUDA 12: minor 0 or 3 only
    expected = [True, True, False, True, False] if torch_at_least(2, 9) else [False] * 5
    assert [prefers_cudnn(c) for c in [(9, 0), (10, 0), (10, 1), (10, 3), (12, 0)]] == expected


def test_cudnn_can_be_deprioritized_by_the_environment(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert choose(SM90, default_order=True) == "flash"
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "true")  # c10::utils::check_env reads "1" only
    assert choose(SM90, default_order=True) == ("cudnn" if H100_PREFERS_CUDNN else "flash")


# -- acceptance: the saved tensors of the chosen backend, byte for byte --------------------------
B, H, L, D = 2, 4, 100, 64


def run_attention(gpu: str, masked: bool) -> tuple[str, dict[str, tuple], int]:
    """Self-attention in bfloat16 on fake CPU tensors under CudaKernels(gpu=...): the backward
    node's name, its saved tensors (shape, dtype, storage bytes) and the activation bytes."""
    gc.collect()
    fake = FakeTensorMode()
    with fake:
        q, k, v = (torch.empty(B, H, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mask = torch.ones(L, L, dtype=torch.bool) if masked else None
    with modelled(fake, gpu) as (tracker, kernels):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        activation = tracker.by_category()["activation"]
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    node = out.grad_fn
    saved = {
        name.removeprefix("_saved_"): (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        for name in dir(node)
        if name.startswith("_saved_") and isinstance(t := getattr(node, name), torch.Tensor)
    }
    return type(node).__name__, saved, activation


def described(**tensors: torch.Tensor) -> dict[str, tuple]:
    return {name: (tuple(t.shape), t.dtype, t.untyped_storage().nbytes()) for name, t in tensors.items()}


def inputs() -> dict[str, torch.Tensor]:
    q = meta(B, H, L, D, grad=True)
    return {"query": q, "key": q.clone(), "value": q.clone()}


def test_sm80_bfloat16_keeps_what_flash_attention_keeps():
    node, saved, activation = run_attention("A100", masked=False)
    assert node == "ScaledDotProductFlashAttentionBackward0"
    # sdp_utils.cpp on sm80: flash first (Context.h's order); attention.cpp calls it with no padding
    # (head dim 64) and the scale 1/sqrt(64). Its CUDA-side op on meta gives what it keeps:
    qkv = inputs()
    out, lse, _, _, _, _, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        *qkv.values(), 0.0, False, False, scale=0.125
    )
    expected = described(**qkv, output=out, logsumexp=lse, rng_state=rng_state, unused=unused)
    assert saved == expected
    assert saved["logsumexp"] == ((B, H, L), torch.float32, B * H * L * 4)
    assert activation == sum(blocks(t.untyped_storage().nbytes()) for t in (out, lse, rng_state, unused))
    assert activation == 102400 + 3584 + 512 + 512


def test_sm90_bfloat16_keeps_what_cudnn_attention_keeps():
    node, saved, activation = run_attention("H100", masked=False)
    assert node == "ScaledDotProductCudnnAttentionBackward0"
    # sdp_utils.cpp on sm90 with cuDNN > 9.15.0: cuDNN first; attention.cpp computes the log-sum-exp
    # (softmax statistics) because the inputs require grad.
    qkv = inputs()
    out, stats, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *qkv.values(), None, True, 0.0, False, False
    )
    expected = described(**qkv, output=out, logsumexp=stats, philox_seed=seed, philox_offset=offset)
    assert saved == expected
    # the statistics' shape (_meta_registrations.py: meta__scaled_dot_product_cudnn_attention):
    # (B, H, L) in torch 2.8, (B, H, L, 1) in 2.11 and 2.13; the same bytes
    stats_shape = (B, H, L, 1) if torch_at_least(2, 9) else (B, H, L)
    assert saved["logsumexp"] == (stats_shape, torch.float32, B * H * L * 4)
    assert activation == sum(blocks(t.untyped_storage().nbytes()) for t in (out, stats, seed, offset))
    assert activation == 102400 + 3584 + 512 + 512


def test_sm80_bfloat16_with_a_bool_mask_keeps_what_efficient_attention_keeps():
    node, saved, activation = run_attention("A100", masked=True)
    assert node == "ScaledDotProductEfficientAttentionBackward0"
    # attention.cpp: convert_boolean_attn_mask makes a bfloat16 additive mask; preprocess_mask pads
    # its last dim (stride 100 is not a multiple of 8) to 104 and expands it to (B, H, L, L).
    additive = torch.zeros(L, L + 4, dtype=torch.bfloat16, device="meta")[:, :L].expand(B, H, L, L)
    qkv = inputs()
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        *qkv.values(), additive, True, 0.0, False
    )
    expected = described(
        **qkv, attn_bias=additive, output=out, log_sumexp=lse, philox_seed=seed, philox_offset=offset
    )
    assert saved == expected
    assert saved["log_sumexp"] == ((B, H, 128), torch.float32, B * H * 128 * 4)  # padded to 32 queries
    kept = (additive, out, lse, seed, offset)
    assert activation == sum(blocks(t.untyped_storage().nbytes()) for t in kept)
    assert activation == 20992 + 102400 + 4096 + 512 + 512


def test_sm90_bfloat16_with_a_bool_mask_keeps_what_cudnn_attention_keeps():
    node, saved, activation = run_attention("H100", masked=True)
    assert node == "ScaledDotProductCudnnAttentionBackward0"
    # attention.cpp: convert_boolean_attn_mask_cudnn makes a bfloat16 mask (-65504 where masked).
    additive = torch.zeros(L, L, dtype=torch.bfloat16, device="meta")
    qkv = inputs()
    out, stats, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *qkv.values(), additive, True, 0.0, False, False
    )
    expected = described(
        **qkv, attn_bias=additive, output=out, logsumexp=stats, philox_seed=seed, philox_offset=offset
    )
    assert saved == expected
    kept = (additive, out, stats, seed, offset)
    assert activation == sum(blocks(t.untyped_storage().nbytes()) for t in kept)
    assert activation == 20480 + 102400 + 3584 + 512 + 512


def test_cudnn_attention_backward_runs_on_fake_tensors():
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(B, H, L, D, dtype=torch.bfloat16, requires_grad=True)
    with fake, CudaKernels(gpu="H100"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert q.grad.shape == q.shape and q.grad.dtype == torch.bfloat16


# -- grouped-query attention (enable_gqa) -------------------------------------------------------
# torch 2.13's sdp_utils_cpp.h lines 357-446 (check_grouped_query_attention,
# check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>): flash takes GQA
# with key heads == value heads dividing the query heads, cuDNN (<true, false>, pytorch#150337)
# with key and value heads each dividing them, memory-efficient attention not at all (<false>
# until pytorch#191085); without enable_gqa the heads must be equal.
def choose_gqa(
    capability: tuple[int, int],
    heads: tuple[int, int, int] = (8, 2, 2),
    dtype: torch.dtype = torch.bfloat16,
    mask: bool = False,
    enable_gqa: bool = True,
) -> str:
    hq, hk, hv = heads
    q, k, v = (
        meta(2, hq, 128, 64, dtype=dtype),
        meta(2, hk, 128, 64, dtype=dtype),
        meta(2, hv, 128, 64, dtype=dtype),
    )
    attn_mask = meta(128, 128, dtype=torch.bool) if mask else None
    with cudnn_first(capability):
        return select_backend(q, k, v, attn_mask, capability=capability, enable_gqa=enable_gqa)


@pytest.mark.parametrize(
    ("capability", "kwargs", "expected"),
    [
        (SM90, {}, "cudnn"),
        (SM80, {}, "flash"),
        (SM100, {}, "cudnn"),
        (SM90, {"mask": True}, "cudnn"),  # cuDNN takes a 2-D mask with GQA
        (SM80, {"mask": True}, "math"),  # flash: no mask; efficient: no GQA in 2.13
        (SM90, {"dtype": torch.float32}, "math"),  # only efficient takes float32, and not GQA
        (SM80, {"dtype": torch.float32}, "math"),
        (SM90, {"heads": (8, 2, 4)}, "cudnn"),  # cuDNN: key and value heads may differ
        (SM80, {"heads": (8, 2, 4)}, "math"),  # flash: check_grouped_query_attention<true>
        (SM90, {"heads": (8, 3, 3)}, "math"),  # 8 % 3: no fused backend
        (SM90, {"enable_gqa": False}, "math"),  # heads differ without enable_gqa
        (SM80, {"enable_gqa": False}, "math"),
        (SM90, {"heads": (8, 8, 8)}, "cudnn"),  # equal heads with enable_gqa: as without
    ],
)
def test_grouped_query_backend_follows_sdp_utils(capability, kwargs, expected):
    assert choose_gqa(capability, **kwargs) == expected


def test_grouped_query_attention_never_takes_efficient_attention():
    # with flash and cuDNN off, an sm80 bfloat16 GQA call has efficient (refused: no GQA) and math
    SDPBackend = torch.nn.attention.SDPBackend
    with torch.nn.attention.sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert choose_gqa(SM80) == "math"
        assert choose_gqa(SM80, heads=(8, 8, 8)) == "efficient"
    with torch.nn.attention.sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert choose_gqa(SM80) == "error"  # PyTorch: "No available kernel"


HQ, HKV, GL = 8, 2, 128  # a tiny Llama-style GQA attention: 8 query heads, 2 key/value heads


def run_gqa(gpu: str, repeat_kv: bool = False) -> dict:
    """Causal GQA attention in bfloat16 (B x 8 heads x 128 x 64; key/value B x 2 x 128 x 64) on fake
    CPU tensors under CudaKernels(gpu=...), forward then backward, tracked: with enable_gqa=True
    as transformers' sdpa_attention_forward calls it without a mask, or with key and value repeated
    as its repeat_kv does otherwise."""
    gc.collect()
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(B, HQ, GL, D, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(B, HKV, GL, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grad_out = torch.empty(B, HQ, GL, D, dtype=torch.bfloat16)
    with modelled(fake, gpu) as (tracker, kernels):
        if repeat_kv:
            key, value = (
                t[:, :, None].expand(B, HKV, HQ // HKV, GL, D).reshape(B, HQ, GL, D) for t in (k, v)
            )
            out = F.scaled_dot_product_attention(query=q, key=key, value=value, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        activation = tracker.by_category()["activation"]
        before = tracker.memory_stats()["allocated_bytes.all.current"]
        node = out.grad_fn
        saved = {
            name.removeprefix("_saved_"): (tuple(t.shape), t.untyped_storage().nbytes())
            for name in dir(node)
            if name.startswith("_saved_") and isinstance(t := getattr(node, name), torch.Tensor)
        }
        out.backward(grad_out)
        stats = tracker.memory_stats()
    return {
        "node": type(node).__name__,
        "saved": saved,
        "activation": activation,
        "before_backward": before,
        "backward_peak": stats["allocated_bytes.all.peak"],
        "after_backward": stats["allocated_bytes.all.current"],
        "grads": [tuple(t.grad.shape) for t in (q, k, v)],
        "kernels": kernels,
    }


# Bytes, by hand (B=2, bfloat16 = 2 B, float32 = 4 B; every size here is a multiple of 512 B except
# the 8-byte seed/offset tensors, which take one 512 B block each):
Q_BYTES = B * HQ * GL * D * 2  # 262,144: the query, the output, the query's gradient
KV_BYTES = B * HKV * GL * D * 2  # 65,536: key or value, unrepeated, and their gradients
STATS_BYTES = B * HQ * GL * 4  # 8,192: float32 softmax statistics / log-sum-exp, one per query row


@pytest.mark.parametrize(
    ("gpu", "node", "stats"),
    [
        # sm90, cuDNN > 9.15.0: cuDNN first; attention.cpp (scaled_dot_product_attention, case
        # cudnn_attention) passes key and value unrepeated. What it allocates, torch 2.13
        # _meta_registrations.py line 6220 (meta__scaled_dot_product_cudnn_attention): the output
        # (B, Hq, L, Dv) in the query's layout, float32 stats (B, Hq, L, 1), int64 seed and offset.
        ("H100", "ScaledDotProductCudnnAttentionBackward0", "logsumexp"),
        # sm80: flash first; attention.cpp pads nothing (head dim 64) and passes key and value
        # unrepeated; line 6107 (meta__scaled_dot_product_flash_attention): output empty_like(query),
        # float32 logsumexp (B, Hq, L), a (2,) uint64 rng state and a () uint64.
        ("A100", "ScaledDotProductFlashAttentionBackward0", "logsumexp"),
    ],
)
def test_grouped_query_attention_keeps_key_and_value_unrepeated(gpu, node, stats):
    run = run_gqa(gpu)
    assert run["kernels"].substituted == {"scaled_dot_product_attention": 1}
    assert run["kernels"].caveats == []
    assert run["node"] == node
    assert run["saved"]["key"] == ((B, HKV, GL, D), KV_BYTES)
    assert run["saved"]["value"] == ((B, HKV, GL, D), KV_BYTES)
    assert run["saved"]["output"] == ((B, HQ, GL, D), Q_BYTES)
    assert run["saved"][stats][1] == STATS_BYTES
    # forward: output + statistics + two 512 B blocks (cuDNN seed/offset; flash rng state/unused)
    assert run["activation"] == Q_BYTES + STATS_BYTES + 512 + 512 == 271_360
    # backward (line 6348 meta__scaled_dot_product_flash_backward / 6605 ..._cudnn_backward):
    # empty_like(query), empty_like(key), empty_like(value), allocated while the saved tensors live
    assert run["grads"] == [(B, HQ, GL, D), (B, HKV, GL, D), (B, HKV, GL, D)]
    assert run["backward_peak"] == run["before_backward"] + Q_BYTES + 2 * KV_BYTES == 664_576
    # the graph is freed: the output (held by the test) and the three gradients remain
    assert run["after_backward"] == Q_BYTES + Q_BYTES + 2 * KV_BYTES


def test_repeated_key_and_value_keep_the_repeated_copies():
    # transformers' repeat_kv (expand + reshape) copies key and value to the query's 8 heads; the
    # same cuDNN kernel then keeps both copies besides its output and statistics
    run = run_gqa("H100", repeat_kv=True)
    assert run["node"] == "ScaledDotProductCudnnAttentionBackward0"
    assert run["saved"]["key"] == ((B, HQ, GL, D), Q_BYTES)
    assert run["activation"] == 2 * Q_BYTES + Q_BYTES + STATS_BYTES + 512 + 512 == 795_648
    assert run["grads"] == [(B, HQ, GL, D), (B, HKV, GL, D), (B, HKV, GL, D)]
    assert run["activation"] - run_gqa("H100")["activation"] == 2 * Q_BYTES
