"""CUDA's autocast and GradScaler in data-free runs for device="cuda", by PyTorch's rules.

Each expected number is written from the rule it follows: ``aten/src/ATen/autocast_mode.cpp``
(``cached_cast``, the ``AutocastCUDA`` registrations), ``aten/src/ATen/autocast_mode.h`` (the op
lists, ``WrapFunction_``, ``promote_type``), ``torch/amp/autocast_mode.py`` (enter, exit, nesting),
``torch/amp/grad_scaler.py`` and ``c10/cuda/CUDACachingAllocator.cpp`` (``round_size``: 512 B blocks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import memlab
from memlab._torch_version import torch_at_least
from memlab.estimate.autocast import CUDA_AUTOCAST_OPS
from memlab.estimate.kernels import CudaKernels
from memlab.sources.select import describe_source
from memlab.sources.tracker import active_tracker
from memlab.sources.workspaces import keeps_own_cublaslt
from tests.estimate.recording import Record

BLOCK = 512  # CUDACachingAllocator.cpp round_size: every block a multiple of 512 B, at least 512 B
# The cuBLAS workspace the first matmul allocates once per handle and stream (CublasHandlePool.cpp,
# getCurrentCUDABlasHandle / getChosenWorkspaceSize): 32 MiB (":4096:8") on the default GPU, an H100.
WORKSPACE = 4096 * 1024 * 8


def meta(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


# -- the acceptance step: a bias-free Linear(1024, 1024) on a (64, 1024) float32 input ----------------
W32 = rounded(1024 * 1024 * 4)  # the float32 weight (a parameter)
X32 = rounded(64 * 1024 * 4)  # the float32 input (no grad)
# cached_cast: a float32 leaf that requires grad, cast to the autocast dtype, is kept in the cache
W16 = rounded(1024 * 1024 * 2)
# cached_cast: the input is cast too (not cached: it does not require grad); mm saves it for backward
X16 = rounded(64 * 1024 * 2)
# AT_FORALL_LOWER_PRECISION_FP lists linear: its output is bfloat16
Y16 = rounded(64 * 1024 * 2)


def linear_step(keep: bool):
    dtypes = Record()

    def step(model, x):
        with torch.autocast("cuda", torch.bfloat16):
            y = model(x)
            dtypes.append(y.dtype)
        if keep:
            return y
        del y
        return None

    return step, dtypes


def test_linear_under_bf16_autocast_peaks_with_the_cast_copies():
    step, dtypes = linear_step(keep=False)
    model = torch.nn.Linear(1024, 1024, bias=False)
    estimate = memlab.estimate(step, model, torch.randn(64, 1024), device="cuda")
    assert dtypes.list() == [torch.bfloat16]
    assert estimate.method == "fake"
    assert estimate.peak_allocated == W32 + X32 + W16 + X16 + Y16 + WORKSPACE
    # the outermost region exited (autocast.__exit__ -> clear_autocast_cache) and the output was
    # dropped (its graph with the bfloat16 input): only the float32 tensors remain
    assert estimate.stats["allocated_bytes.all.current"] == W32 + X32 + WORKSPACE
    assert estimate.substituted == {"autocast": 1}
    assert estimate.caveats == []


def test_an_estimate_models_the_region_without_pytorchs_no_cuda_warning():
    """PyTorch without CUDA warns that it disables a ``torch.autocast("cuda")`` region (torch 2.8
    says it in other words); an estimate models the region, so the warning is not the user's."""
    step, _ = linear_step(keep=False)
    model = torch.nn.Linear(16, 16, bias=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memlab.estimate(step, model, torch.randn(4, 16), device="cuda")
    assert [str(warning.message) for warning in caught] == []


def test_the_graph_keeps_the_bf16_weight_only_when_backward_needs_it():
    model = torch.nn.Linear(1024, 1024, bias=False)
    step, _ = linear_step(keep=True)
    # the input does not require grad: mm saves the bfloat16 input (for the weight's gradient), not
    # the weight, so the cached weight copy goes with the cache at the region's exit
    kept = memlab.estimate(step, model, torch.randn(64, 1024), device="cuda")
    assert kept.stats["allocated_bytes.all.current"] == W32 + X32 + X16 + Y16 + WORKSPACE
    # the input requires grad: mm also saves the bfloat16 weight (for the input's gradient)
    x = torch.randn(64, 1024, requires_grad=True)
    both = memlab.estimate(step, model, x, device="cuda")
    assert both.stats["allocated_bytes.all.current"] == W32 + X32 + W16 + X16 + Y16 + WORKSPACE


def test_backward_casts_gradients_back_to_the_parameters_dtype():
    found = Record()

    def step(model, x):
        with torch.autocast("cuda", torch.bfloat16):
            y = model(x)
        transposed = y.grad_fn.next_functions[1][0]  # mm(input, weight.t()): the weight's branch
        graph = [type(y.grad_fn).__name__, type(transposed).__name__]
        graph.append(type(transposed.next_functions[0][0]).__name__)  # cached_cast's _to_copy
        found["graph"] = graph
        y.float().sum().backward()
        found["grad"] = model.weight.grad.dtype

    memlab.estimate(step, torch.nn.Linear(8, 8, bias=False), torch.randn(2, 8), device="cuda")
    assert found.dict() == {"graph": ["MmBackward0", "TBackward0", "ToCopyBackward0"], "grad": torch.float32}


# -- the op lists ------------------------------------------------------------------------------
def test_the_op_list_is_the_installed_torchs_autocast_cuda_registrations():
    registered = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    # _cudnn_rnn: CUDA builds alone register it (AutocastRNN.cpp); memlab keeps LSTMs on the CPU path
    assert set(CUDA_AUTOCAST_OPS) == {name.removeprefix("aten::") for name in registered} - {"_cudnn_rnn"}
    assert ("rms_norm" in CUDA_AUTOCAST_OPS) is torch_at_least(2, 13)
    assert ("softmax.Dimname" in CUDA_AUTOCAST_OPS) is not torch_at_least(2, 13)
    assert ("linalg_matrix_sqrth" in CUDA_AUTOCAST_OPS) is torch_at_least(2, 14)
    assert CUDA_AUTOCAST_OPS["linear"] == "lower_precision_fp"
    assert CUDA_AUTOCAST_OPS["softmax.int"] == "fp32_set_opt_dtype"
    assert CUDA_AUTOCAST_OPS["layer_norm"] == "fp32"
    assert CUDA_AUTOCAST_OPS["addcmul"] == "promote"
    assert "cat" not in CUDA_AUTOCAST_OPS  # torch 2.13: cat promotes by itself, on no list


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("softmax.int", lambda x: torch.softmax(x, -1)),  # fp32_set_opt_dtype
        ("log_softmax.int", lambda x: F.log_softmax(x, -1)),  # fp32_set_opt_dtype
        ("sum", lambda x: x.sum()),  # fp32_set_opt_dtype
        ("layer_norm", lambda x: F.layer_norm(x, (8,))),  # fp32
        ("exp", torch.exp),  # fp32
        ("mse_loss", lambda x: F.mse_loss(x, x)),  # fp32
        ("norm.Scalar", lambda x: x.norm()),  # fp32_append_dtype
    ],
)
def test_fp32_list_ops_run_in_float32(name, op):
    assert CUDA_AUTOCAST_OPS[name] in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype")
    x = meta(4, 8, dtype=torch.bfloat16)
    with CudaKernels(), torch.autocast("cuda", torch.bfloat16):
        assert op(x).dtype == torch.float32
    assert op(x).dtype == torch.bfloat16  # outside the region: the input's dtype


