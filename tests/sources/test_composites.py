"""Composite ops under inference mode: the tracker sees their parts, as with autograd on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memlab
from memlab.sources.composites import COMPOSITE_KERNELS, composite_kernel, has_composite_kernel

aten = torch.ops.aten


def layer_norm_peak(mode: type) -> int:
    """Peak allocated bytes of a layer norm of a 64x1024 float32 tensor under ``mode()``."""
    x, weight, bias = torch.randn(64, 1024), torch.ones(1024), torch.zeros(1024)
    with mode(), memlab.TensorTracker() as tracker:
        out = F.layer_norm(x, (1024,), weight, bias)
    assert out.shape == (64, 1024)
    return tracker.max_memory_allocated()


def test_a_composite_op_under_inference_mode_shows_its_temporaries_as_under_no_grad():
    # aten.layer_norm calls native_layer_norm, which returns the output (262,144 B) with the mean and
    # the inverse standard deviation (64 float32 each: a 512 B block each); layer_norm drops both.
    assert layer_norm_peak(torch.no_grad) == 262_144 + 512 + 512
    assert layer_norm_peak(torch.inference_mode) == 262_144 + 512 + 512


def test_only_ops_with_a_composite_kernel_are_decomposed():
    assert has_composite_kernel(aten.linear.default)
    assert has_composite_kernel(aten.scaled_dot_product_attention.default)
    assert not has_composite_kernel(aten.addmm.default)  # a CPU and a Meta kernel of its own
    assert not has_composite_kernel(aten.t.default)  # CompositeExplicitAutograd: seen whole anyway
    assert not has_composite_kernel(torch.ops.prim.device.default)  # not a dispatcher op


def test_the_decomposition_runs_where_the_backend_has_no_kernel_of_its_own():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    assert composite_kernel(aten.linear.default, (x, w), {}) == aten.linear.default.decompose
    on_meta = (x.to("meta"), w.to("meta"))
    assert composite_kernel(aten.linear.default, on_meta, {}) == aten.linear.default.decompose
    assert composite_kernel(aten.linear.default, (x, w.to("meta")), {}) is None  # two backends
    # native_channel_shuffle has a CPU kernel beside its composite one
    assert composite_kernel(aten.native_channel_shuffle.default, (torch.randn(1, 4, 2, 2), 2), {}) is None
    jagged = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    assert composite_kernel(aten.linear.default, (jagged, w), {}) is None  # its __torch_dispatch__ decides
    sparse = torch.eye(4).to_sparse()
    assert composite_kernel(aten.linear.default, (sparse, w), {}) is None  # a sparse kernel decides
    assert composite_kernel(aten.linear.default, (), {}) is None  # no tensor: no backend to read


def test_a_registered_kernel_stands_in_for_the_composite_one():
    calls = []

    def kernel(*args, **kwargs):
        calls.append(len(args))
        return aten.dropout.default.decompose(*args, **kwargs)

    COMPOSITE_KERNELS[aten.dropout.default] = kernel
    try:
        x = torch.ones(4, 4)
        assert composite_kernel(aten.dropout.default, (x, 0.5, False), {}) is kernel
        with torch.inference_mode(), memlab.TensorTracker():
            out = F.dropout(x, 0.5, training=False)
    finally:
        del COMPOSITE_KERNELS[aten.dropout.default]
    assert calls == [3]
    assert torch.equal(out, x)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_values_are_those_of_the_undecomposed_op(mode):
    torch.manual_seed(0)
    model = torch.nn.LSTM(8, 8, 2)
    x = torch.randn(5, 3, 8)
    with mode():
        expected = model(x)[0]
        with memlab.TensorTracker():
            got = model(x)[0]
    assert torch.equal(got, expected)
