"""CUDA's autocast in a data-free run on a machine without CUDA.

PyTorch without CUDA turns ``torch.autocast("cuda", dtype)`` off, so a run here computes in the
inputs' dtype where a GPU would cast by CUDA's op lists. :class:`CudaAutocast` (entered by
:class:`memlab.estimate.kernels.CudaKernels`) makes such a region of a data-free run (fake or
``meta`` tensors, which stand for CUDA tensors) behave as CUDA's autocast does, and makes a real
CPU run say that it did not. :data:`CUDA_AUTOCAST_OPS` is CUDA's op list with each op's cast policy.

The mechanism, and why: CUDA's autocast is a dispatch key (``AutocastCUDA``) above autograd whose
kernels cast the inputs (``cached_cast``: differentiable ``_to_copy``s that autograd records, so
backward casts gradients back) and then call the op with autocast excluded; ops on no list fall
through, so a composite op on no list (``einsum`` calling ``bmm``) is autocast inside. Fake CPU
tensors carry the ``AutocastCPU`` key, the CPU twin of that slot (``meta`` tensors get it from the
thread's included keys), so while entered the CUDA policies are registered there as Python kernels
(``torch.library``), CPU's own kernels for ops that are not on CUDA's lists are made fallthroughs,
and a CUDA region's state is mirrored into the CPU autocast state of the thread (enabled, dtype),
which is what switches that key on and off. A ``TorchFunctionMode`` would see Python calls only,
not the ops that C++ composites call, and would not follow the state into
``torch.utils.checkpoint``'s recomputation, which restores the CPU autocast state of the tensors'
device type (``cpu`` here); PyTorch's ``AutocastCUDA`` kernels themselves cannot run on these
tensors (they check ``tensor.is_cuda()``, and a fake CUDA tensor needs a CUDA device guard).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memlab._autocast import AutocastWatch, unwatch, watch
from memlab._torch_version import torch_at_least

__all__ = ["CUDA_AUTOCAST_OPS", "CudaAutocast"]

# aten/src/ATen/autocast_mode.h (torch 2.13), the lists autocast_mode.cpp registers for AutocastCUDA
# (TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)); the Dimname overloads are not registered in 2.13.
_LOWER_PRECISION_FP = (  # AT_FORALL_LOWER_PRECISION_FP, then cudnn_convolution(_transpose)
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)  # fmt: skip
_FP32 = (  # AT_FORALL_FP32
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
_FP32_SET_OPT_DTYPE = (  # AT_FORALL_FP32_SET_OPT_DTYPE
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)  # fmt: skip
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the overload registered -> the one it redispatches to.
_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_PROMOTE = (  # AT_FORALL_PROMOTE
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)  # fmt: skip

#: CUDA's autocast op list (torch 2.13): each aten overload registered for ``AutocastCUDA`` ->
#: its cast policy (``autocast_mode.h``: ``CastPolicy``): ``lower_precision_fp`` (inputs cast to the
#: autocast dtype), ``fp32`` (inputs cast to float32), ``fp32_set_opt_dtype`` (output dtype set to
#: float32 unless given), ``fp32_append_dtype`` (redispatched to the overload with a dtype, float32),
#: ``promote`` (inputs cast to the widest floating type among them), ``banned``
#: (``binary_cross_entropy``: an error under autocast). Not here: ``_cudnn_rnn``, which CUDA builds
#: alone register (``aten/src/ATen/cudnn/AutocastRNN.cpp``); LSTM/GRU layers keep the CPU path.
CUDA_AUTOCAST_OPS: dict[str, str] = {
    **dict.fromkeys(_LOWER_PRECISION_FP, "lower_precision_fp"),
    **dict.fromkeys(_FP32, "fp32"),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    **dict.fromkeys(_FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(_PROMOTE, "promote"),
    "binary_cross_entropy": "banned",
}
if not torch_at_least(2, 13):
    # torch 2.8's and 2.11's autocast_mode.h (their include/ATen/autocast_mode.h): rms_norm is on no
    # list; the Dimname overloads are (AT_FORALL_FP32_SET_OPT_DTYPE, and norm.names_ScalarOpt_dim in
    # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE). 2.9, 2.10 and 2.12 are taken to be the same (not checked).
    del CUDA_AUTOCAST_OPS["rms_norm"]
    _DIMNAME_SET_OPT_DTYPE = ("prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumprod.dimname",
                              "cumsum.dimname", "sum.dim_DimnameList")  # fmt: skip
    CUDA_AUTOCAST_OPS.update(dict.fromkeys(_DIMNAME_SET_OPT_DTYPE, "fp32_set_opt_dtype"))
    CUDA_AUTOCAST_OPS["norm.names_ScalarOpt_dim"] = "fp32_append_dtype"
    _FP32_APPEND_DTYPE["norm.names_ScalarOpt_dim"] = "norm.names_ScalarOpt_dim_dtype"
if torch_at_least(2, 14):
    # torch 2.14.1 registers linalg_matrix_sqrth for AutocastCUDA (autocast_mode.cpp, on none of
    # autocast_mode.h's lists); its kernels refuse float16 and bfloat16 ("Low precision dtypes not
    # supported"), so its policy is taken to be fp32.
    CUDA_AUTOCAST_OPS["linalg_matrix_sqrth"] = "fp32"

_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU
# autocast_mode.h: each policy's wrapper runs the op under ExcludeDispatchKeyGuard(AutocastFunctionality).
_AUTOCAST_CUDA = torch._C.DispatchKey.AutocastCUDA
_NO_AUTOCAST = torch._C.DispatchKeySet(_AUTOCAST_CPU) | torch._C.DispatchKeySet(_AUTOCAST_CUDA)
# autocast_mode.cpp: binary_cross_entropy_banned.
_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)
# SoftMax.cpp: softmax/log_softmax take the half-to-float kernel for a CUDA float16 input and dtype float32.
_HALF_TO_FLOAT = {"softmax.int": "_softmax", "log_softmax.int": "_log_softmax"}


def _op(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _exists(name: str) -> bool:
    try:
        _op(name)
    except AttributeError:
        return False
    return True


def _stands_for_cuda(tensor: torch.Tensor) -> bool:
    """Whether a data-free run's ``tensor`` stands for a CUDA tensor: fake or ``meta`` (a real
    tensor in such a run is a host tensor on a GPU too)."""
    return isinstance(tensor, FakeTensor) or tensor.is_meta


def _eligible(value: Any) -> bool:
    """autocast_mode.h ``is_eligible``: a defined floating-point CUDA tensor that is not float64."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype is not torch.float64
        and _stands_for_cuda(value)
    )