def test_a_loss_on_no_list_is_autocast_through_the_ops_it_calls():
    # cross_entropy_loss is on no CUDA list in torch 2.13: it runs log_softmax (fp32_set_opt_dtype)
    # and nll_loss (fp32), so its result is float32
    logits, target = meta(4, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long, device="meta")
    with CudaKernels(), torch.autocast("cuda", torch.bfloat16):
        assert F.cross_entropy(logits, target).dtype == torch.float32
        assert torch.einsum("ij,jk->ik", meta(4, 8), meta(8, 8)).dtype == torch.bfloat16  # lower


def test_promote_ops_run_in_the_widest_input_type():
    a32, b16, c16 = meta(4), meta(4, dtype=torch.bfloat16), meta(4, dtype=torch.bfloat16)
    with CudaKernels(), torch.autocast("cuda", torch.bfloat16):
        assert torch.addcmul(a32, b16, c16).dtype == torch.float32  # promote_type: float32 wins
        assert torch.addcmul(b16, b16, c16).dtype == torch.bfloat16
        assert torch.addcmul(b16, b16, meta(4, dtype=torch.float64)).dtype == torch.float64  # float64 ignored
        assert torch.cat([b16, a32]).dtype == torch.float32  # on no list: cat's own type promotion
        with pytest.raises(RuntimeError, match=r"Unexpected floating ScalarType in at::autocast::prioritize"):
            torch.addcmul(b16, b16, meta(4, dtype=torch.float16))  # prioritize: neither float32 nor bf16


