"""CUDA's kernels, not the CPU's: make a data-free run on CPU allocate what CUDA's kernels would.

PyTorch picks kernels per device, and some picks allocate differently on CUDA than on the CPU path
a run here takes. :data:`DIFFERENCES` lists them, each with the PyTorch source it follows;
:class:`CudaKernels` substitutes CUDA's choice for the handled ones while it is entered (PyTorch's own
CUDA-side ops, which run on fake and ``meta`` tensors through their meta kernels) and names the
unhandled ones the run hit in :attr:`CudaKernels.caveats`; :func:`cuda_optimizer_defaults` sets the
optimizer defaults CUDA parameters get.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlab._gpus import GPU, GpuLike, resolve_gpu
from memlab._tensors import check_optimizer
from memlab.estimate import attention, attention_run
from memlab.estimate.autocast import CudaAutocast
from memlab.estimate.grad_scaler import CudaGradScalers
from memlab.sources.composites import COMPOSITE_KERNELS

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
        "CUDA picks, by the GPU's compute capability, cuDNN attention (sm90/sm100 with cuDNN newer than "
        "9.15, float16/bfloat16, head dims multiples of 8 up to 128, dropout a multiple of 1/16; keeps "
        "its output and float32 softmax statistics), flash attention (sm80 to sm121, float16/bfloat16, "
        "no mask; keeps its output and a float32 log-sum-exp), memory-efficient attention (sm50 and "
        "newer, also float32 and masks; keeps its output, a float32 log-sum-exp padded to 32 queries and "
        "an additive mask made of a bool one) or the math path; the CPU path (math with dropout, or CPU "
        "flash) keeps other tensors, the math path the full attention matrix several times; with "
        "enable_gqa (fewer key/value heads) cuDNN and flash keep key and value unrepeated, memory-"
        "efficient attention refuses it (torch 2.13), and the math path repeats key and value",
        "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: select_sdp_backend, priority_order, "
        "check_prefer_cudnn_attention, can_use_cudnn_attention, can_use_flash_attention, "
        "can_use_mem_efficient_attention; aten/src/ATen/native/transformers/attention.cpp: "
        "scaled_dot_product_attention, convert_boolean_attn_mask_cudnn, preprocess_mask",
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
        True,
        "inside torch.autocast('cuda', dtype) CUDA casts each op's inputs by its op lists "
        "(memlab.estimate.autocast.CUDA_AUTOCAST_OPS: matmuls, linear layers and convolutions in dtype; "
        "softmax, norms, sums and losses in float32; promote ops to the widest input type) and keeps the "
        "dtype copy of each weight until the outermost region exits; PyTorch without CUDA disables the "
        "region, so a run here computes in the inputs' dtype",
        "aten/src/ATen/autocast_mode.cpp: cached_cast, TORCH_LIBRARY_IMPL(aten, AutocastCUDA); "
        "aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, "
        "AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE, WrapFunction_; "
        "torch/amp/autocast_mode.py: autocast.__init__, __enter__, __exit__",
    ),
    Difference(
        "softmax_half_to_float",
        True,
        "softmax and log_softmax of a CUDA float16 input with dtype=float32 (what autocast's float32 "
        "policy asks) run the half-to-float kernel, which writes the float32 output without a float32 "
        "copy of the input; the CPU path copies the input to float32 first",
        "aten/src/ATen/native/SoftMax.cpp: softmax, log_softmax",
    ),
    Difference(
        "grad_scaler",
        True,
        "an enabled GradScaler('cuda') allocates its scale and growth tracker at the first scale(), the "
        "scaled output, and in unscale_ the inverse scale (a temporary) and a found-inf flag per device, "
        "kept until update(); PyTorch without CUDA disables the scaler, so a run here allocates none",
        "torch/amp/grad_scaler.py: GradScaler.__init__, _lazy_init_scale_growth_tracker, scale, unscale_, "
        "_unscale_grads_, _MultiDeviceReplicator.get, update",
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
_active: list[CudaKernels] = []


def _is_data_free(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given is a fake tensor or on ``meta`` (values never computed)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return all(t is None or isinstance(t, FakeTensor) or t.is_meta for t in tensors)


def _first_op(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


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
    (so they see calls from Python and from C++ composites alike). They are process-wide while
    entered: other threads' CPU ops meet the same kernels. Under ``torch.inference_mode`` autograd
    keys are skipped: a :class:`memlab.TensorTracker` on the stack decomposes these ops itself and
    runs the same kernels (:data:`memlab.sources.composites.COMPOSITE_KERNELS`); without one the
    CPU path runs. Only one ``CudaKernels`` can be entered at a time.

    ``gpu``: the GPU whose choices to follow (a name, a compute capability, a
    :class:`memlab._gpus.GPU`; ``None``: the GPU in use, else :data:`memlab._gpus.DEFAULT_GPU`).
    Attention picks its kernel by the GPU's compute capability (:mod:`memlab.estimate.attention`:
    cuDNN attention first on sm90/sm100 for float16/bfloat16 from torch 2.9, flash on sm80 and
    newer, memory-efficient, math), with the cuDNN version of
    :data:`~memlab.estimate.attention.ASSUMED_CUDNN_VERSION` where PyTorch has no cuDNN to ask.

    Mixed precision: inside ``torch.autocast("cuda", dtype)`` a data-free run casts as CUDA's
    autocast does (:class:`memlab.estimate.autocast.CudaAutocast`: CUDA's op lists, the weight-cast
    cache, nesting, ``enabled=False``), and a ``GradScaler("cuda")`` behaves as an enabled one
    (:class:`memlab.estimate.grad_scaler.CudaGradScalers`), though PyTorch without CUDA disables
    both; ``substituted`` counts the regions (``autocast``) and scalers (``grad_scaler``) modelled.
    With ``data_free=False`` both run as PyTorch runs them here (disabled) and ``caveats`` says so.

    What it cannot see: cuBLAS/cuDNN workspaces; that CUDA keeps the two 8-byte philox seed and
    offset tensors of memory-efficient attention in host memory (the run counts them on the device:
    two 512 B blocks per attention call, kept for backward); that cuDNN attention without gradients
    allocates no softmax statistics (the meta kernel does: freed at once, a transient
    B x H x L x 4 bytes); the scratch buffers of the attention kernels themselves.
    """

    def __init__(self, data_free: bool = True, gpu: GpuLike | None = None) -> None:
        if not isinstance(data_free, bool):
            raise TypeError(f"data_free must be True or False, got {type(data_free).__name__} {data_free!r}")
        self.data_free = data_free
        #: The GPU whose kernel choices the run follows (:func:`memlab._gpus.resolve_gpu` of ``gpu``).
        self.gpu: GPU = resolve_gpu(gpu)
        #: Name of each handled difference -> how many calls were substituted.
        self.substituted: dict[str, int] = {}
        #: One sentence per unhandled difference hit (or handled one not applied), in order first hit.
        self.caveats: list[str] = []
        self._library: Any = None
        self._composites: dict[Any, Callable[..., Any]] = {}  # in COMPOSITE_KERNELS while entered
        self._amp: list[Any] = []  # CudaAutocast and CudaGradScalers, while entered

    # -- context management ---------------------------------------------------------------
    def __enter__(self) -> CudaKernels:
        if _active:
            raise RuntimeError("a CudaKernels is already entered; enter one at a time")
        kernels = {"dropout": self._dropout, "scaled_dot_product_attention": self._attention}
        kernels.update((name, self._recurrent_kernel(name)) for name in _RECURRENT)
        library = torch.library.Library("aten", "IMPL")
        try:
            for key in _KEYS:
                for name, kernel in kernels.items():
                    library.impl(name, kernel, key)
        except BaseException:
            library._destroy()
            raise
        self._library = library
        # Under inference mode the autograd keys are skipped: the tracker decomposes these there
        self._composites = {_first_op(name): kernel for name, kernel in kernels.items()}
        COMPOSITE_KERNELS.update(self._composites)
        try:
            for amp in (
                CudaAutocast(self.data_free, self._caveat, self._count),
                CudaGradScalers(self.data_free, self._caveat, self._count),
            ):
                amp.__enter__()
                self._amp.append(amp)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        _active.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self in _active:
            _active.remove(self)
        while self._amp:
            self._amp.pop().__exit__(*exc_info)
        for op in self._composites:
            COMPOSITE_KERNELS.pop(op, None)
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

        backend = attention.select_backend(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            capability=self.gpu.capability,
            enable_gqa=enable_gqa,
        )
        if backend == "error":
            return composite()
        kept = {
            "cudnn": "its output and float32 softmax statistics",
            "flash": "its output and a float32 log-sum-exp",
            "efficient": "its output and a float32 log-sum-exp",
            "math": "the math path's tensors",
        }[backend]
        what = (
            f"aten.scaled_dot_product_attention ({query.dtype}, head dim {query.size(-1)}) on "
            f"{self.gpu.name} ({self.gpu.sm}) runs {attention.BACKEND_OPS[backend]}, which keeps {kept} "
            "for backward"
        )
        if not self._can_substitute(what, query, key, value, attn_mask):
            return composite()
        self._count("scaled_dot_product_attention")
        return attention_run.run_backend(
            backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )

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