class _Signature:
    """Which arguments of an op are ``Tensor``/``Tensor?`` and which ``Tensor[]``: the arguments
    ``cached_cast`` and ``promote_type`` look at (a ``Tensor?[]``, as ``index_put``'s indices, is not)."""

    def __init__(self, op: Any) -> None:
        self.names = [argument.name for argument in op._schema.arguments]
        self.kinds: dict[str, str] = {}
        for argument in op._schema.arguments:
            kind = str(argument.type)
            if kind in ("Tensor", "Optional[Tensor]"):
                self.kinds[argument.name] = "tensor"
            elif kind == "List[Tensor]":
                self.kinds[argument.name] = "list"

    def tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> torch.Tensor:
            found.append(tensor)
            return tensor

        self.map(args, kwargs, collect)
        return found

    def map(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], cast: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[list[Any], dict[str, Any]]:
        def apply(name: str, value: Any) -> Any:
            kind = self.kinds.get(name)
            if kind == "tensor" and isinstance(value, torch.Tensor):
                return cast(value)
            if kind == "list" and isinstance(value, (list, tuple)):
                return type(value)(cast(t) for t in value)
            return value

        new_args = [apply(name, value) for name, value in zip(self.names, args, strict=False)]
        return new_args, {name: apply(name, value) for name, value in kwargs.items()}