def test_binary_cross_entropy_is_banned_as_on_cuda():
    x = meta(4, dtype=torch.bfloat16)
    with CudaKernels(), torch.autocast("cuda", torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"binary_cross_entropy and torch.nn.BCELoss are unsafe"):
            F.binary_cross_entropy(x, x)


# -- regions: nesting, enabled=False, the weight cache ---------------------------------------------
def test_nested_regions_and_enabled_false():
    x, w = meta(4, 8), meta(8, 8, grad=True)
    with CudaKernels() as kernels:
        with torch.autocast("cuda", torch.bfloat16):
            assert (x @ w).dtype == torch.bfloat16
            with torch.autocast("cuda", torch.float16):
                assert (x @ w).dtype == torch.float16
                with torch.autocast("cuda", enabled=False):
                    assert (x @ w).dtype == torch.float32
                    assert not torch.is_autocast_enabled("cuda")
                assert torch.is_autocast_enabled("cuda")
                assert torch.get_autocast_dtype("cuda") is torch.float16
            assert (x @ w).dtype == torch.bfloat16
        assert (x @ w).dtype == torch.float32
        assert not torch.is_autocast_enabled("cuda")
    assert kernels.substituted == {"autocast": 2}
    assert kernels.caveats == []


def test_the_weight_cast_is_cached_until_the_outermost_region_exits():
    w, x = meta(256, 256, grad=True), meta(4, 256)
    with memlab.TensorTracker() as tracker, CudaKernels():
        with torch.autocast("cuda", torch.bfloat16), torch.no_grad():
            x @ w
            x @ w
            assert (
                tracker.memory_allocated("meta") == WORKSPACE + 256 * 256 * 2
            )  # one bfloat16 copy of w, cached
            with torch.autocast("cuda", torch.bfloat16):
                x @ w
            assert (
                tracker.memory_allocated("meta") == WORKSPACE + 256 * 256 * 2
            )  # an inner exit keeps the cache
            with torch.autocast("cuda", enabled=False):
                x @ w
            assert tracker.memory_allocated("meta") == WORKSPACE + 256 * 256 * 2
        assert tracker.memory_allocated("meta") == WORKSPACE  # the outermost exit cleared the cache
        # the cached copy + x's bfloat16 copy and the output (4 x 256 x 2 B each), while an op runs
        assert tracker.max_memory_allocated("meta") == WORKSPACE + 256 * 256 * 2 + 2 * rounded(4 * 256 * 2)


def test_cache_enabled_false_casts_each_time():
    w, x = meta(256, 256, grad=True), meta(4, 256)
    with memlab.TensorTracker() as tracker, CudaKernels():
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False), torch.no_grad():
            x @ w
            assert tracker.memory_allocated("meta") == WORKSPACE  # the first matmul's; no cached cast


