"""Where real kernels allocate other sizes than their meta kernels, and how a data-free run follows them.

A data-free run takes each op's outputs from its meta kernel (fake tensors): the right shapes, but
not always the storages the real kernel allocates. :data:`CORRECTIONS` lists each difference memlab
knows, with the PyTorch source it follows; :class:`RealSizes` makes the fake outputs of those ops
hold the storages the real kernel allocates (larger, smaller, shared or absent), so that the tracker
counts what it counts for a real run, and later in-place ops see the same sizes. A sparse tensor
whose number of entries depends on values cannot be sized without data: the op that made one is
named in :attr:`RealSizes.caveats` instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memlab._tensors import storages_of
from memlab._torch_version import torch_at_least

__all__ = ["CORRECTIONS", "Correction", "RealSizes"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Correction:
    """One op whose real kernel allocates other storages than its meta kernel: its ``name``, the
    ``ops`` (overloads) it covers, whose ``kernels`` allocate so (``"cpu"``, ``"cuda"``), what
    ``differs``, the PyTorch ``source`` (file: function) it follows, and ``outputs``: runs the op on
    fake tensors and returns its outputs as the real kernel allocates them. ``when``: a test of the
    op's arguments, for an op that differs only for some (``None``: always)."""

    name: str
    ops: tuple[Any, ...]
    kernels: tuple[str, ...]
    differs: str
    source: str
    outputs: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
    when: Callable[[tuple[Any, ...]], bool] | None = None


def _argument(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, default: Any = None
) -> Any:
    """The value of ``func``'s argument ``name`` in this call (its schema's default if not given;
    ``default`` if the overload has no such argument)."""
    if name in kwargs:
        return kwargs[name]
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[index] if index < len(args) else argument.default_value
    return default


def _holding(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """``tensor``'s shape on a contiguous storage of at least ``numel`` elements, as a kernel that
    allocates ``numel`` elements and then ``resize_``s down leaves it (the storage keeps its size)."""
    if numel <= tensor.numel():
        return tensor
    return tensor.new_empty((numel,)).resize_(tensor.shape)


def _full_storage_loss(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    if _argument(func, args, kwargs, "reduction") == 0:  # at::Reduction::None: that size anyway
        return out
    return _holding(out, math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape)))


