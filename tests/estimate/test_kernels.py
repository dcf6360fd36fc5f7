"""CudaKernels: a data-free run on CPU keeps what CUDA's kernels keep, byte for byte."""

from __future__ import annotations

import contextlib
import gc
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import memlab
from memlab._torch_version import torch_at_least
from memlab.estimate import sizes
from memlab.estimate.kernels import DIFFERENCES, CudaKernels, cuda_optimizer_defaults

BLOCK = 512  # the CUDA caching allocator's rounding


def blocks(nbytes: int) -> int:
    return math.ceil(nbytes / BLOCK) * BLOCK


def meta(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


# -- the transformer block ---------------------------------------------------------------------
B, L, E, HEADS, FF, P = 2, 5, 16, 2, 32, 0.1


def saved_bytes(cuda: bool) -> tuple[int, int, CudaKernels]:
    """Activation bytes after the forward of a TransformerEncoderLayer in training, and the peak
    allocated over forward and backward, in a fake run with or without CudaKernels."""
    gc.collect()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        layer = torch.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=P, batch_first=True)
        x = torch.randn(B, L, E)
    kernels = CudaKernels()
    with fake, memlab.TensorTracker(history=True) as tracker, kernels if cuda else contextlib.nullcontext():
        out = layer(x)
        activation = tracker.by_category()["activation"]
        out.sum().backward()
    assert layer.linear1.weight.grad.shape == (FF, E)
    return activation, tracker.max_memory_allocated(), kernels


def cpu_only_bytes() -> int:
    """What the CPU path keeps that CUDA does not (docs-kernels.md): per dropout of n float32
    elements a float32 mask (4n B); per attention call on the math path with dropout the softmax
    output, the dropout mask and the dropped-out attention (B*H*L*S float32 each) and the scaled
    query and transposed key (B*H*L*E/H float32 each)."""
    dropout_masks = [4 * B * L * E, 4 * B * L * FF, 4 * B * L * E]
    attention = 3 * [4 * B * HEADS * L * L] + 2 * [4 * B * HEADS * L * (E // HEADS)]
    return sum(blocks(n) for n in dropout_masks + attention)


def cuda_only_bytes() -> int:
    """What CUDA's kernels keep instead, from PyTorch's CUDA-side ops on meta: the bool masks of
    aten.native_dropout and the output, log-sum-exp, seed and offset of the efficient attention."""
    masks = [
        torch.ops.aten.native_dropout(meta(*shape), P, True)[1]
        for shape in [(B, L, E), (B, L, FF), (B, L, E)]
    ]
    q = meta(B, HEADS, L, E // HEADS, grad=True)
    attention = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, P)
    return sum(blocks(t.untyped_storage().nbytes()) for t in [*masks, *attention])


def test_transformer_block_keeps_what_cuda_kernels_keep():
    cpu_activation, _, _ = saved_bytes(cuda=False)
    cuda_activation, _, kernels = saved_bytes(cuda=True)
    assert kernels.substituted == {"scaled_dot_product_attention": 1, "dropout": 3}
    assert kernels.caveats == []
    assert cpu_only_bytes() == 3 * 512 + 2 * 1024 + 2 * 1024 + 1536  # attention matrices, q and k; masks
    assert cuda_only_bytes() == 3 * 512 + 1024 + 512 + 2 * 512  # masks; output, log-sum-exp, seed, offset
    assert cpu_activation - cuda_activation == cpu_only_bytes() - cuda_only_bytes() == 3072
    assert cuda_activation == cpu_activation - cpu_only_bytes() + cuda_only_bytes() == 16384


def test_transformer_block_backward_runs_cuda_backward_ops():
    ops = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        layer = torch.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=P, batch_first=True)
        x = torch.randn(B, L, E)
        with CudaKernels(), Ops():
            layer(x).sum().backward()
    assert ops.count(torch.ops.aten._scaled_dot_product_efficient_attention_backward.default) == 1
    assert ops.count(torch.ops.aten.native_dropout_backward.default) == 3
    assert torch.ops.aten.bernoulli_.float not in ops  # the CPU path's float masks


# -- dropout -------------------------------------------------------------------------------------
def dropout_activation(p: float, training: bool = True, n: int = 1000) -> tuple[int, CudaKernels]:
    gc.collect()
    x = meta(n, grad=True)
    with memlab.TensorTracker(history=True) as tracker, CudaKernels() as kernels:
        y = F.dropout(x, p, training)
        activation = tracker.by_category()["activation"]
    del y
    return activation, kernels


def test_dropout_keeps_a_bool_mask():
    activation, kernels = dropout_activation(0.5)
    assert kernels.substituted == {"dropout": 1}
    assert activation == 1024  # 1,000 bool elements; the CPU path keeps 4,000 B (4,096 B)


def test_dropout_outside_the_fused_kernel_is_left_alone():
    # p=1 multiplies by zeros (Dropout.cpp: _dropout), on CUDA as on CPU
    for p, training, kept in [(0.0, True, 0), (1.0, True, 1024), (0.5, False, 0)]:
        activation, kernels = dropout_activation(p, training)
        assert kernels.substituted == {}
        assert activation == kept
    _, kernels = dropout_activation(0.5, n=0)
    assert kernels.substituted == {}


# -- attention (the choice per GPU: test_attention.py) ----------------------------------------------
def attention_activation(
    dtype: torch.dtype, head: int, cuda: bool = True, gpu: str = "A100"
) -> tuple[int, CudaKernels]:
    """Activation bytes of self-attention on fake CPU tensors (2 x 2 heads x 40 x head)."""
    gc.collect()
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(2, 2, 40, head, dtype=dtype, requires_grad=True)
    kernels = CudaKernels(gpu=gpu)
    with fake, memlab.TensorTracker(history=True) as tracker, kernels if cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, q, q)
        activation = tracker.by_category()["activation"]
    assert out.shape == q.shape and out.dtype == dtype
    return activation, kernels