def test_an_autocast_made_before_runs_disabled_with_a_caveat():
    x, w = meta(4, 8), meta(8, 8, grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast."
        region = torch.autocast("cuda", torch.bfloat16)
    with CudaKernels() as kernels, region:
        assert (x @ w).dtype == torch.float32
    assert kernels.caveats == [
        "a torch.autocast('cuda', dtype=torch.bfloat16) made before the run was entered: PyTorch without "
        "CUDA disabled it when it was made, and whether enabled=True was asked is lost, so it ran disabled "
        "(in the inputs' dtype); make the torch.autocast inside the estimated call to have CUDA's autocast "
        "modelled."
    ]


def test_float16_softmax_takes_cudas_half_to_float_kernel():
    # SoftMax.cpp softmax: a CUDA float16 input with dtype=float32 runs _softmax(input, dim, true),
    # without a float32 copy of the input; a bfloat16 input is copied to float32 first
    for dtype, peak in ((torch.float16, 64 * 1024 * 4), (torch.bfloat16, 2 * 64 * 1024 * 4)):
        x = meta(64, 1024, dtype=dtype)
        with memlab.TensorTracker() as tracker, CudaKernels() as kernels:
            with torch.autocast("cuda", dtype):
                assert torch.softmax(x, -1).dtype == torch.float32
        assert tracker.max_memory_allocated("meta") == peak
        assert kernels.substituted.get("softmax_half_to_float", 0) == (dtype is torch.float16)


def test_checkpoint_recomputes_under_the_regions_autocast():
    dtypes = Record()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.linear(x)
            dtypes.append(y.dtype)
            return y.relu()

    def step(block, x):
        with torch.autocast("cuda", torch.bfloat16):
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        y.float().sum().backward()

    memlab.estimate(step, Block(), torch.randn(2, 8, requires_grad=True), device="cuda")
    # the forward, then its recomputation in backward
    assert dtypes.list() == [torch.bfloat16, torch.bfloat16]


# -- a transformer block ---------------------------------------------------------------------------
def policy_dtype(op: str) -> torch.dtype:
    """The output dtype CUDA's op list gives ``op`` on float32 inputs under bfloat16 autocast."""
    return {"lower_precision_fp": torch.bfloat16, "fp32": torch.float32}[CUDA_AUTOCAST_OPS[op]]


def test_a_transformer_block_step_has_a_gpus_dtypes():
    seen = Record()

    def step(layer, x):
        hooks = [
            module.register_forward_hook(lambda m, a, out, name=name: seen.append((name, _dtype(out))))
            for name, module in layer.named_modules()
        ]
        with torch.autocast("cuda", torch.bfloat16):
            out = layer(x)
        for hook in hooks:
            hook.remove()
        out.sum().backward()
        seen.append(("grads", {p.grad.dtype for p in layer.parameters()}))

    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    estimate = memlab.estimate(step, layer, torch.randn(2, 16, 64), device="cuda")
    linear, layer_norm = policy_dtype("linear"), policy_dtype("layer_norm")
    assert seen.list() == [
        ("self_attn", linear),  # in_proj and out_proj: F.linear; attention: scaled_dot_product_attention
        ("dropout1", linear),  # dropout is on no list: its input's dtype
        ("norm1", layer_norm),  # of x + attention: float32 + bfloat16 promotes (add is on no list)
        ("linear1", linear),
        ("dropout", linear),
        ("linear2", linear),
        ("dropout2", linear),
        ("norm2", layer_norm),
        ("", layer_norm),
        ("grads", {torch.float32}),  # each cast's backward casts the gradient back
    ]
    # bfloat16 query, key and value without a mask: CUDA's flash attention
    assert estimate.substituted == {"autocast": 1, "scaled_dot_product_attention": 1}


def _dtype(out):
    return (out[0] if isinstance(out, tuple) else out).dtype


# -- GradScaler ------------------------------------------------------------------------------------
def scaler_step(make_scaler=None):
    """A float16 autocast step with a GradScaler, recording the tracker's allocated bytes after each
    of its calls (and the peak inside unscale_)."""
    marks = Record()

    def step(model, opt, x, scaler=None):
        tracker = active_tracker()
        scaler = scaler if make_scaler is None else make_scaler()
        with torch.autocast("cuda", torch.float16):
            loss = model(x).float().pow(2).mean()
        marks["loss"] = tracker.memory_allocated()
        scaled = scaler.scale(loss)
        marks["scale"] = tracker.memory_allocated()
        scaled.backward()
        marks["backward"] = tracker.memory_allocated()
        tracker.reset_peak_memory_stats()
        scaler.unscale_(opt)
        marks["unscale_ peak"] = tracker.max_memory_allocated()
        marks["unscale_"] = tracker.memory_allocated()
        scaler.step(opt)
        marks["step"] = tracker.memory_allocated()
        scaler.update()
        marks["update"] = tracker.memory_allocated()
        marks["enabled"] = scaler.is_enabled()

    return step, marks


def grad_scaler_deltas(record):
    marks = record.dict()
    return {
        "scale": marks["scale"] - marks["loss"],
        "unscale_ peak": marks["unscale_ peak"] - marks["backward"],
        "unscale_": marks["unscale_"] - marks["backward"],
        "step": marks["step"] - marks["unscale_"],
        "update": marks["update"] - marks["step"],
    }


# grad_scaler.py, every tensor one element (a 512 B block):
SCALER = {
    # _lazy_init_scale_growth_tracker: scale (float32) and growth tracker (int32); outputs * scale
    "scale": 3 * BLOCK,
    # unscale_: inv_scale = scale.double().reciprocal().float() and found_inf, then _unscale_grads_'s
    # _MultiDeviceReplicator.get copies of both (to(device, copy=True)): four blocks at once
    "unscale_ peak": 4 * BLOCK,
    # kept: the found-inf copy, in the optimizer's state until update()
    "unscale_": BLOCK,
    # _maybe_opt_step: the flags are taken as finite and SGD (foreach, no momentum) adds no state
    "step": 0,
    # update: _amp_update_scale_ in place, the per-optimizer states (and their found-inf) dropped
    "update": -BLOCK,
}


def test_a_grad_scaler_made_in_the_step_allocates_what_an_enabled_one_does():
    step, marks = scaler_step(make_scaler=lambda: torch.amp.GradScaler("cuda"))
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    estimate = memlab.estimate(step, model, opt, torch.randn(8, 256), device="cuda")
    assert estimate.method == "fake"
    assert marks.dict()["enabled"] is True
    assert grad_scaler_deltas(marks) == SCALER
    assert estimate.substituted["grad_scaler"] == 1
    assert estimate.caveats == []


def test_a_grad_scaler_made_before_is_modelled_enabled_without_touching_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available.  Disabling."
        scaler = torch.amp.GradScaler("cuda")
    step, marks = scaler_step()
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    estimate = memlab.estimate(step, model, opt, torch.randn(8, 256), scaler, device="cuda")
    assert grad_scaler_deltas(marks) == SCALER
    assert estimate.caveats == [
        "a GradScaler('cuda') made before the run: PyTorch without CUDA disabled it when it was made, and "
        "whether enabled=True was asked is lost; modelled as an enabled GradScaler('cuda') with PyTorch's "
        "defaults (make it inside the estimated call to have it modelled as made)."
    ]
    assert vars(scaler) == {"_device": "cuda", "_enabled": False}  # the user's scaler as it was


def test_a_grad_scaler_made_disabled_stays_disabled():
    step, marks = scaler_step(make_scaler=lambda: torch.amp.GradScaler("cuda", enabled=False))
    model = torch.nn.Linear(256, 256, bias=False)
    estimate = memlab.estimate(
        step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 256), device="cuda"
    )
    assert marks.dict()["enabled"] is False
    assert grad_scaler_deltas(marks) == dict.fromkeys(SCALER, 0)
    assert "grad_scaler" not in estimate.substituted


