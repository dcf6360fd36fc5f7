"""Run the attention kernel :func:`memlab.estimate.attention.select_backend` picked, as
``scaled_dot_product_attention`` in ``aten/src/ATen/native/transformers/attention.cpp`` runs it on
CUDA: the mask conversions and padding it does first, then PyTorch's CUDA-side op, whose meta kernel
runs on fake and ``meta`` tensors, so a tracker counts what it allocates and keeps for backward."""

from __future__ import annotations

import math

import torch

from memlab.estimate.attention import _requires_grad

__all__ = ["run_backend"]


def _boolean_to_additive(
    attn_mask: torch.Tensor | None, dtype: torch.dtype, fill: float
) -> torch.Tensor | None:
    """attention.cpp: ``convert_boolean_attn_mask`` (``fill`` -inf) and its cuDNN variant
    ``convert_boolean_attn_mask_cudnn`` (``fill`` -65504): a bool mask becomes an additive one of
    the query's dtype; other masks pass through."""
    if attn_mask is None or attn_mask.dtype is not torch.bool:
        return attn_mask
    if math.isinf(fill):
        zero = torch.scalar_tensor(0.0, dtype=dtype, device=attn_mask.device)
        return torch.where(attn_mask.logical_not(), fill, zero)
    # The cuDNN variant's zero is a host scalar (no device given), which a GPU does not allocate.
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(
        attn_mask.logical_not(), fill
    )


def _preprocess_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """attention.cpp: ``preprocess_mask``: pad the last dim when a stride is not a multiple of 8
    (``aligned_tensor<8>``; ``pad_bias<8>`` pads by 8 - size % 8, then slices back), then expand
    to (B, H, L, S)."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        size = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 8 - size % 8))[..., :size]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def run_backend(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Run ``backend`` (from :func:`memlab.estimate.attention.select_backend`, not ``"error"``) as
    attention.cpp's ``scaled_dot_product_attention`` runs it on CUDA, and return the output.

    What each keeps for backward: cuDNN its output, float32 softmax statistics (B, H, L, 1), the
    philox seed and offset (two 8-byte device tensors) and the additive mask it made of a bool one;
    flash its output, a float32 log-sum-exp (B, H, L), an rng state (2 x uint64) and an unused
    uint64, and the query/key/value padded to a head dim that is a multiple of 8; memory-efficient
    its output, a float32 log-sum-exp padded to a multiple of 32 queries, seed and offset, and the
    (padded) additive mask; math the scaled query and key and the softmax output.

    Grouped-query attention (``enable_gqa``, fewer key/value heads): cuDNN and flash get the key
    and value as they are (attention.cpp), so they keep them unrepeated, and their output and
    statistics have the query's heads; the math path repeats key and value to the query's heads
    (``repeat_interleave``) and keeps the repeated copies. The backward of cuDNN and flash gives key
    and value gradients of the key's and value's heads; flash's CUDA backward also allocates, and
    frees before it returns, two scratch tensors of the query's heads (``flash_api.cpp``:
    ``dk_expanded``, ``dv_expanded``, B x S x Hq x D each, summed into dk and dv), which the meta
    kernel does not, like its other scratch (``softmax_d``, ``dq_accum``)."""
    requires_grad = _requires_grad(query, key, value)  # attention.cpp: should_compute_logsumexp
    if backend == "cudnn":
        mask = _boolean_to_additive(attn_mask, query.dtype, -65504.0)
        return torch.ops.aten._scaled_dot_product_cudnn_attention.default(
            query, key, value, mask, requires_grad, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "flash":
        return _flash(query, key, value, dropout_p, is_causal, scale)
    mask = _boolean_to_additive(attn_mask, query.dtype, -math.inf)
    if backend == "efficient":
        if mask is not None:
            mask = _preprocess_mask(mask, query, key)
        return torch.ops.aten._scaled_dot_product_efficient_attention.default(
            query, key, value, mask, requires_grad, dropout_p, is_causal, scale=scale
        )[0]
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    # attention.cpp: pad the head dim to a multiple of 8 (pad_last_dim<8>), scale by the original
    # head dim, then cut the output back (post_process_flash_output).
    head = query.size(-1)
    pad = -head % 8
    if pad:
        query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
    if scale is None:
        scale = 1.0 / math.sqrt(head)
    out = torch.ops.aten._scaled_dot_product_flash_attention.default(
        query, key, value, dropout_p, is_causal, False, scale=scale
    )[0]
    return out[..., :head] if pad else out