def test_flash_attention_keeps_output_and_log_sum_exp():
    activation, kernels = attention_activation(torch.float16, 8)
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    # output 2*2*40*8 float16 (2,560 B) + log-sum-exp 2*2*40 float32 (640 B) + seed 16 B + offset 8 B
    assert activation == 2560 + 1024 + 512 + 512


def test_cudnn_attention_keeps_output_and_softmax_statistics():
    activation, kernels = attention_activation(torch.float16, 8, gpu="H100")
    assert kernels.gpu.sm == "sm90"
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    # output 2,560 B + statistics 2*2*40*1 float32 (640 B) + seed 8 B + offset 8 B
    assert activation == 2560 + 1024 + 512 + 512


def test_flash_attention_pads_the_head_dim_to_8():
    activation, kernels = attention_activation(torch.float16, 6, gpu="H100")  # cuDNN needs head % 8
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    # the padded query/key/value (3 x 2*2*40*8 float16) are kept, then the output and log-sum-exp
    assert activation == 3 * 2560 + 2560 + 1024 + 512 + 512


def test_efficient_attention_pads_the_log_sum_exp_to_32():
    activation, kernels = attention_activation(torch.float32, 8)
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    # output 2*2*40*8 float32 (5,120 B) + log-sum-exp 2*2*64 float32 (1,024 B) + seed + offset
    assert activation == 5120 + 1024 + 512 + 512


def test_attention_on_math_keeps_cuda_math_tensors():
    activation, kernels = attention_activation(torch.float64, 8)
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    cpu_activation, _ = attention_activation(torch.float64, 8, cuda=False)
    # CPU picks its flash kernel for float64 without dropout; CUDA the math path: the scaled query
    # and key (2*2*40*8 float64 each) and the softmax output (2*2*40*40 float64)
    assert activation == 2 * 10240 + 51200
    # CPU flash: output and a 2*2*40 log-sum-exp, float64 as the CPU kernel makes it (1,280 B in a
    # 1,536 B block); the meta kernel of a torch before sizes.CPU_FLASH_LSE_META_FIXED_SINCE makes it
    # float32 (640 B in 1,024), which this bare fake run shows (an estimate corrects it: test_zoo)
    lse = 1536 if torch_at_least(*sizes.CPU_FLASH_LSE_META_FIXED_SINCE) else 1024
    assert cpu_activation == 10240 + lse