def _columns(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _holding(func(*args, **kwargs), args[0].numel())


def _batch_norm_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    grad_input, *rest = func(*args, **kwargs)
    if _argument(func, args, kwargs, "output_mask")[0]:
        return (grad_input, *rest)
    return (None, *rest)


_EMBEDDING_BAG_SUM = 0  # mode, as aten._embedding_bag takes it (sum, mean, max)
_FAST_PATH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _embedding_bag(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    output, _, bag_size, max_indices = func(*args, **kwargs)
    weight, indices, offsets = args[:3]
    per_sample_weights = _argument(func, args, kwargs, "per_sample_weights")
    padding_idx = _argument(func, args, kwargs, "padding_idx", -1)
    fast_sum = (
        _argument(func, args, kwargs, "mode") == _EMBEDDING_BAG_SUM
        and weight.dtype in _FAST_PATH_DTYPES
        and weight.stride(1) == 1
        and output.stride(1) == 1
        and (padding_idx is None or padding_idx < 0)
        and (per_sample_weights is None or per_sample_weights.stride(0) == 1)
    )
    dtype = torch.promote_types(indices.dtype, offsets.dtype)
    count = indices.size(0)
    offset2bag = offsets.new_empty((0 if fast_sum else count,), dtype=dtype)
    if not fast_sum:
        offset2bag = _holding(offset2bag, count + 1)
    return output, offset2bag, _holding(bag_size, offsets.size(0)), max_indices


def _kaiser_window(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    length = _argument(func, args, kwargs, "window_length")
    if _argument(func, args, kwargs, "periodic", True) and length > 1:
        return _holding(out, length + 1)
    return out


def _onednn_lstm_layer(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    output, hy, cy, workspace = func(*args, **kwargs)
    if not torch.is_grad_enabled():  # inference: no workspace (RNN.cpp tests GradMode, not `train`)
        return output, hy, cy, workspace
    return output, hy, cy, workspace.new_empty((_onednn_workspace_nbytes(_signature(args, kwargs)),))


class _TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A hashable stand-in for a call: shape and dtype for each tensor, the other values as given."""

    def key(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _TensorSpec(tuple(value.shape), value.dtype)
        return tuple(value) if isinstance(value, list) else value

    return tuple(map(key, args)), tuple((name, key(value)) for name, value in sorted(kwargs.items()))


# The workspace is ``pd.workspace_desc().get_size()`` of oneDNN's LSTM forward-training primitive
# (aten/src/ATen/native/mkldnn/RNN.cpp: mkldnn_rnn_layer; the meta kernel in
# torch/_meta_registrations.py returns 0 bytes). oneDNN lays it out itself (src/cpu/rnn/rnn_utils.cpp:
# gates and states of every time step, leading dimensions padded and sections page-aligned), and
# that layout changes with the oneDNN version and the implementation it picks for this CPU's
# instruction set: no formula in shapes alone holds. So it is measured, as FakeTensorMode itself
# runs ops without a meta kernel: the real kernel, once per signature (shapes, dtypes, flags) and
# process, on zeros of the same shapes. Cost: one layer's forward in host memory and time.
@functools.lru_cache(maxsize=128)
def _onednn_workspace_nbytes(signature: tuple[Any, ...]) -> int:
    positional, named = signature

    def zeros(value: Any) -> Any:
        return torch.zeros(value.shape, dtype=value.dtype) if isinstance(value, _TensorSpec) else value

    with _disable_current_modes(), torch.enable_grad():
        out = aten.mkldnn_rnn_layer.default(*map(zeros, positional), **{k: zeros(v) for k, v in named})
    return out[3].untyped_storage().nbytes()


#: The first torch whose meta kernel of ``mkldnn_rnn_layer_backward`` gives the gradients the dtype
#: and the bias gradient the shape that the CPU kernel gives them (torch/_meta_registrations.py of
#: 2.13: float32, bias ``[bias_size]``); 2.11's (and 2.8's) give the input's dtype (a bfloat16 LSTM's
#: gradients counted at half their size) and ``weight2``'s shape. The CPU kernel (RNN.cpp) returns
#: float32 on both, as measured on 2.11 and 2.13.
ONEDNN_BACKWARD_META_FIXED_SINCE = (2, 13)


def _onednn_lstm_layer_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not torch_at_least(*ONEDNN_BACKWARD_META_FIXED_SINCE):
        return _onednn_lstm_layer_backward_as_cpu(func, args, kwargs)
    out = func(*args, **kwargs)
    return (*out[:4], out[3].clone(), *out[5:])


def _onednn_lstm_layer_backward_as_cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The CPU kernel's outputs, as torch 2.13's meta kernel makes them (float32 gradients, a bias
    gradient of ``bias_size``: four gates' for GRU, the first bias's length otherwise), the bias
    gradient's second copy a clone of its own."""
    named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    # the schema's names: weight1..weight4 are the meta kernel's weight0..weight3
    hx, cx, bias = named["hx_"], named["cx_tmp"], named["weight3"]
    bias_size = 4 * named["hidden_size"] if named["mode"] == 3 else bias.shape[0]  # 3: GRU
    diff_b = bias.new_empty([bias_size], dtype=torch.float)
    return (
        named["input"].new_empty(named["input"].shape, dtype=torch.float),
        named["weight1"].new_empty(named["weight1"].shape, dtype=torch.float),
        named["weight2"].new_empty(named["weight2"].shape, dtype=torch.float),
        diff_b,
        diff_b.clone(),
        hx.new_empty(hx.shape, dtype=torch.float),
        cx.new_empty(cx.shape, dtype=torch.float),
    )


def _sparse_clone(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    source = args[0]
    return aten._sparse_coo_tensor_with_dims_and_tensors.default(
        source.sparse_dim(),
        source.dense_dim(),
        source.shape,
        source._indices().clone(),
        source._values().clone(),
        dtype=source.dtype,
        layout=torch.sparse_coo,
        device=source.device,
        is_coalesced=source.is_coalesced(),
    )


def _cpu_flash_attention(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    attention, logsumexp = func(*args, **kwargs)
    return attention, logsumexp.new_empty_strided(logsumexp.shape, logsumexp.stride(), dtype=args[0].dtype)


#: The first torch whose meta kernel of ``_scaled_dot_product_flash_attention_for_cpu`` gives the
#: log-sum-exp the CPU kernel's dtype (``utils.get_computation_dtype(query.dtype)``: float64 for a
#: float64 query; torch/_meta_registrations.py of 2.13); 2.11's (and 2.8's) say float32 always, where
#: the CPU kernel (aten/src/ATen/native/transformers/attention.cpp) returns float64 for float64.
CPU_FLASH_LSE_META_FIXED_SINCE = (2, 13)

_BOTH = ("cpu", "cuda")

#: Each known way a real kernel allocates other storages than its meta kernel, found by comparing
#: each op's outputs on CPU with its fake outputs over PyTorch 2.13's OpInfo samples (float32 and
#: bfloat16, forward and backward) and over the layers of tests/estimate/test_zoo.py.
CORRECTIONS: tuple[Correction, ...] = (
    Correction(
        "full-storage losses",
        (
            aten.mse_loss.default,
            aten.smooth_l1_loss.default,
            aten.binary_cross_entropy.default,
            aten.soft_margin_loss.default,
        ),
        _BOTH,
        "with reduction 'mean' or 'sum' the kernel computes the unreduced loss into the output's storage "
        "and reduces it in place: the 0-dim loss keeps a storage of the inputs' broadcast size; the meta "
        "kernel makes a 0-dim one",
        "aten/src/ATen/native/Loss.cpp: mse_loss, smooth_l1_loss, binary_cross_entropy, soft_margin_loss",
        _full_storage_loss,
    ),
    Correction(
        "aten.col2im / aten.im2col",
        (aten.col2im.default, aten.im2col.default),
        _BOTH,
        "the output is made with empty_like(input) and then resized, so its storage keeps the input's "
        "size when the output is smaller (fold; unfold with a stride larger than the kernel)",
        "aten/src/ATen/native/Col2Im.cpp: col2im_cpu; Im2Col.cpp: im2col_cpu; cuda/Col2Im.cu, Im2Col.cu",
        _columns,
    ),
    Correction(
        "aten.native_batch_norm_backward",
        (aten.native_batch_norm_backward.default,),
        ("cpu",),
        "when the input needs no gradient (output_mask[0] false: a first layer, frozen layers below) the "
        "CPU kernel returns no grad_input; the decomposition fake tensors run allocates one of the "
        "input's size anyway",
        "aten/src/ATen/native/Normalization.cpp: batch_norm_backward_cpu; "
        "torch/_decomp/decompositions.py: native_batch_norm_backward",
        _batch_norm_backward,
    ),
    Correction(
        "aten._embedding_bag",
        (aten._embedding_bag.default, aten._embedding_bag_forward_only.default),
        ("cpu",),
        "offset2bag is allocated with one entry more than the indices and resized down, and is empty only "
        "on the sum fast path, which also covers bfloat16 (the meta kernel: float and half); bag_size "
        "keeps one entry per offset with include_last_offset",
        "aten/src/ATen/native/EmbeddingBag.cpp: _embedding_bag_cpu_impl_out, make_offset2bag_out, "
        "make_bag_size_out, is_fast_path_index_select",
        _embedding_bag,
    ),
    Correction(
        "aten.kaiser_window",
        (aten.kaiser_window.default, aten.kaiser_window.periodic, aten.kaiser_window.beta),
        _BOTH,
        "a periodic window of N > 1 points is computed as N + 1 points and narrowed, so its storage holds "
        "N + 1 elements; the meta kernel allocates N",
        "aten/src/ATen/native/TensorFactories.cpp: kaiser_window",
        _kaiser_window,
    ),
    Correction(
        "aten.mkldnn_rnn_layer",
        (aten.mkldnn_rnn_layer.default,),
        ("cpu",),
        "with gradients enabled, each LSTM layer and direction returns oneDNN's training workspace (for "
        "backward), whose size oneDNN decides; the meta kernel returns 0 bytes. memlab measures it once "
        "per shape by running the real kernel on zeros",
        "aten/src/ATen/native/mkldnn/RNN.cpp: mkldnn_rnn_layer (pd.workspace_desc().get_size())",
        _onednn_lstm_layer,
    ),
    Correction(
        "aten.mkldnn_rnn_layer_backward",
        (aten.mkldnn_rnn_layer_backward.default,),
        ("cpu",),
        "the bias gradient is returned twice, the second a clone (its own storage); the meta kernel "
        "returns the same tensor twice",
        "aten/src/ATen/native/mkldnn/RNN.cpp: mkldnn_rnn_layer_backward (diff_b2_ = at::clone(diff_b_))",
        _onednn_lstm_layer_backward,
    ),
    Correction(
        "aten.clone of a sparse COO tensor",
        (aten.clone.default,),
        _BOTH,
        "the clone copies the indices and values (a sparse gradient is cloned when it is accumulated); "
        "the fake kernel makes a sparse tensor with no entries",
        "aten/src/ATen/native/sparse/SparseTensor.cpp: clone_sparse",
        _sparse_clone,
        when=lambda args: args[0].layout is torch.sparse_coo,
    ),
) + (
    ()
    if torch_at_least(*CPU_FLASH_LSE_META_FIXED_SINCE)
    else (
        Correction(
            "aten._scaled_dot_product_flash_attention_for_cpu",
            (aten._scaled_dot_product_flash_attention_for_cpu.default,),
            ("cpu",),
            "for a float64 query the log-sum-exp is float64; this torch's meta kernel makes it float32 "
            "(torch 2.13's meta kernel makes it the query's computation dtype)",
            "aten/src/ATen/native/transformers/attention.cpp: _scaled_dot_product_flash_attention_cpu",
            _cpu_flash_attention,
            when=lambda args: args[0].dtype is torch.float64,
        ),
    )
)

# by id: an OpOverload hashes in Python (the ops stay alive in CORRECTIONS)
_BY_ID = {id(op): correction for correction in CORRECTIONS for op in correction.ops}

# Sparse tensors made from given parts (or empty by request): their sizes are known, not guessed.
_SPARSE_FROM_PARTS = {
    aten._sparse_coo_tensor_with_dims.default,
    aten._sparse_coo_tensor_with_dims_and_tensors.default,
    aten._sparse_compressed_tensor_unsafe.default,
    aten.sparse_compressed_tensor.comp_plain_value_size,
    aten.sparse_compressed_tensor.comp_plain_value,
}


class _Corrected(TorchDispatchMode):
    """Entered around the tracker's handling of one call of ``func``: answers it with the
    correction's outputs, and passes on the ops the tracker runs to inspect them."""

    def __init__(self, func: Any, correction: Correction) -> None:
        super().__init__()
        self._func = func
        self._correction = correction

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is self._func:
            return self._correction.outputs(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class RealSizes:
    """The storage corrections of one data-free run that mimics ``kernels`` (``"cpu"`` or
    ``"cuda"``: whose kernels' allocations the run follows), and the caveats it found."""

    def __init__(self, kernels: str) -> None:
        self.kernels = kernels
        #: One sentence per op whose outputs' real size could not be known without data.
        self.caveats: list[str] = []
        #: The names of the corrections (:data:`CORRECTIONS`) the run's ops went through.
        self.applied: set[str] = set()
        self._named: set[str] = set()

    def run(self, func: Any, args: tuple[Any, ...], call: Callable[[], Any]) -> Any:
        """``call()`` (the op ``func`` on ``args``, as the tracker runs and counts it), with
        ``func``'s outputs made as its real kernel allocates them."""
        correction = self._correction(func, args)
        if correction is not None:
            self.applied.add(correction.name)
            with _Corrected(func, correction):
                return call()
        return self.checked(func, args, call())

    def corrects(self, func: Any, args: tuple[Any, ...]) -> bool:
        """Whether :meth:`run` answers ``func(*args)`` with a correction's outputs (a dispatch mode
        entered around ``call()``); else :meth:`run` is ``checked(func, args, call())``."""
        return self._correction(func, args) is not None

    def checked(self, func: Any, args: tuple[Any, ...], out: Any) -> Any:
        """``out``, the outputs of ``func(*args)`` that no correction answered, once noted in
        :attr:`caveats` where they are sparse tensors whose size the run cannot know."""
        if _has_sparse(out) and func not in _SPARSE_FROM_PARTS:
            self._name_sparse(func, args, out)
        return out

    def _correction(self, func: Any, args: tuple[Any, ...]) -> Correction | None:
        correction = _BY_ID.get(id(func))
        if (
            correction is not None
            and self.kernels in correction.kernels
            and (correction.when is None or correction.when(args))
        ):
            return correction
        return None

    def _name_sparse(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """Name ``func`` if it made a sparse tensor with no entries: fake kernels cannot know how
        many entries the real one makes (unless an input was such a tensor already, named where
        it was made)."""
        if not any(_empty_sparse(t) for t in _tensors(out)) or any(_empty_sparse(t) for t in _tensors(args)):
            return
        name = f"aten.{func.overloadpacket.__name__}"
        if name not in self._named:
            self._named.add(name)
            self.caveats.append(
                f"{name} made a sparse tensor whose number of entries depends on tensor values, which a "
                f"data-free run does not have: it is counted as empty (0 bytes)"
            )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _has_sparse(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return out.layout is not torch.strided
    if type(out) is tuple or type(out) is list:
        return any(isinstance(t, torch.Tensor) and t.layout is not torch.strided for t in out)
    return False


def _empty_sparse(tensor: torch.Tensor) -> bool:
    if tensor.layout is torch.strided:
        return False
    return sum(storage.nbytes() for storage in storages_of(tensor)) == 0