# -- real CPU runs: said, not modelled --------------------------------------------------------------
def test_a_real_cpu_estimate_says_the_region_ran_in_float32():
    dtypes = Record()

    def step(model, x):
        with torch.autocast("cuda", torch.bfloat16):
            y = model(x)
        dtypes.append(y.dtype)
        if y.sum() > 0:  # a value: fake tensors cannot run it, the estimate runs on CPU copies
            pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's "Disabling autocast" in the real run
        estimate = memlab.estimate(step, torch.nn.Linear(8, 8), torch.randn(2, 8), device="cuda")
    assert estimate.method == "cpu"
    assert dtypes.list() == [torch.bfloat16, torch.float32]  # the fake run (given up), then the real one
    assert estimate.caveats[0] == (
        "torch.autocast('cuda', dtype=torch.bfloat16) ran disabled, in float32 for float32 inputs: PyTorch "
        "without CUDA disables it; on a GPU, CUDA's autocast (aten/src/ATen/autocast_mode.cpp) runs "
        "matmuls, convolutions and linear layers in torch.bfloat16 and keeps float32 for softmax, norms and "
        "losses, with smaller activations and a torch.bfloat16 copy of each weight; values matter here "
        "(data_free=False), so it was not modelled."
    )


def test_a_real_run_names_a_disabled_grad_scaler():
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cuda")
    with CudaKernels(data_free=False) as kernels:
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    assert kernels.caveats == [
        "GradScaler('cuda') ran disabled: PyTorch without CUDA disables it, so this run neither scaled the "
        "loss nor allocated the scaler's tensors (its scale and growth tracker, 512 B each; a 512 B "
        "found-inf flag per optimizer until update(); the scaled loss); values matter here "
        "(data_free=False), so it was not modelled."
    ]