def test_float32_grouped_query_attention_runs_cuda_math_with_key_and_value_repeated():
    # torch 2.13: no fused backend takes float32 GQA (flash and cuDNN need float16/bfloat16,
    # memory-efficient attention no GQA), so CUDA runs _scaled_dot_product_attention_math, which
    # repeats key and value to the query's heads (pre_process_group_query_attention_input)
    gc.collect()
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(1, 4, 16, 8, requires_grad=True)
        k, v = (torch.empty(1, 2, 16, 8, requires_grad=True) for _ in range(2))
    with fake, memlab.TensorTracker(history=True) as tracker, CudaKernels(gpu="H100") as kernels:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        activation = tracker.by_category()["activation"]
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    assert kernels.caveats == []
    assert out.shape == (1, 4, 16, 8)
    # kept: the scaled query and the scaled repeated key (1*4*16*8 float32, 2,048 B each), the
    # repeated value (2,048 B) and the softmax output (1*4*16*16 float32, 4,096 B)
    assert activation == 3 * 2048 + 4096


# -- runs whose values matter --------------------------------------------------------------------
def real_step(kernels: CudaKernels | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=P, batch_first=True)
    x = torch.randn(B, L, E)
    with kernels if kernels is not None else contextlib.nullcontext():
        out = layer(x)
        out.sum().backward()
    return out.detach(), [p.grad for p in layer.parameters()]


def test_real_run_keeps_values_and_names_skipped_substitutions():
    out, grads = real_step(None)
    kernels = CudaKernels(data_free=False, gpu="H100")
    kernel_out, kernel_grads = real_step(kernels)
    assert torch.equal(out, kernel_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, kernel_grads, strict=True))
    assert kernels.substituted == {}
    assert kernels.caveats == [
        "aten.scaled_dot_product_attention (torch.float32, head dim 8) on H100 (sm90) runs "
        "aten._scaled_dot_product_efficient_attention, which keeps its output and a float32 log-sum-exp "
        "for backward; not substituted because values matter (data_free=False), so this run kept the "
        "CPU kernels' tensors.",
        "aten.dropout (p=0.1) on CUDA runs the fused aten.native_dropout, which keeps a 1-byte bool mask "
        "instead of a torch.float32 one of the input's size; not substituted because values matter "
        "(data_free=False), so this run kept the CPU kernels' tensors.",
    ]


def test_real_tensors_are_not_substituted_even_when_data_free():
    x = torch.ones(10, requires_grad=True)
    with CudaKernels() as kernels:
        F.dropout(x, 0.5)
    assert kernels.substituted == {}
    assert kernels.caveats == [
        "aten.dropout (p=0.5) on CUDA runs the fused aten.native_dropout, which keeps a 1-byte bool mask "
        "instead of a torch.float32 one of the input's size; not substituted because its inputs are real "
        "tensors, so this run kept the CPU kernels' tensors."
    ]


# -- unhandled differences: caveats ----------------------------------------------------------------
def test_recurrent_layers_are_a_caveat():
    with torch.device("meta"):
        gru = torch.nn.GRU(8, 4, batch_first=True)
        cell = torch.nn.LSTMCell(8, 4)
        x = torch.empty(2, 3, 8)
    with CudaKernels() as kernels:
        gru(x)[0].sum().backward()
        gru(x)
        cell(x[:, 0])
    assert kernels.substituted == {}
    assert kernels.caveats == [
        "aten.gru (torch.nn.GRU): on CUDA cuDNN runs it (aten._cudnn_rnn), which copies the weights into "
        "one flat buffer and keeps a reserve buffer for backward whose size only cuDNN knows "
        "(cudnnGetRNNTrainingReserveSize); not modelled, so this run counts the CPU kernels' tensors.",
        "aten.lstm_cell (torch.nn.LSTMCell): on CUDA it runs the fused aten._thnn_fused_lstm_cell, which "
        "keeps one workspace of the gates for backward instead of the CPU path's gate tensors; not "
        "modelled, so this run counts the CPU kernels' tensors.",
    ]


def test_cuda_autocast_is_a_caveat_of_a_real_run():
    x = torch.ones(4, 4)
    with CudaKernels(data_free=False) as kernels, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast."
        with torch.autocast("cuda"):
            assert (x @ x).dtype == torch.float32
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
            x @ x
        with torch.autocast("cpu"):
            x @ x
    assert kernels.substituted == {}
    assert kernels.caveats == [
        "torch.autocast('cuda', dtype=torch.float16) ran disabled, in float32 for float32 inputs: PyTorch "
        "without CUDA disables it; on a GPU, CUDA's autocast (aten/src/ATen/autocast_mode.cpp) runs "
        "matmuls, convolutions and linear layers in torch.float16 and keeps float32 for softmax, norms and "
        "losses, with smaller activations and a torch.float16 copy of each weight; values matter here "
        "(data_free=False), so it was not modelled."
    ]


