"""CUDA's kernels, not the CPU's: make a data-free run on CPU allocate what CUDA's kernels would.

PyTorch picks kernels per device, and some picks allocate differently on CUDA than on the CPU path
a run here takes. :data:`DIFFERENCES` lists them, each with the PyTorch source it follows;
:class:`CudaKernels` substitutes CUDA's choice for the handled ones while it is entered (PyTorch's own
CUDA-side ops, which run on fake and ``meta`` tensors through their meta kernels) and names the
unhandled ones the run hit in :attr:`CudaKernels.caveats`; :func:`cuda_optimizer_defaults` sets the
optimizer defaults CUDA parameters get.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlab._gpus import GPU, resolve_gpu
from memlab._tensors import check_optimizer

__all__ = ["DIFFERENCES", "CudaKernels", "Difference", "cuda_optimizer_defaults"]


@dataclass(frozen=True)
class Difference:
    """One way CUDA's kernels allocate differently from the CPU path: its ``name`` (the key of
    :attr:`CudaKernels.substituted`), whether memlab ``handled`` it, what ``differs``, and the
    PyTorch ``source`` (file: function) the handling or the caveat follows."""

    name: str
    handled: bool
    differs: str
    source: str


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "dropout",
        True,
        "in training with 0 < p < 1 on a non-empty input, CUDA runs the fused aten.native_dropout, which "
        "keeps a 1-byte bool mask for backward; the CPU path (_dropout) keeps a mask of the input's dtype "
        "and size (4 bytes an element for float32)",
        "aten/src/ATen/native/Dropout.cpp: dropout, is_fused_kernel_acceptable",
    ),
    Difference(
        "scaled_dot_product_attention",
        True,
        "CUDA picks flash attention (float16/bfloat16, no mask) or memory-efficient attention (also "
        "float32, masks), which keep the output and a float32 log-sum-exp for backward; the CPU path "
        "(math with dropout, or CPU flash) keeps other tensors, the math path the full attention matrix "
        "several times. memlab follows CUDA's choice for an sm80 GPU (A100) and its fallback to math",
        "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: select_sdp_backend, can_use_flash_attention, "
        "can_use_mem_efficient_attention; aten/src/ATen/native/transformers/attention.cpp: "
        "scaled_dot_product_attention",
    ),
    Difference(
        "optimizer_foreach",
        True,
        "optimizers whose foreach is None use the multi-tensor (foreach) implementation for CUDA "
        "parameters and the per-tensor loop for CPU ones, with different temporaries in step()",
        "torch/optim/optimizer.py: _default_to_fused_or_foreach; torch/optim/adam.py: adam",
    ),
    Difference(
        "recurrent",
        False,
        "on CUDA, LSTM/GRU/RNN layers run cuDNN (aten._cudnn_rnn), which copies the weights into one flat "
        "buffer and keeps a reserve buffer for backward whose size only cuDNN knows "
        "(cudnnGetRNNTrainingReserveSize; the meta kernel of _cudnn_rnn gives 0 bytes), and the cells "
        "(LSTMCell, GRUCell) run fused kernels (_thnn_fused_lstm_cell, _thnn_fused_gru_cell) that keep "
        "one workspace of the gates",
        "aten/src/ATen/native/RNN.cpp: lstm, gru, _rnn_impl (use_cudnn), LSTMCell, GRUCell; "
        "aten/src/ATen/native/cudnn/RNN.cpp: _cudnn_rnn",
    ),
    Difference(
        "autocast",
        False,
        "torch.autocast('cuda') casts by CUDA's op lists (float16 by default), which differ from the CPU "
        "lists; without CUDA, PyTorch disables a CUDA autocast region, so the run computes in the "
        "inputs' dtype",
        "aten/src/ATen/autocast_mode.cpp: the AutocastCUDA and AutocastCPU lists; "
        "torch/amp/autocast_mode.py: autocast.__init__",
    ),
)

# The recurrent ops that run other kernels on CUDA, by aten overload, with the module users write.
_RECURRENT = {
    "lstm.input": "torch.nn.LSTM",
    "lstm.data": "torch.nn.LSTM",
    "gru.input": "torch.nn.GRU",
    "gru.data": "torch.nn.GRU",
    "rnn_tanh.input": "torch.nn.RNN",
    "rnn_tanh.data": "torch.nn.RNN",
    "rnn_relu.input": "torch.nn.RNN",
    "rnn_relu.data": "torch.nn.RNN",
    "lstm_cell": "torch.nn.LSTMCell",
    "gru_cell": "torch.nn.GRUCell",
}
_FUSED_CELLS = {"lstm_cell": "aten._thnn_fused_lstm_cell", "gru_cell": "aten._thnn_fused_gru_cell"}
# The autograd keys of the devices a data-free run uses: fake CPU tensors and ``meta`` tensors.
# A kernel there runs before the backend's composite kernel, for calls from Python and C++ alike.
_KEYS = ("AutogradCPU", "AutogradMeta")
_FLASH_MAX_HEAD_DIM = 256  # sdp_utils.cpp: check_head_dim_size_flash
_active: list[CudaKernels] = []


def _is_data_free(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given is a fake tensor or on ``meta`` (values never computed)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return all(t is None or isinstance(t, FakeTensor) or t.is_meta for t in tensors)


def _first_op(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _cuda_sdp_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
) -> str:
    """The backend CUDA's ``select_sdp_backend`` picks on an sm80 GPU for dense inputs:
    ``"flash"``, ``"efficient"``, ``"math"`` or ``"error"`` (none enabled fits)."""
    backends = torch.backends.cuda
    enabled = {
        "flash": backends.flash_sdp_enabled(),
        "efficient": backends.mem_efficient_sdp_enabled(),
        "math": backends.math_sdp_enabled(),
    }
    # torch._C._get_sdp_priority_order(): at::SDPBackend values, [flash, efficient, math, cudnn, ...]
    # by default; cuDNN comes first only on sm90/sm100 (check_prefer_cudnn_attention), not on sm80.
    names = {0: "math", 1: "flash", 2: "efficient"}
    for code in torch._C._get_sdp_priority_order():
        name = names.get(code)
        if name is None or not enabled[name]:
            continue
        if name == "math" or _fits(name, query, key, value, attn_mask, is_causal):
            return name
    return "error"


def _fits(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
) -> bool:
    """Whether the fused ``backend`` ("flash" or "efficient") accepts these inputs on sm80
    (sdp_utils.cpp: can_use_flash_attention, can_use_mem_efficient_attention)."""
    tensors = (query, key, value)
    if any(t.dim() != 4 or t.is_nested for t in tensors):  # check_tensor_shapes
        return False
    if not (query.size(0) == key.size(0) == value.size(0)):  # check_batch_size_and_num_heads_dense
        return False
    if query.size(-2) == 0 or key.size(-2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    head, key_head, value_head = query.size(-1), key.size(-1), value.size(-1)
    if backend == "flash":
        return (
            attn_mask is None  # check_for_attn_mask
            and head == key_head == value_head <= _FLASH_MAX_HEAD_DIM  # check_head_dim_size_flash
            and not (is_causal and query.size(-2) != key.size(-2))  # check_flash_causal_non_square_seqlens
            and query.dtype in (torch.float16, torch.bfloat16)  # check_dtypes_flash_attention
            and all(t.stride(-1) == 1 or t.size(-1) == 1 for t in tensors)  # last-dim stride, singletons ok
        )
    half = query.dtype in (torch.float16, torch.bfloat16)
    alignment = 8 if half else 4  # minimum_gemm_alignment on sm80: max(4, 128 / bits per element)
    return (
        head == key_head
        and head > 0
        and value_head > 0
        and head % alignment == 0
        and value_head % alignment == 0  # check_head_dim_size_mem_efficient
        and all(t.numel() == 0 or t.storage_offset() % alignment == 0 for t in tensors)  # data_ptr alignment
        and all(t.stride(-1) == 1 for t in tensors)  # check_last_dim_stride_equals_1_dense
        and query.dtype in (torch.float16, torch.float32, torch.bfloat16)
    )


class CudaKernels:
    """While entered, run dropout and scaled-dot-product attention with the kernels CUDA would pick,
    and name the differences it does not handle that the run hit.

    Enter it inside a ``FakeTensorMode`` and a :class:`memlab.TensorTracker` (``with fake_mode,
    tracker, kernels:``): the CUDA-side ops it calls are ordinary aten ops, so the tracker counts
    their storages, and autograd records them, so backward runs their CUDA-side backward ops
    (through their meta kernels on fake and ``meta`` tensors). See :data:`DIFFERENCES` for what is
    handled and the PyTorch source each follows; the docs give the bytes each changes.

    ``data_free=True`` (the default): the run's tensors are fake or ``meta``, values do not matter,
    and the handled differences are substituted. ``data_free=False``: a real CPU run whose values
    matter; nothing is substituted (CUDA's attention kernels have no CPU kernel, and a CPU
    ``native_dropout`` draws other random numbers), and each difference CUDA would have made is
    named in :attr:`caveats` instead. A substitution whose inputs are real tensors is skipped the
    same way.

    :attr:`substituted` maps the name of each handled difference to how many calls were substituted;
    :attr:`caveats` holds one sentence per unhandled difference the run hit (or handled one that could
    not be applied), in the order first hit, without repeats.

    How: the kernels are registered, for the run, at the ``AutogradCPU`` and ``AutogradMeta``
    dispatch keys of ``aten::dropout``, ``aten::scaled_dot_product_attention`` and the recurrent ops
    (so they see calls from Python and from C++ composites alike), and ``torch.autocast``'s
    ``__init__``/``__enter__`` are wrapped to see CUDA autocast regions. Both are process-wide while
    entered: other threads' CPU ops meet the same kernels. Under ``torch.inference_mode`` autograd
    keys are skipped and the CPU path runs. Only one ``CudaKernels`` can be entered at a time.

    What it cannot see: cuBLAS/cuDNN workspaces, the choice of cuDNN attention on sm90 and newer
    GPUs with recent cuDNN (an sm80 GPU is assumed), and that CUDA keeps the two 8-byte philox seed
    and offset tensors of memory-efficient attention in host memory (the run counts them on the
    device: two 512 B blocks per attention call, kept for backward).
    """

    def __init__(self, data_free: bool = True, gpu: GPU | None = None) -> None:
        if not isinstance(data_free, bool):
            raise TypeError(f"data_free must be True or False, got {type(data_free).__name__} {data_free!r}")
        self.data_free = data_free
        #: The GPU whose kernels are mimicked (``None``: :func:`memlab._gpus.resolve_gpu`'s default).
        self.gpu = resolve_gpu(gpu)
        #: Name of each handled difference -> how many calls were substituted.
        self.substituted: dict[str, int] = {}
        #: One sentence per unhandled difference hit (or handled one not applied), in order first hit.
        self.caveats: list[str] = []
        self._library: Any = None
        self._autocast: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        self._autocast_requests: weakref.WeakKeyDictionary[Any, tuple[bool, Any]] = (
            weakref.WeakKeyDictionary()
        )

    # -- context management ---------------------------------------------------------------
    def __enter__(self) -> CudaKernels:
        if _active:
            raise RuntimeError("a CudaKernels is already entered; enter one at a time")
        library = torch.library.Library("aten", "IMPL")
        try:
            for key in _KEYS:
                library.impl("dropout", self._dropout, key)
                library.impl("scaled_dot_product_attention", self._attention, key)
                for name in _RECURRENT:
                    library.impl(name, self._recurrent_kernel(name), key)
        except BaseException:
            library._destroy()
            raise
        self._library = library
        self._wrap_autocast()
        _active.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _active.remove(self)
        self._unwrap_autocast()
        library, self._library = self._library, None
        library._destroy()

    # -- bookkeeping ------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.substituted[name] = self.substituted.get(name, 0) + 1

    def _caveat(self, sentence: str) -> None:
        if sentence not in self.caveats:
            self.caveats.append(sentence)

    def _can_substitute(self, what: str, *tensors: torch.Tensor | None) -> bool:
        """Whether a substitution may run: ``data_free`` and every tensor fake or ``meta``."""
        if self.data_free and _is_data_free(*tensors):
            return True
        why = "values matter (data_free=False)" if not self.data_free else "its inputs are real tensors"
        self._caveat(f"{what}; not substituted because {why}, so this run kept the CPU kernels' tensors.")
        return False

    # -- dropout ----------------------------------------------------------------------------
    def _dropout(self, input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        # Dropout.cpp: dropout() takes native_dropout when is_fused_kernel_acceptable (a CUDA input,
        # 0 < p < 1, numel > 0) and train; otherwise _dropout, the same on both devices.
        if train and 0 < p < 1 and input.numel() > 0 and not input.is_nested:
            what = (
                f"aten.dropout (p={p}) on CUDA runs the fused aten.native_dropout, which keeps a 1-byte "
                f"bool mask instead of a {input.dtype} one of the input's size"
            )
            if self._can_substitute(what, input):
                self._count("dropout")
                return torch.ops.aten.native_dropout.default(input, p, train)[0]
        return torch.ops.aten.dropout.default.decompose(input, p, train)

    # -- attention --------------------------------------------------------------------------
    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        def composite() -> torch.Tensor:
            return torch.ops.aten.scaled_dot_product_attention.default.decompose(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )

        shapes = (query.dim(), key.dim(), value.dim()) == (4, 4, 4)
        if shapes and not (query.size(1) == key.size(1) == value.size(1)):
            self._caveat(
                "aten.scaled_dot_product_attention with grouped-query heads (query "
                f"{query.size(1)}, key {key.size(1)}, value {value.size(1)}): CUDA's fused kernels handle "
                "them without repeating key and value; not modelled, so this run kept the CPU kernels' "
                "tensors."
            )
            return composite()
        backend = _cuda_sdp_backend(query, key, value, attn_mask, is_causal)
        if backend == "error":
            return composite()
        kernel = {
            "flash": "aten._scaled_dot_product_flash_attention",
            "efficient": "aten._scaled_dot_product_efficient_attention",
            "math": "aten._scaled_dot_product_attention_math",
        }[backend]
        what = (
            f"aten.scaled_dot_product_attention ({query.dtype}, head dim {query.size(-1)}) on CUDA runs "
            f"{kernel}, which keeps "
            + ("its output and a float32 log-sum-exp" if backend != "math" else "the math path's tensors")
            + " for backward"
        )
        if not self._can_substitute(what, query, key, value, attn_mask):
            return composite()
        self._count("scaled_dot_product_attention")
        if backend == "flash":
            return self._flash(query, key, value, dropout_p, is_causal, scale)
        if backend == "efficient":
            # attention.cpp: the efficient op takes the mask as given (it handles a bool mask).
            compute_log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention.default(
                query, key, value, attn_mask, compute_log_sumexp, dropout_p, is_causal, scale=scale
            )[0]
        if (
            attn_mask is not None and attn_mask.dtype is torch.bool
        ):  # attention.cpp: convert_boolean_attn_mask
            zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
            attn_mask = torch.where(attn_mask.logical_not(), -math.inf, zero)
        return torch.ops.aten._scaled_dot_product_attention_math.default(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    @staticmethod
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

    # -- recurrent layers -------------------------------------------------------------------
    def _recurrent_kernel(self, name: str) -> Callable[..., Any]:
        op = _first_op(name)
        module = _RECURRENT[name]
        packet = name.partition(".")[0]
        if packet in _FUSED_CELLS:
            sentence = (
                f"aten.{packet} ({module}): on CUDA it runs the fused {_FUSED_CELLS[packet]}, which keeps "
                "one workspace of the gates for backward instead of the CPU path's gate tensors; not "
                "modelled, so this run counts the CPU kernels' tensors."
            )
        else:
            sentence = (
                f"aten.{packet} ({module}): on CUDA cuDNN runs it (aten._cudnn_rnn), which copies the "
                "weights into one flat buffer and keeps a reserve buffer for backward whose size only "
                "cuDNN knows (cudnnGetRNNTrainingReserveSize); not modelled, so this run counts the CPU "
                "kernels' tensors."
            )

        def kernel(*args: Any, **kwargs: Any) -> Any:
            self._caveat(sentence)
            return op.decompose(*args, **kwargs)

        return kernel

    # -- autocast ---------------------------------------------------------------------------
    def _wrap_autocast(self) -> None:
        autocast = torch.amp.autocast_mode.autocast
        original_init, original_enter = autocast.__init__, autocast.__enter__
        requests = self._autocast_requests

        def __init__(
            instance: Any,
            device_type: str,
            dtype: Any = None,
            enabled: bool = True,
            cache_enabled: Any = None,
        ) -> None:
            original_init(instance, device_type, dtype, enabled, cache_enabled)
            requests[instance] = (enabled, dtype)

        def __enter__(instance: Any) -> Any:
            enabled, dtype = requests.get(instance, (True, None))
            if instance.device == "cuda" and enabled and not instance._enabled:
                dtype = dtype or torch.float16
                self._caveat(
                    f"torch.autocast('cuda', dtype={dtype}) was entered: PyTorch without CUDA disables it, "
                    f"so this run computed in the inputs' dtype; on CUDA, autocast "
                    f"(aten/src/ATen/autocast_mode.cpp) runs matmuls, convolutions and linear layers in "
                    f"{dtype} and keeps float32 for softmax, norms and losses, which changes the size of "
                    "their outputs and saved activations; not modelled."
                )
            return original_enter(instance)

        autocast.__init__, autocast.__enter__ = __init__, __enter__  # type: ignore[method-assign]
        self._autocast = (original_init, original_enter)

    def _unwrap_autocast(self) -> None:
        if self._autocast is not None:
            autocast = torch.amp.autocast_mode.autocast
            autocast.__init__, autocast.__enter__ = self._autocast  # type: ignore[method-assign]
            self._autocast = None


def cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> list[str]:
    """Give ``optimizer`` (a data-free copy whose parameters are CPU, fake or ``meta`` tensors) the
    implementation defaults its parameters would get on CUDA, and return the names of what changed
    (``"param_groups[0]['foreach']"``).

    On CUDA, a group whose ``foreach`` is ``None`` and whose ``fused`` is not set runs the
    multi-tensor (foreach) implementation (``torch/optim/optimizer.py: _default_to_fused_or_foreach``;
    not for ``differentiable=True``, nor for Adam/AdamW with a tensor ``lr`` and ``capturable=False``);
    on CPU it runs the per-tensor loop, whose temporaries differ. This sets ``foreach=True`` on such
    groups of the copy; never call it on the user's own optimizer. The parameters are taken to be
    plain tensors or ``Parameter`` objects on CUDA (a tensor subclass such as ``DTensor`` keeps the
    loop there). Fused kernels are not the CUDA default and are not set. Raises ``TypeError``
    unless ``optimizer`` is a ``torch.optim.Optimizer``.
    """
    check_optimizer(optimizer)
    changed = []
    for index, group in enumerate(optimizer.param_groups):
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue
        if group.get("differentiable", False):
            continue
        if (
            isinstance(optimizer, torch.optim.Adam)
            and isinstance(group.get("lr"), torch.Tensor)
            and not group.get("capturable", False)
        ):
            continue  # adam.py: "Do not flip on foreach for ... lr is a Tensor and capturable=False"
        group["foreach"] = True
        changed.append(f"param_groups[{index}]['foreach']")
    return changed
