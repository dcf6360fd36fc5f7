"""A zoo of common layers, ops and losses: each step's estimate equals the same step run for real on CPU
under a TensorTracker, byte for byte (allocated, active and reserved peaks, allocated at the end).

A kernel whose fake (meta) outputs hold other storages than the real CPU kernel allocates makes an
estimate silently wrong; memlab.estimate.sizes corrects the known ones, and this zoo fails on any
other. Where the real size cannot be known without data, the case asserts instead that the estimate
names the op in its caveats (a deliberate decision, written next to the case).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memlab
from memlab._torch_version import torch_at_least
from memlab.estimate.result import RERUN
from memlab.estimate.sizes import CORRECTIONS, CPU_FLASH_LSE_META_FIXED_SINCE
from memlab.history import categories

KEYS = (
    "allocated_bytes.all.peak",
    "active_bytes.all.peak",
    "reserved_bytes.all.peak",
    "allocated_bytes.all.current",
)
R = torch.randn


def backward(out: Any) -> torch.Tensor:
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    return out


def layer(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return backward(module(x))


def then(f: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A step: ``f`` applied to the module's output, then backward."""

    def step(module: nn.Module, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return backward(f(module(x), *rest))

    return step


def loss(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A step: the loss ``f`` of the module's output and a target, then backward."""

    def step(module: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = f(module(x), target)
        out.backward()
        return out

    return step


def pair(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A step: the loss ``f`` of two outputs of the module and a target, then backward."""

    def step(module: nn.Module, a: torch.Tensor, b: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = f(module(a), module(b), target)
        out.backward()
        return out

    return step


def triplet(module: nn.Module, a: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    out = F.triplet_margin_loss(module(a), module(p), module(n))
    out.backward()
    return out


def attention(causal: bool = False) -> Callable[..., torch.Tensor]:
    def step(module: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = module(x).view(8, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return backward(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal))

    return step


def self_attention(module: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    return backward(module(x, x, x))


def ctc(module: nn.Module, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    out = F.ctc_loss(module(x).log_softmax(-1), targets, torch.full((16,), 50), lengths)
    out.backward()
    return out


def inference(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = module(x)
    return out[0] if isinstance(out, tuple) else out


def bags(module: nn.EmbeddingBag, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return backward(module(indices, offsets))


def spectrogram(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    window = torch.kaiser_window(256)
    spectrum = torch.stft(module(x).flatten(), 256, window=window, return_complex=True).abs()
    return backward(spectrum)


def sparse_coalesced(module: nn.Embedding, indices: torch.Tensor) -> torch.Tensor:
    out = backward(module(indices))
    module.weight.grad = module.weight.grad.coalesce()
    return out


def conv(channels: int = 8, dims: int = 2) -> nn.Module:
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](channels, channels, 1)


def after(first: nn.Module, second: nn.Module) -> nn.Module:
    return nn.Sequential(first, second)


def linear() -> nn.Module:
    return nn.Linear(128, 64)


# The corrections (memlab.estimate.sizes.CORRECTIONS, by name) a case goes through.
BATCH_NORM = ("aten.native_batch_norm_backward",)
BAG = ("aten._embedding_bag",)
CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"
ONEDNN_LSTM = ("aten.mkldnn_rnn_layer", "aten.mkldnn_rnn_layer_backward")
COLUMNS = ("aten.col2im / aten.im2col",)
WINDOW = ("aten.kaiser_window",)
LOSS = ("full-storage losses",)
SPARSE_CLONE = ("aten.clone of a sparse COO tensor",)

N = 512  # rows for the losses


def labels() -> torch.Tensor:
    return torch.randint(0, 64, (N,))


def values() -> torch.Tensor:
    return R(N, 64)


def probabilities() -> torch.Tensor:
    return torch.rand(N, 64)


def signs() -> torch.Tensor:
    return torch.sign(R(N, 64))


def sign() -> torch.Tensor:
    return torch.sign(R(N))


def ranking(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.margin_ranking_loss(a.sum(-1), b.sum(-1), target)


T, B, C, S = 50, 16, 20, 30  # CTC: input length, batch, classes, target length


@dataclass(frozen=True)
class Case:
    """``build()`` returns ``(step, module, *inputs)``. ``method``: how the estimate runs (``"cpu"``
    where an op's output depends on values). ``caveat``: the op a case cannot be exact for, which
    the estimate must name instead. ``corrects``: the size corrections
    (:data:`memlab.estimate.sizes.CORRECTIONS`) the case goes through."""

    build: Callable[[], tuple[Any, ...]]
    method: str = "fake"
    caveat: str | None = None
    corrects: tuple[str, ...] = ()


def on_linear(f: Callable[..., torch.Tensor], target: Callable[[], torch.Tensor], **case: Any) -> Case:
    """A loss case: ``f`` of a Linear(128, 64)'s output on N rows and ``target()``."""
    return Case(lambda: (loss(f), linear(), R(N, 128), target()), **case)


ZOO: dict[str, Case] = {
    # convolutions
    "conv1d": Case(lambda: (layer, nn.Conv1d(16, 32, 5, padding=2), R(8, 16, 512))),
    "conv2d": Case(lambda: (layer, nn.Conv2d(16, 32, 3, padding=1), R(8, 16, 64, 64))),
    "conv2d_depthwise": Case(lambda: (layer, nn.Conv2d(32, 32, 3, padding=1, groups=32), R(8, 32, 32, 32))),
    "conv2d_channels_last": Case(
        lambda: (layer, nn.Conv2d(16, 32, 3), R(8, 16, 32, 32).to(memory_format=torch.channels_last))
    ),
    "conv3d": Case(lambda: (layer, nn.Conv3d(4, 8, 3, padding=1), R(2, 4, 16, 32, 32))),
    "conv_transpose1d": Case(lambda: (layer, nn.ConvTranspose1d(16, 8, 4, stride=2), R(8, 16, 256))),
    "conv_transpose2d": Case(
        lambda: (layer, nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), R(8, 16, 32, 32))
    ),
    "conv_transpose3d": Case(lambda: (layer, nn.ConvTranspose3d(4, 4, 2, stride=2), R(2, 4, 8, 16, 16))),
    # norms: on the input (no grad_input) and after a layer (grad_input)
    "batch_norm1d": Case(lambda: (layer, nn.BatchNorm1d(64), R(256, 64, 32)), corrects=BATCH_NORM),
    "batch_norm2d": Case(lambda: (layer, nn.BatchNorm2d(32), R(16, 32, 32, 32)), corrects=BATCH_NORM),
    "batch_norm2d_after_conv": Case(
        lambda: (layer, after(conv(32), nn.BatchNorm2d(32)), R(16, 32, 32, 32)), corrects=BATCH_NORM
    ),
    "batch_norm3d": Case(lambda: (layer, nn.BatchNorm3d(8), R(4, 8, 16, 16, 16)), corrects=BATCH_NORM),
    "batch_norm_eval": Case(lambda: (layer, nn.BatchNorm1d(64).eval(), R(2048, 64)), corrects=BATCH_NORM),
    "layer_norm": Case(lambda: (layer, nn.LayerNorm(256), R(32, 64, 256))),
    "group_norm": Case(lambda: (layer, nn.GroupNorm(8, 32), R(16, 32, 32, 32))),
    "instance_norm2d": Case(
        lambda: (layer, nn.InstanceNorm2d(32, affine=True), R(16, 32, 32, 32)), corrects=BATCH_NORM
    ),
    "instance_norm1d_running_stats": Case(
        lambda: (layer, after(conv(32, 1), nn.InstanceNorm1d(32, track_running_stats=True)), R(16, 32, 256)),
        corrects=BATCH_NORM,
    ),
    "rms_norm": Case(lambda: (layer, nn.RMSNorm(256), R(32, 64, 256))),
    # embeddings
    "embedding": Case(lambda: (layer, nn.Embedding(10000, 128), torch.randint(0, 10000, (64, 128)))),
    "embedding_padding_idx": Case(
        lambda: (layer, nn.Embedding(10000, 128, padding_idx=0), torch.randint(0, 10000, (64, 128)))
    ),
    "embedding_max_norm": Case(
        lambda: (layer, nn.Embedding(1000, 64, max_norm=1.0), torch.randint(0, 1000, (64, 16)))
    ),
    "embedding_sparse": Case(
        lambda: (layer, nn.Embedding(1000, 64, sparse=True), torch.randint(0, 1000, (64, 16))),
        corrects=SPARSE_CLONE,
    ),
    # A sparse gradient coalesced: how many entries remain depends on which indices repeat.
    "embedding_sparse_coalesced": Case(
        lambda: (sparse_coalesced, nn.Embedding(1000, 64, sparse=True), torch.randint(0, 1000, (64, 16))),
        caveat="aten._coalesce",
        corrects=SPARSE_CLONE,
    ),
    "embedding_bag_sum": Case(
        lambda: (layer, nn.EmbeddingBag(10000, 128), torch.randint(0, 10000, (64, 32))), corrects=BAG
    ),
    "embedding_bag_mean": Case(
        lambda: (layer, nn.EmbeddingBag(10000, 128, mode="mean"), torch.randint(0, 10000, (64, 32))),
        corrects=BAG,
    ),
    "embedding_bag_max": Case(
        lambda: (layer, nn.EmbeddingBag(10000, 128, mode="max"), torch.randint(0, 10000, (64, 32))),
        corrects=BAG,
    ),
    "embedding_bag_sum_padding_idx": Case(
        lambda: (layer, nn.EmbeddingBag(1000, 64, padding_idx=0), torch.randint(0, 1000, (64, 1023))),
        corrects=BAG,
    ),
    "embedding_bag_include_last_offset": Case(
        lambda: (
            bags,
            nn.EmbeddingBag(1000, 64, mode="mean", include_last_offset=True),
            torch.randint(0, 1000, (4000,)),
            torch.arange(0, 4001, 50),
        ),
        corrects=BAG,
    ),
    "embedding_bag_inference": Case(
        lambda: (inference, nn.EmbeddingBag(1000, 64, mode="max"), torch.randint(0, 1000, (64, 1023))),
        corrects=BAG,
    ),
    # recurrent layers (an LSTM layer keeps oneDNN's workspace for backward: 12 MB each here)
    "rnn": Case(lambda: (layer, nn.RNN(64, 256, batch_first=True), R(32, 12, 64))),
    "rnn_relu_two_layers_bidirectional": Case(
        lambda: (layer, nn.RNN(64, 128, num_layers=2, nonlinearity="relu", bidirectional=True), R(6, 32, 64))
    ),
    "gru": Case(lambda: (layer, nn.GRU(64, 256, batch_first=True), R(32, 8, 64))),
    "gru_two_layers_bidirectional": Case(
        lambda: (layer, nn.GRU(64, 128, num_layers=2, bidirectional=True), R(4, 32, 64))
    ),
    "lstm": Case(lambda: (layer, nn.LSTM(64, 256, batch_first=True), R(32, 24, 64)), corrects=ONEDNN_LSTM),
    "lstm_two_layers_bidirectional": Case(
        lambda: (layer, nn.LSTM(64, 128, num_layers=2, bidirectional=True, dropout=0.1), R(24, 32, 64)),
        corrects=ONEDNN_LSTM,
    ),
    "lstm_no_bias_bfloat16": Case(
        lambda: (layer, nn.LSTM(32, 64, bias=False).bfloat16(), R(10, 8, 32).bfloat16()), corrects=ONEDNN_LSTM
    ),
    "lstm_projection": Case(lambda: (layer, nn.LSTM(64, 256, proj_size=64, batch_first=True), R(32, 6, 64))),
    "lstm_inference": Case(
        lambda: (inference, nn.LSTM(64, 256, num_layers=2), R(24, 32, 64)), corrects=ONEDNN_LSTM[:1]
    ),
    "lstm_cell": Case(lambda: (layer, nn.LSTMCell(64, 256), R(32, 64))),
    "gru_cell": Case(lambda: (layer, nn.GRUCell(64, 256), R(32, 64))),
    # attention
    "multihead_attention": Case(
        lambda: (self_attention, nn.MultiheadAttention(128, 4, batch_first=True), R(16, 64, 128))
    ),
    "scaled_dot_product_attention": Case(lambda: (attention(), nn.Linear(64, 192), R(8, 128, 64))),
    "scaled_dot_product_attention_causal": Case(
        lambda: (attention(causal=True), nn.Linear(64, 192), R(8, 128, 64))
    ),
    # float64: CPU flash keeps a float64 log-sum-exp, which torch 2.11's meta kernel makes float32
    "scaled_dot_product_attention_float64": Case(
        lambda: (attention(), nn.Linear(64, 192).double(), R(8, 128, 64).double()),
        corrects=() if torch_at_least(*CPU_FLASH_LSE_META_FIXED_SINCE) else (CPU_FLASH,),
    ),
    "scaled_dot_product_attention_mask": Case(
        lambda: (attention(), nn.Linear(64, 192), R(8, 128, 64), R(128, 128))
    ),
    # pooling
    "max_pool1d": Case(lambda: (layer, after(conv(8, 1), nn.MaxPool1d(3, 2)), R(16, 8, 512))),
    "max_pool2d": Case(lambda: (layer, after(conv(), nn.MaxPool2d(2)), R(16, 8, 64, 64))),
    "max_pool3d": Case(lambda: (layer, after(conv(4, 3), nn.MaxPool3d(2)), R(4, 4, 16, 32, 32))),
    "avg_pool1d": Case(lambda: (layer, after(conv(8, 1), nn.AvgPool1d(4)), R(16, 8, 512))),
    "avg_pool2d": Case(lambda: (layer, after(conv(), nn.AvgPool2d(3, 2, 1)), R(16, 8, 64, 64))),
    "adaptive_avg_pool2d": Case(lambda: (layer, after(conv(), nn.AdaptiveAvgPool2d(7)), R(16, 8, 64, 64))),
    "adaptive_max_pool2d": Case(lambda: (layer, after(conv(), nn.AdaptiveMaxPool2d(7)), R(16, 8, 64, 64))),
    "lp_pool2d": Case(lambda: (layer, after(conv(), nn.LPPool2d(2, 2)), R(16, 8, 64, 64))),
    # interpolation
    "upsample_nearest": Case(lambda: (layer, after(conv(), nn.Upsample(scale_factor=2)), R(8, 8, 32, 32))),
    "upsample_bilinear": Case(
        lambda: (layer, after(conv(), nn.Upsample(scale_factor=2, mode="bilinear")), R(8, 8, 32, 32))
    ),
    "interpolate_bicubic": Case(
        lambda: (then(lambda y: F.interpolate(y, size=(50, 70), mode="bicubic")), conv(), R(8, 8, 32, 32))
    ),
    "interpolate_trilinear": Case(
        lambda: (
            then(lambda y: F.interpolate(y, scale_factor=2, mode="trilinear")),
            conv(4, 3),
            R(2, 4, 8, 16, 16),
        )
    ),
    "interpolate_area": Case(
        lambda: (then(lambda y: F.interpolate(y, size=(20, 20), mode="area")), conv(), R(8, 8, 64, 64))
    ),
    # dropout, pixel shuffle, unfold / fold, a window
    "dropout": Case(lambda: (layer, after(nn.Linear(256, 256), nn.Dropout(0.5)), R(256, 256))),
    "dropout2d": Case(lambda: (layer, after(conv(), nn.Dropout2d(0.3)), R(16, 8, 32, 32))),
    "alpha_dropout": Case(lambda: (layer, after(nn.Linear(256, 256), nn.AlphaDropout(0.2)), R(256, 256))),
    "pixel_shuffle": Case(lambda: (layer, after(conv(16), nn.PixelShuffle(2)), R(8, 16, 32, 32))),
    "pixel_unshuffle": Case(lambda: (layer, after(conv(), nn.PixelUnshuffle(2)), R(8, 8, 32, 32))),
    "unfold": Case(
        lambda: (layer, after(conv(), nn.Unfold(3, padding=1)), R(8, 8, 32, 32)), corrects=COLUMNS
    ),
    "unfold_stride_above_kernel": Case(
        lambda: (layer, after(conv(4), nn.Unfold(2, stride=3)), R(8, 4, 64, 64)), corrects=COLUMNS
    ),
    "fold": Case(
        lambda: (layer, after(conv(72, 1), nn.Fold((32, 32), 3, padding=1)), R(8, 72, 1024)), corrects=COLUMNS
    ),
    "kaiser_window_spectrogram": Case(lambda: (spectrogram, nn.Linear(64, 64), R(256, 64)), corrects=WINDOW),
    # losses
    "cross_entropy": on_linear(F.cross_entropy, labels),
    "cross_entropy_label_smoothing": on_linear(partial(F.cross_entropy, label_smoothing=0.1), labels),
    "cross_entropy_probabilities": on_linear(F.cross_entropy, lambda: R(N, 64).softmax(-1)),
    "nll": on_linear(lambda o, y: F.nll_loss(o.log_softmax(-1), y), labels),
    "nll2d": Case(
        lambda: (
            loss(lambda o, y: F.nll_loss(o.log_softmax(1), y)),
            nn.Conv2d(8, 16, 1),
            R(8, 8, 32, 32),
            torch.randint(0, 16, (8, 32, 32)),
        )
    ),
    "mse": on_linear(F.mse_loss, values, corrects=LOSS),
    "l1": on_linear(F.l1_loss, values),
    "smooth_l1": on_linear(F.smooth_l1_loss, values, corrects=LOSS),
    "huber": on_linear(F.huber_loss, values),
    "binary_cross_entropy": on_linear(
        lambda o, y: F.binary_cross_entropy(o.sigmoid(), y), probabilities, corrects=LOSS
    ),
    "binary_cross_entropy_with_logits": on_linear(F.binary_cross_entropy_with_logits, probabilities),
    "kl_div": on_linear(
        lambda o, y: F.kl_div(o.log_softmax(-1), y, reduction="batchmean"), lambda: R(N, 64).softmax(-1)
    ),
    "soft_margin": on_linear(F.soft_margin_loss, signs, corrects=LOSS),
    "multilabel_soft_margin": on_linear(F.multilabel_soft_margin_loss, lambda: torch.rand(N, 64).round()),
    "multi_margin": on_linear(F.multi_margin_loss, labels),
    "multilabel_margin": on_linear(F.multilabel_margin_loss, lambda: torch.randint(-1, 64, (N, 64))),
    "hinge_embedding": on_linear(F.hinge_embedding_loss, signs),
    "poisson_nll": on_linear(F.poisson_nll_loss, probabilities),
    # gaussian_nll_loss checks that no variance is negative: a value read, which the data-free run has
    # (the variances are torch.ones: memlab.estimate.known computes them alongside).
    "gaussian_nll": on_linear(lambda o, y: F.gaussian_nll_loss(o, y, torch.ones(N, 64)), values),
    "cosine_embedding": Case(lambda: (pair(F.cosine_embedding_loss), linear(), R(N, 128), R(N, 128), sign())),
    "margin_ranking": Case(lambda: (pair(ranking), linear(), R(N, 128), R(N, 128), sign())),
    "triplet_margin": Case(lambda: (triplet, linear(), R(N, 128), R(N, 128), R(N, 128))),
    # CTC's output size depends on the target lengths' values: the estimate runs on CPU copies.
    "ctc": Case(
        lambda: (ctc, nn.Linear(32, C), R(T, B, 32), torch.randint(1, C, (B, S)), torch.randint(10, S, (B,))),
        method="cpu",
    ),
}


def tracked_run(step: Callable[..., Any], module: nn.Module, inputs: tuple[Any, ...]) -> dict[str, int]:
    """``step`` for real on CPU under a tracker that counts the arguments first, in the order an
    estimate adopts them (modules, then inputs)."""
    with memlab.TensorTracker(history=True, model=module) as tracker:
        tracker.adopt(roots=[module])
        tracker.adopt(roots=list(inputs), category=categories.INPUT)
        out = step(module, *inputs)
        stats = tracker.memory_stats()
    del out
    return stats


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("name", sorted(ZOO))
def test_estimate_of_a_step_equals_the_tracked_real_run(name: str) -> None:
    case = ZOO[name]
    torch.manual_seed(0)
    step, module, *inputs = case.build()

    estimate = memlab.estimate(step, module, *inputs)
    stats = tracked_run(step, module, tuple(inputs))

    assert estimate.method == case.method
    if case.method == "fake":
        assert estimate.tracker.real_sizes.applied == set(case.corrects)
    if case.caveat is None:
        assert estimate.caveats == ([RERUN] if case.method == "cpu" else [])
        assert {key: estimate.stats[key] for key in KEYS} == {key: stats[key] for key in KEYS}
    else:
        caveat = (
            f"{case.caveat} made a sparse tensor whose number of entries depends on tensor values, which a "
            f"data-free run does not have: it is counted as empty (0 bytes)"
        )
        assert caveat in estimate.caveats


def test_every_correction_is_exercised_by_a_case_and_the_zoo_has_at_least_25() -> None:
    assert set().union(*(case.corrects for case in ZOO.values())) == {c.name for c in CORRECTIONS}
    assert len(ZOO) >= 25