def test_a_tracked_cpu_run_says_the_region_ran_in_float32():
    model = torch.nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memlab.TensorTracker() as tracker:
            with torch.autocast("cuda", torch.bfloat16):
                model(torch.ones(2, 8))
            with torch.autocast("cuda", enabled=False):  # asked disabled: nothing to say
                model(torch.ones(2, 8))
    # the bias addmm's cuBLAS workspace; on torch 2.9-2.11 also cuBLASLt's own 1 MiB
    own_lt = keeps_own_cublaslt()
    workspaces = (
        "2 modelled cuBLAS/cuBLASLt workspaces of the H100: 33.00M"
        if own_lt
        else "1 modelled cuBLAS workspace of the H100: 32.00M"
    )
    assert describe_source(tracker, torch.device("cpu")) == (
        "modelled: CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); tensors made "
        f"before the tracker was entered are not counted; includes {workspaces}; "
        "torch.autocast('cuda', torch.bfloat16) ran "
        "disabled, in float32 for float32 inputs (PyTorch without CUDA disables it; on a GPU CUDA's "
        "autocast op lists apply: smaller activations, cast copies of the weights)"
    )


# -- leaving ---------------------------------------------------------------------------------------
def test_exit_gives_torch_its_own_autocast_and_grad_scaler_back():
    cls, scaler = torch.amp.autocast_mode.autocast, torch.amp.GradScaler
    before = [cls.__init__, cls.__enter__, cls.__exit__, scaler.__init__, scaler.scale, scaler.step]
    with CudaKernels():
        assert torch.clear_autocast_cache is not torch._C.clear_autocast_cache
    assert [cls.__init__, cls.__enter__, cls.__exit__, scaler.__init__, scaler.scale, scaler.step] == before
    assert torch.clear_autocast_cache is torch._C.clear_autocast_cache
    # CPU autocast's own kernels again: linear in bfloat16, cat promoting
    with torch.autocast("cpu", torch.bfloat16):
        assert F.linear(torch.ones(2, 8), torch.ones(8, 8)).dtype == torch.bfloat16
    with FakeTensorMode(), CudaKernels():
        assert F.linear(torch.ones(2, 8), torch.ones(8, 8)).dtype == torch.float32  # no region, no cast