class CudaAutocast(AutocastWatch):
    """While entered: ``torch.autocast("cuda", dtype)`` regions of a data-free run (``data_free=True``)
    run as on a GPU; in a real CPU run (``data_free=False``) each such region is named through
    ``caveat`` instead (PyTorch without CUDA runs it disabled). ``count("autocast")`` is called for
    each region modelled (and ``count("softmax_half_to_float")`` for each softmax that CUDA's
    half-to-float kernel runs). Enter one at a time (``CudaKernels`` does); see the module docstring for
    the mechanism.

    As on a GPU (``aten/src/ATen/autocast_mode.cpp``, ``autocast_mode.h``, ``torch/amp/autocast_mode.py``):
    ops on CUDA's lists (:data:`CUDA_AUTOCAST_OPS`) cast their floating inputs (not float64, not
    host tensors) by their policy; ``torch.is_autocast_enabled("cuda")`` and
    ``torch.get_autocast_dtype("cuda")`` answer as on a GPU; the low-precision copy of each float32
    leaf tensor that requires grad (a parameter) is cached, once per region nest, until the outermost
    autocast region exits (``torch.clear_autocast_cache``), unless ``cache_enabled=False``;
    ``enabled=False`` regions switch it off inside; regions nest. A float16 input to ``softmax`` or
    ``log_softmax`` with ``dtype=float32`` (what the fp32 policy gives them) runs CUDA's half-to-float
    kernel, without a float32 copy of the input (``aten/src/ATen/native/SoftMax.cpp``: ``softmax``).

    What it cannot do: a ``torch.autocast("cuda")`` object made before entering (PyTorch disabled
    it then, and its ``enabled`` request is lost) runs disabled, with a caveat; a region entered
    before entering is not seen. Inside a modelled region ``torch.is_autocast_enabled("cpu")`` is
    True (the CPU state carries the CUDA one) and a ``torch.autocast("cpu")`` region there acts on
    the run's tensors, which stand for CUDA ones. ``torch.utils.checkpoint`` recomputes under the
    CPU state, as it sees CPU tensors: modelled regions carry over. Process-wide while entered: CPU
    autocast's kernels are replaced for every thread (a real CPU autocast region elsewhere casts
    nothing meanwhile), and ``torch.autocast`` and ``torch.clear_autocast_cache`` are wrapped.
    """

    def __init__(self, data_free: bool, caveat: Callable[[str], None], count: Callable[[str], None]) -> None:
        self.data_free = data_free
        self.quiet_cuda = data_free  # the region is modelled: PyTorch's "Disabling autocast" is not true
        self._caveat = caveat
        self._count = count
        self._library: Any = None
        self._included = False
        self._clear: Callable[[], None] | None = None
        # autocast_mode.cpp: cached_casts, keyed by the source (its id, with a weak reference that
        # tells a reused id), and the casts of sources that died, which stay until the cache is cleared.
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._orphans: list[torch.Tensor] = []
        self._states = threading.local()  # per thread: (region, CPU autocast state before it), innermost last

    # -- context management ---------------------------------------------------------------
    def __enter__(self) -> CudaAutocast:
        if self.data_free:
            self._register()
            self._included = not torch._C._dispatch_tls_is_dispatch_key_included(_AUTOCAST_CPU)
            torch._C._dispatch_tls_set_dispatch_key_included(_AUTOCAST_CPU, True)
            self._clear = torch.clear_autocast_cache
            torch.clear_autocast_cache = self._clear_cache
        watch(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        unwatch(self)
        if self._clear is not None:
            torch.clear_autocast_cache = self._clear
            self._clear = None
        if self._included:
            torch._C._dispatch_tls_set_dispatch_key_included(_AUTOCAST_CPU, False)
            self._included = False
        self._clear_cache()
        if self._library is not None:
            self._library._destroy()
            self._library = None

    def _register(self) -> None:
        library = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": CPU's own
                for name, policy in CUDA_AUTOCAST_OPS.items():
                    if _exists(name):
                        library.impl(name, self._kernel(name, policy), "AutocastCPU")
                for qualified in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                    name = qualified.removeprefix("aten::")
                    if qualified.startswith("aten::") and name not in CUDA_AUTOCAST_OPS:
                        library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
                for name in _HALF_TO_FLOAT:
                    for key in ("AutogradCPU", "AutogradMeta"):
                        library.impl(name, self._half_to_float(name), key)
        except BaseException:
            library._destroy()
            raise
        self._library = library

    # -- regions --------------------------------------------------------------------------
    def entered(self, region: Any, asked: bool | None) -> None:
        if region.device != "cuda" or region._enabled or torch.cuda.is_available():
            return
        dtype = region.fast_dtype
        if not self.data_free:
            if asked is not False:
                self._caveat(
                    f"torch.autocast('cuda', dtype={dtype}) ran disabled, in float32 for float32 inputs: "
                    "PyTorch without CUDA disables it; on a GPU, CUDA's autocast "
                    "(aten/src/ATen/autocast_mode.cpp) runs matmuls, convolutions and linear layers in "
                    f"{dtype} and keeps float32 for softmax, norms and losses, with smaller activations and "
                    f"a {dtype} copy of each weight; values matter here (data_free=False), so it was not "
                    "modelled."
                )
            return
        if asked is None:
            self._caveat(
                f"a torch.autocast('cuda', dtype={dtype}) made before the run was entered: PyTorch without "
                "CUDA disabled it when it was made, and whether enabled=True was asked is lost, so it ran "
                "disabled (in the inputs' dtype); make the torch.autocast inside the estimated call to have "
                "CUDA's autocast modelled."
            )
        on = bool(asked)
        if on:
            torch.set_autocast_enabled("cuda", True)  # __exit__ restores the state before the region
            self._count("autocast")
        stack = self._stack()
        stack.append((region, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        torch.set_autocast_enabled("cpu", on)
        torch.set_autocast_dtype("cpu", dtype)

    def exited(self, region: Any) -> None:
        stack = self._stack()
        for index in range(len(stack) - 1, -1, -1):
            if stack[index][0] is region:
                _, enabled, dtype = stack.pop(index)
                torch.set_autocast_enabled("cpu", enabled)
                torch.set_autocast_dtype("cpu", dtype)
                return

    def _stack(self) -> list[tuple[Any, bool, torch.dtype]]:
        stack = getattr(self._states, "stack", None)
        if stack is None:
            stack = self._states.stack = []
        return stack

    def _clear_cache(self) -> None:
        """``torch.clear_autocast_cache`` (what ``autocast.__exit__`` calls at the outermost exit):
        PyTorch's cache and this one."""
        if self._clear is not None:
            self._clear()
        self._cache.clear()
        self._orphans.clear()

    # -- casts ----------------------------------------------------------------------------
    def _cached_cast(self, to_type: torch.dtype, arg: torch.Tensor) -> torch.Tensor:
        """autocast_mode.cpp ``cached_cast``: ``arg`` cast to ``to_type`` when eligible; the cast
        of a float32 leaf that requires grad to the autocast dtype is cached."""
        if not _eligible(arg) or arg.dtype == to_type:
            return arg
        if (
            to_type == torch.get_autocast_dtype("cpu")
            and arg.dtype is torch.float32
            and arg.requires_grad
            and arg.is_leaf
            and not arg._is_view()
            and torch.is_autocast_cache_enabled()
            and not torch._C._is_cached_tensor(arg)
        ):
            found = self._cache.get(id(arg))
            if found is not None and found[0]() is arg:
                return found[1]
            if found is not None:
                self._orphans.append(found[1])  # its source died and its id was reused
            cast = arg.to(to_type)
            self._cache[id(arg)] = (weakref.ref(arg), cast)
            return cast
        return arg.to(to_type)

    def _kernel(self, name: str, policy: str) -> Callable[..., Any]:
        """The ``AutocastCPU`` kernel of ``name`` under ``policy`` (autocast_mode.h ``WrapFunction_``)."""
        op = _op(name)
        signature = _Signature(op)
        cached_cast = self._cached_cast

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
                lower = torch.get_autocast_dtype("cpu")
                if policy == "lower_precision_fp":
                    args, kwargs = signature.map(args, kwargs, lambda t: cached_cast(lower, t))
                elif policy == "fp32":
                    args, kwargs = signature.map(args, kwargs, lambda t: cached_cast(torch.float32, t))
                elif policy == "promote":
                    to_type = _promote_type(lower, signature.tensors(args, kwargs))
                    args, kwargs = signature.map(args, kwargs, lambda t: cached_cast(to_type, t))
                elif policy == "fp32_set_opt_dtype":
                    if _eligible(args[0]):
                        args, kwargs = _set_opt_dtype(signature, args, kwargs)
                elif policy == "fp32_append_dtype":
                    out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
                    return _append_dtype(name, args, kwargs, out_type)
                else:
                    raise RuntimeError(_BANNED)
                return op(*args, **kwargs)

        return kernel

    def _half_to_float(self, name: str) -> Callable[..., Any]:
        op, half_to_float = _op(name), _op(_HALF_TO_FLOAT[name])

        def kernel(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
            if input.dtype is torch.float16 and dtype is torch.float32 and _stands_for_cuda(input):
                self._count("softmax_half_to_float")
                return half_to_float(input, dim, True)
            return op.decompose(input, dim, dtype)

        return kernel


def _promote_type(lower: torch.dtype, tensors: list[torch.Tensor]) -> torch.dtype:
    """autocast_mode.h ``promote_type``/``prioritize``: float32 if any eligible input is float32,
    else the autocast dtype; float64 inputs are ignored, another floating type is an error."""
    current = lower
    for tensor in tensors:
        if not (tensor.is_floating_point() and _stands_for_cuda(tensor)):
            continue
        if tensor.dtype is torch.float64:
            continue
        if current is torch.float32 or tensor.dtype is torch.float32:
            current = torch.float32
        elif not (current == lower and tensor.dtype == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _set_opt_dtype(
    signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """autocast_mode.h ``set_opt_dtype``: the op's ``dtype`` argument, float32 unless given."""
    args, kwargs = list(args), dict(kwargs)
    index = signature.names.index("dtype")
    if index < len(args):
        if args[index] is None:
            args[index] = torch.float32
    elif kwargs.get("dtype") is None:
        kwargs["dtype"] = torch.float32
    return args, kwargs


def _append_dtype(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out_type: torch.dtype) -> Any:
    """autocast_mode.h ``fp32_append_dtype``: ``norm`` redispatched to its overload with a dtype."""
    target = _op(_FP32_APPEND_DTYPE[name])
    full = list(args)
    if name == "norm.Scalar":  # norm.Scalar(Tensor self, Scalar p=2)
        p = full[1] if len(full) > 1 else kwargs.get("p", 2)
        return target(full[0], p, dtype=out_type)
    # norm.ScalarOpt_dim(Tensor self, Scalar? p, int[1] dim, bool keepdim=False)
    names = ("self", "p", "dim", "keepdim")
    values = dict(zip(names, full, strict=False)) | kwargs
    return target(values["self"], values["p"], values["dim"], values.get("keepdim", False), dtype=out_type)