def test_exit_restores_the_cpu_kernels_and_autocast():
    enter = torch.amp.autocast_mode.autocast.__enter__
    with CudaKernels() as kernels:
        pass
    F.dropout(meta(10), 0.5)
    assert kernels.substituted == {}
    assert torch.amp.autocast_mode.autocast.__enter__ is enter


def test_one_at_a_time():
    with CudaKernels(), pytest.raises(RuntimeError, match="already entered"):
        CudaKernels().__enter__()
    with CudaKernels() as kernels:  # usable again after the failed entry
        F.dropout(meta(10, grad=True), 0.5)
    assert kernels.substituted == {"dropout": 1}


def test_data_free_must_be_a_bool():
    with pytest.raises(TypeError, match="data_free must be True or False, got str 'yes'"):
        CudaKernels(data_free="yes")


# -- optimizer defaults --------------------------------------------------------------------------
def test_optimizer_defaults_to_foreach():
    params = [torch.nn.Parameter(torch.zeros(3))]
    adamw = torch.optim.AdamW(
        [{"params": params}, {"params": [torch.nn.Parameter(torch.zeros(2))], "foreach": False}]
    )
    assert cuda_optimizer_defaults(adamw) == ["param_groups[0]['foreach']"]
    assert [group["foreach"] for group in adamw.param_groups] == [True, False]
    assert cuda_optimizer_defaults(adamw) == []


def test_optimizer_defaults_leave_what_cuda_would_not_change():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert cuda_optimizer_defaults(torch.optim.SGD(params, lr=0.1, fused=True)) == []
    assert cuda_optimizer_defaults(torch.optim.SGD(params, lr=0.1, differentiable=True)) == []
    assert cuda_optimizer_defaults(torch.optim.Adam(params, lr=torch.tensor(0.01))) == []
    assert cuda_optimizer_defaults(torch.optim.SGD(params, lr=0.1)) == ["param_groups[0]['foreach']"]


def test_optimizer_defaults_need_an_optimizer():
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        cuda_optimizer_defaults([torch.zeros(1)])


# -- the table ---------------------------------------------------------------------------------------
def test_differences_table():
    assert [(d.name, d.handled) for d in DIFFERENCES] == [
        ("dropout", True),
        ("scaled_dot_product_attention", True),
        ("optimizer_foreach", True),
        ("recurrent", False),
        ("autocast", True),
        ("softmax_half_to_float", True),
        ("grad_scaler", True),
    ]
    assert all(d.source.startswith(("aten/src/ATen/", "torch/")) and ": " in d.source for d in DIFFERENCES)


@pytest.mark.parametrize(
    ("dtype", "kept"),
    [
        # efficient (attention.cpp): the additive float32 mask made of the bool one (40*40*4 B; its
        # strides are multiples of 8, so preprocess_mask only expands it), output, log-sum-exp, seed,
        # offset
        (torch.float32, 6656 + 5120 + 1024 + 512 + 512),
        (torch.float64, 2 * 10240 + 51200),  # math: scaled query and key, softmax output
    ],
)
def test_attention_with_a_bool_mask(dtype, kept):
    # both paths turn the bool mask into an additive one (-inf where masked); efficient keeps it
    q = meta(2, 2, 40, 8, dtype=dtype, grad=True)
    mask = meta(40, 40, dtype=torch.bool)
    with memlab.TensorTracker(history=True) as tracker, CudaKernels() as kernels:
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        activation = tracker.by_category()["activation"]
    assert kernels.substituted == {"scaled_dot_product_attention": 1}
    assert out.shape == q.shape
    assert activation == kept


def test_gpu_is_resolved_and_checked():
    assert CudaKernels(gpu="sm80").gpu.name == "A100"
    assert CudaKernels(gpu=(9, 0)).gpu.name == "H100"
    assert CudaKernels().gpu.name == "H100"  # no CUDA here: DEFAULT_GPU
    with pytest.raises(ValueError, match="gpu 'Z80' is not a GPU memlab knows; valid: a GPU name"):
        CudaKernels(gpu="Z80")
