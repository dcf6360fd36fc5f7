"""memlab.estimate: data-free runs equal tracked real runs byte for byte, the user's objects untouched."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import memlab
from memlab._gpus import GPUS
from memlab._torch_version import torch_at_least
from memlab.history import categories
from memlab.sources.workspaces import keeps_own_cublaslt, workspace_sizes

KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak")
#: An H100's cuBLAS workspace (the GPU estimates model here): one per thread that runs a matmul,
#: the forward's and the autograd thread's that runs backward (memlab.sources.workspaces).
WORKSPACE = 32 * 2**20
# What a bias Linear's addmm (through cuBLASLt) keeps on an H100: the cuBLAS workspace it shares from
# torch 2.12 on; on 2.9-2.11 the cuBLAS workspace of its handle and a 1 MiB cuBLASLt one of its own
# (memlab.sources.workspaces.UNIFIED_BY_DEFAULT_SINCE; measured so on an H100 with 2.11); on 2.8 the
# cuBLAS workspace, and 1 MiB for each cuBLASLt call while it runs (its CUDABlas.cpp: CublasLtWorkspace)
# cuBLASLt's workspace besides the cuBLAS one, as the environment sets it (tests/conftest.py): torch
# 2.8's for each call, 2.9-2.11's kept per handle (memlab.sources.workspaces)
LT_CALL = 0 if torch_at_least(2, 9) else workspace_sizes(GPUS["H100"]).cublaslt
LT_WORKSPACE = WORKSPACE + 2**20 if keeps_own_cublaslt() else WORKSPACE


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    )


class GRUNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(64, 256, batch_first=True)
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def encoder() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True),
        torch.nn.Flatten(),
        torch.nn.Linear(128 * 64, 10),
    )


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


MODELS = {
    "cnn": (cnn, (16, 3, 64, 64)),
    "gru": (GRUNet, (32, 24, 64)),
    "transformer": (encoder, (16, 64, 128)),
}


def tracked_run(model, optimizer, x, y):
    """The same step for real on CPU under a tracker that counts the arguments first, in the order
    estimate adopts them (modules, optimizers, inputs)."""
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=[x, y], category=categories.INPUT)
        loss = train_step(model, optimizer, x, y)
        stats = tracker.memory_stats()
        peak = tracker.by_category(at="peak")
        end = tracker.by_category(at="now")
    del loss
    return stats, peak, end


def two_linears() -> torch.nn.Module:
    """Two bias-free ``Linear(1024, 1024)``: the model of the published check."""
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False)
    )


def forward_backward(model, x):
    loss = model(x).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_estimate_of_a_training_step_equals_the_tracked_real_run(name):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    state = {key: value.clone() for key, value in model.state_dict().items()}
    x_before = x.clone()

    estimate = memlab.estimate(train_step, model, optimizer, x, y)

    # the user's objects are untouched: same device, same values, no gradients, no optimizer state
    assert estimate.method == "fake"
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    assert not optimizer.state
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    assert torch.equal(x, x_before) and x.grad is None

    stats, peak, end = tracked_run(model, optimizer, x, y)
    assert {key: estimate.stats[key] for key in KEYS} == {key: stats[key] for key in KEYS}
    assert estimate.stats["reserved_bytes.all.peak"] > 20 * 2**20  # large-pool segments, not one 2 MiB one
    assert estimate.by_category("peak") == peak
    assert estimate.by_category("end") == end
    assert estimate.stats["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"]
    assert estimate.caveats == []


def test_published_check_two_linear_layers():
    """PyTorch issue tracker, measured on a GPU: 16,777,728 B of tensors after the forward,
    20,972,032 B after the backward (two bias-free Linear(1024, 1024), input (4, 256, 1024)); with
    the cuBLAS workspaces a GPU allocates through the caching allocator on top: the forward
    thread's, then the autograd thread's (none with ``CUBLAS_WORKSPACE_CONFIG=:0:0``)."""
    model = two_linears()
    x = torch.randn(4, 256, 1024)

    def forward(model, x):
        return model(x).sum()

    assert memlab.estimate(forward, model, x).stats["allocated_bytes.all.current"] == 16_777_728 + WORKSPACE
    assert memlab.estimate(forward_backward, model, x).stats["allocated_bytes.all.current"] == (
        20_972_032 + 2 * WORKSPACE
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
        patch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")  # torch 2.8: cuBLASLt's own, per call
        assert memlab.estimate(forward, model, x).stats["allocated_bytes.all.current"] == 16_777_728
        assert memlab.estimate(forward_backward, model, x).stats["allocated_bytes.all.current"] == 20_972_032


def test_by_category_at_the_peak_equals_sums_computed_from_the_shapes():
    model = two_linears()
    x = torch.randn(4, 256, 1024)

    estimate = memlab.estimate(forward_backward, model, x)
    weight = 1024 * 1024 * 4  # each weight and each gradient
    activation = 4 * 256 * 1024 * 4  # the hidden layer's output, saved for the second layer's backward
    # The peak is in backward after the second weight's gradient and the gradient of the hidden
    # layer (a temporary) exist, while the hidden activation is still saved.
    expected = dict.fromkeys(categories.CATEGORIES, 0)
    expected |= {
        "parameter": 2 * weight,
        "input": x.nbytes,
        "gradient": weight,
        "activation": activation,
        "temporary": activation + 512,  # the hidden layer's gradient, and backward's seed (a scalar 1)
        "unknown": 512,  # the loss, a 4-byte scalar in a 512-byte block
        "workspace": 2 * WORKSPACE,  # the forward thread's and the autograd thread's
    }
    assert estimate.by_category("peak") == expected
    assert estimate.peak_allocated == sum(expected.values()) == 25_166_848 + 2 * WORKSPACE
    end = estimate.by_category("end")
    assert (end["gradient"], end["activation"], end["temporary"]) == (2 * weight, 0, 0)


def test_an_estimate_without_stacks_has_the_same_peaks_and_categories():
    from memlab.estimate.estimate import run_estimate

    model = two_linears()

    def arguments():
        return (model, torch.randn(4, 256, 1024)), {}

    found = [run_estimate(forward_backward, arguments, torch.device("cpu"), stacks=s) for s in (True, False)]
    with_stacks, without = found
    weight, activation = 1024 * 1024 * 4, 4 * 256 * 1024 * 4  # as in the test above
    assert without.by_category("peak")["activation"] == activation
    assert without.by_category("peak")["gradient"] == weight
    assert without.by_category("peak") == with_stacks.by_category("peak")
    assert without.stats == with_stacks.stats
    frames = [e["frames"] for e in without.tracker.snapshot()["device_traces"][-1]]
    assert frames and all(f == [] for f in frames)  # no stack was walked
    assert any(e["frames"] for e in with_stacks.tracker.snapshot()["device_traces"][-1])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: dict


def test_arguments_in_containers_dataclasses_globals_and_closures_are_copied():
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)

    def uses_closure(batch):
        out = model(batch.x) + batch.extra["bias"][0]
        out.sum().backward()
        return out

    batch = Batch(torch.randn(64, 512), {"bias": [torch.ones(512)]})
    estimate = memlab.estimate(uses_closure, batch)
    assert model.weight.grad is None
    # weight 1 MiB + bias 2 KiB (512 B blocks), x 128 KiB, bias argument 2 KiB, then the run
    counted = estimate.by_category("end")
    assert counted["parameter"] == 512 * 512 * 4 + 2048
    assert counted["input"] == 64 * 512 * 4 + 2048
    assert counted["gradient"] == 512 * 512 * 4 + 2048

    namespace = {"torch": torch, "model": model}
    exec("def uses_global(x):\n    loss = model(x).sum()\n    loss.backward()\n    return loss", namespace)
    estimate = memlab.estimate(namespace["uses_global"], torch.randn(64, 512))
    assert estimate.by_category("end")["gradient"] == 512 * 512 * 4 + 2048
    assert model.weight.grad is None and namespace["model"] is model


def test_a_module_and_a_bound_method_are_copied_as_the_function():
    model = torch.nn.Linear(256, 256)
    x = torch.randn(32, 256)
    by_module = memlab.estimate(model, x)
    by_method = memlab.estimate(model.forward, x)
    assert (
        by_module.peak_allocated
        == by_method.peak_allocated
        == (256 * 256 * 4 + 1024 + 2 * 32 * 256 * 4 + LT_WORKSPACE + LT_CALL)
    )
    assert by_module.by_category("end")["parameter"] == 256 * 256 * 4 + 1024


def test_a_trainable_tensor_reached_through_another_module_is_an_error():
    other = types.ModuleType("other")
    exec(
        "import torch\nmodel = torch.nn.Linear(8, 8)\ndef loss(x):\n    return other_model(x).sum()",
        vars(other),
    )
    other.other_model = other.model

    def step(x):
        loss = other.loss(x)
        loss.backward()

    with pytest.raises(memlab.EstimateError) as error:
        memlab.estimate(step, torch.randn(2, 8))
    assert str(error.value) == (
        "fn used a tensor that requires grad and is not among its arguments or the names it uses "
        "((8, 8) float32), e.g. a parameter of a model another module holds; pass the model and optimizer "
        "to fn as arguments so that the estimate copies them"
    )
    assert other.model.weight.grad is None


def test_a_constant_tensor_reached_otherwise_is_a_caveat():
    other = types.ModuleType("other_constants")
    exec("import torch\nscale = torch.full((1000,), 2.0)\ndef f(x):\n    return x * scale", vars(other))
    estimate = memlab.estimate(lambda x: other.f(x), torch.randn(1000))
    assert estimate.caveats == [
        "1 tensor(s) (3.91K) that fn reached other than through its arguments were used but not "
        "counted (pass them as arguments to count them)"
    ]


def value_read(model, x):
    hidden = model(x)
    if hidden.mean() > 100:  # a branch on a value that depends on the weights: the run has none
        hidden = hidden * 2
    loss = hidden.sum()
    loss.backward()
    return loss


def boolean_mask(model, x):
    hidden = model(x)
    loss = hidden[hidden > 0].sum()
    loss.backward()
    return loss


@pytest.mark.parametrize(
    ("step", "op", "code"),
    [
        (
            value_read,
            "a branch on a value the estimate does not have (if, bool(), a comparison)",
            "if hidden.mean() > 100:  # a branch on a value that depends on the weights: the run has none",
        ),
        (
            boolean_mask,
            "indexing with a boolean mask",
            "loss = hidden[hidden > 0].sum()",
        ),
    ],
)
def test_a_data_dependent_op_runs_on_cpu_copies_and_equals_the_tracked_run(step, op, code):
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    x = torch.randn(128, 512)
    estimate = memlab.estimate(step, model, x)
    assert estimate.method == "cpu"
    line = next(n for n, text in enumerate(open(__file__).read().splitlines(), 1) if text.strip() == code)
    assert estimate.forced_by == f"{op} at {__file__}:{line}: {code}"
    assert model.weight.grad is None
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[x])
        loss = step(model, x)
        stats = tracker.memory_stats()
    del loss
    model.zero_grad(set_to_none=True)
    assert {key: estimate.stats[key] for key in KEYS} == {key: stats[key] for key in KEYS}


def test_estimate_text_names_the_method_the_peaks_and_what_it_cannot_see():
    model = torch.nn.Linear(1024, 1024, bias=False)

    def forward(model, x):
        return model(x).sum()

    text = repr(memlab.estimate(forward, model, torch.randn(256, 1024)))
    assert text.splitlines()[:3] == [
        "memlab estimate of test_estimate_text_names_the_method_the_peaks_and_what_it_cannot_see.<locals>."
        "forward on cpu (fake tensors; H100 (sm90) modelled: CUDA caching allocator, cuBLAS workspaces; "
        "1 step); includes 1 modelled cuBLAS workspace of the H100: 32.00M",
        "peak allocated 38.00M, active 38.00M, reserved 56.00M",
        "at the end: allocated 37.00M, reserved 56.00M",
    ]
    assert "\nworkspace           32.00M    32.00M\n" in text
    assert "not seen: cuDNN workspaces and temporaries inside one kernel, the CUDA context" in text
    html = memlab.estimate(forward, model, torch.randn(256, 1024))._repr_html_()
    assert "<b>38.00M</b>" in html and "<td>parameter</td><td>4.00M</td><td>4.00M</td>" in html


def test_fits_compares_peak_reserved_with_a_budget():
    estimate = memlab.estimate(lambda x: x * 2, torch.randn(1024))
    assert estimate.peak_reserved == 2 * 2**20
    assert estimate.fits("2 MiB") and estimate.fits(2 * 2**20)
    assert not estimate.fits("2 MiB", headroom=1)
    with pytest.raises(ValueError, match="budget 'lots' is not a size"):
        estimate.fits("lots")


def test_line_profile_gives_the_line_profiler_table_without_allocating():
    model = two_linears()

    estimate = memlab.estimate(forward_backward, model, torch.randn(4, 256, 1024))
    columns = ["allocated_bytes.all.current"]
    frame = estimate.line_profile(columns=columns).to_dataframe(columns=columns)
    tensors = [12_582_912, 16_777_728, 20_972_032, 20_972_032]
    workspaces = [0, WORKSPACE, 2 * WORKSPACE, 2 * WORKSPACE]  # forward's matmul, then backward's
    assert list(frame["allocated_bytes.all.current"]) == [
        t + w for t, w in zip(tensors, workspaces, strict=True)
    ]
    assert frame.attrs["source"] == (
        "estimated (fake tensors, cpu's kernels; memlab.estimate): CUDA caching allocator replayed from meta "
        "tensors (memlab.TensorTracker); 3 tensor storages (12.00M) existed before profiling; includes 2 "
        "modelled cuBLAS workspaces of the H100: 64.00M"
    )
    assert model[0].weight.grad is None


def test_bad_arguments_are_typed_errors():
    with pytest.raises(TypeError, match="fn must be callable"):
        memlab.estimate(3)
    with pytest.raises(ValueError, match="at must be one of 'peak', 'end'; got 'now'"):
        memlab.estimate(lambda: torch.ones(1)).by_category("now")
    with pytest.raises(ValueError, match="device"):
        memlab.estimate(lambda: torch.ones(1), device="gpu")


def test_device_meta_runs_meta_kernels_which_allocate_differently_for_a_gru():
    torch.manual_seed(0)
    model = torch.nn.GRU(64, 128, batch_first=True)
    x = torch.randn(8, 16, 64)

    def forward_backward(model, x):
        out, _ = model(x)
        out.sum().backward()

    on_meta = memlab.estimate(forward_backward, model, x, device="meta")
    on_cpu = memlab.estimate(forward_backward, model, x)
    assert (on_meta.method, on_cpu.method) == ("meta", "fake")
    meta_model, meta_x = torch.nn.GRU(64, 128, batch_first=True, device="meta"), x.to("meta")
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[meta_model])
        tracker.adopt(roots=[meta_x])
        forward_backward(meta_model, meta_x)
        peak = tracker.max_memory_allocated()
    assert on_meta.peak_allocated == peak
    assert on_meta.peak_allocated != on_cpu.peak_allocated  # meta's GRU decomposes differently from CPU's


@pytest.mark.cuda
def test_estimate_of_a_gpu_step_is_close_to_the_gpus_own_peak():
    """On a GPU the estimate runs fake CUDA tensors (CUDA's own kernels) and models the GPU in
    use, cuBLAS workspaces included. cuDNN workspaces are allocated through the caching allocator
    on a GPU but not seen by an estimate, hence the tolerance; the numbers are printed for the
    README."""
    torch.manual_seed(0)
    model = encoder().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64, 128, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    estimate = memlab.estimate(train_step, model, optimizer, x, y)
    assert estimate.method == "fake" and estimate.device.type == "cuda"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, optimizer, x, y)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated()
    print(f"estimate peak allocated {estimate.peak_allocated}, GPU {real}")
    assert abs(estimate.peak_allocated - real) <= 0.05 * real


def test_device_cuda_keeps_what_cudas_kernels_keep_and_device_cpu_the_cpu_path():
    from tests.estimate.test_kernels import FF, HEADS, B, E, L, cpu_only_bytes, cuda_only_bytes

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.1, batch_first=True)
    x = torch.randn(B, L, E)
    on_cuda = memlab.estimate(layer, x, device="cuda")
    on_cpu = memlab.estimate(layer, x, device="cpu")
    assert on_cuda.substituted == {"scaled_dot_product_attention": 1, "dropout": 3}
    assert on_cpu.substituted == {}
    saved_cuda, saved_cpu = on_cuda.by_category("end")["activation"], on_cpu.by_category("end")["activation"]
    assert saved_cpu - saved_cuda == cpu_only_bytes() - cuda_only_bytes() == 3072
    assert saved_cuda == 16384
    assert "CUDA's kernels substituted: scaled_dot_product_attention x1, dropout x3" in repr(on_cuda)

    optimizer = torch.optim.AdamW(layer.parameters())

    def step(layer, optimizer, x):
        layer(x).sum().backward()
        optimizer.step()

    assert memlab.estimate(step, layer, optimizer, x, device="cuda").substituted["optimizer_foreach"] == 1
    assert optimizer.param_groups[0]["foreach"] is None  # the user's optimizer keeps its own setting


def test_device_cuda_names_what_it_does_not_handle():
    torch.manual_seed(0)
    model = GRUNet()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(4, 6, 64), torch.randint(0, 10, (4,))
    estimate = memlab.estimate(train_step, model, optimizer, x, y, device="cuda")
    assert len(estimate.caveats) == 2
    assert estimate.caveats[0].startswith("aten.gru (torch.nn.GRU): on CUDA cuDNN runs it (aten._cudnn_rnn)")
    assert estimate.caveats[1] == (
        "6 optimizer step counter(s) are counted here (3.00K in 512-byte blocks); a non-capturable, "
        "non-fused optimizer keeps them in host memory on a GPU"
    )
    assert estimate.caveats == memlab.estimate(train_step, model, optimizer, x, y, device="cuda").caveats
    assert memlab.estimate(train_step, model, optimizer, x, y, device="cpu").caveats == []


class Trainer:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(128, 128)
        self.steps = 0

    def loss(self, x):
        self.steps += 1
        return self.model(x).mean()

    def step(self, x):
        loss = self.loss(x)
        loss.backward()
        return loss


def test_a_method_of_a_plain_object_uses_copies_of_its_modules():
    trainer = Trainer()
    estimate = memlab.estimate(trainer.step, torch.randn(16, 128))
    assert estimate.by_category("end")["gradient"] == 128 * 128 * 4 + 512
    assert trainer.model.weight.grad is None and trainer.steps == 0  # a shallow copy counted the call
    wrapped = memlab.autobatch(trainer.loss, micro_batch=4)
    wrapped(torch.randn(16, 128))
    assert trainer.model.weight.grad is not None and trainer.steps == 4


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "loss",
    [
        lambda out, y, reduction: torch.nn.functional.mse_loss(out, y, reduction=reduction),
        lambda out, y, reduction: torch.nn.functional.smooth_l1_loss(out, y, reduction=reduction, beta=0.5),
        lambda out, y, reduction: torch.nn.functional.binary_cross_entropy(
            torch.sigmoid(out), torch.sigmoid(y), reduction=reduction
        ),
        lambda out, y, reduction: torch.nn.functional.soft_margin_loss(
            out, torch.sign(y), reduction=reduction
        ),
        lambda out, y, reduction: torch.nn.functional.cross_entropy(out, y.softmax(-1), reduction=reduction),
    ],
    ids=["mse", "smooth_l1", "bce", "soft_margin", "cross_entropy"],
)
def test_losses_that_keep_a_full_storage_are_counted_as_their_kernels_allocate(loss, reduction):
    """mse_loss and a few others compute the unreduced loss into the output's storage and reduce it
    in place: the 0-dim result keeps an input-sized storage on CPU; their meta kernels do not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    x, y = torch.randn(1280, 256), torch.randn(1280, 256)

    def step(model, x, y):
        out = loss(model(x), y, reduction)
        out.sum().backward()
        return out

    estimate = memlab.estimate(step, model, x, y)
    with memlab.TensorTracker() as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[x, y])
        out = step(model, x, y)
        stats = tracker.memory_stats()
    del out
    model.zero_grad(set_to_none=True)
    keys = (*KEYS, "allocated_bytes.all.current")
    assert {key: estimate.stats[key] for key in keys} == {key: stats[key] for key in keys}


# -- the GPU an estimate models: its cuBLAS workspaces ------------------------------------------------
H100_WORKSPACE = 4096 * 8 * 1024  # CublasHandlePool.cpp: parseChosenWorkspaceSize, sm90: ":4096:8"
A100_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8  # any other GPU: ":4096:2:16:8"


def linear_step():
    """The bias-free Linear(1024, 1024) on a (64, 1024) float32 input that needs no gradient."""
    layer = torch.nn.Linear(1024, 1024, bias=False)
    x = torch.randn(64, 1024)

    def step(layer, x):
        return layer(x)

    return step, layer, x


def test_the_linear_step_for_an_h100_and_an_a100_differs_by_their_workspaces():
    step, layer, x = linear_step()
    h100 = memlab.estimate(step, layer, x, device="cuda", gpu="H100")
    a100 = memlab.estimate(step, layer, x, device="cuda", gpu="A100")
    weight, batch, out = 1024 * 1024 * 4, 64 * 1024 * 4, 64 * 1024 * 4  # each a multiple of 512 B
    assert h100.peak_allocated == weight + batch + out + H100_WORKSPACE
    assert a100.peak_allocated == weight + batch + out + A100_WORKSPACE
    assert h100.peak_allocated - a100.peak_allocated == H100_WORKSPACE - A100_WORKSPACE == 25_034_752
    assert h100.by_category("peak")["workspace"] == h100.by_category("end")["workspace"] == H100_WORKSPACE
    assert (h100.gpu.name, a100.gpu.name) == ("H100", "A100")
    assert repr(a100).splitlines()[0] == (
        "memlab estimate of linear_step.<locals>.step on cuda (fake tensors; A100 (sm80) modelled: CUDA "
        "caching allocator, cuBLAS workspaces; 1 step); includes 1 modelled cuBLAS workspace of the A100: "
        "8.12M"
    )
    assert a100.workspaces.nbytes == A100_WORKSPACE == 8_519_680  # :4096:2:16:8 on sm80


@pytest.mark.parametrize(
    ("config", "workspace"),
    [
        (":4096:2", 4096 * 1024 * 2),
        (":4096:2:16", 4096 * 1024 * 2),
        (":16:8:16:8", 2 * 16 * 1024 * 8),
        (":0:0", 0),
    ],
)
def test_cublas_workspace_config_changes_the_estimate_as_pytorchs_parser_would(
    monkeypatch, config, workspace
):
    step, layer, x = linear_step()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    for gpu in ("H100", "A100"):  # the configuration replaces either default
        estimate = memlab.estimate(step, layer, x, device="cuda", gpu=gpu)
        assert estimate.peak_allocated == 1024 * 1024 * 4 + 2 * 64 * 1024 * 4 + workspace


def test_a_malformed_cublas_workspace_config_warns_and_keeps_the_default(monkeypatch):
    step, layer, x = linear_step()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "4096:8")
    with pytest.warns(UserWarning, match="^Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace"):
        estimate = memlab.estimate(step, layer, x, device="cuda", gpu="A100")
    assert estimate.by_category("end")["workspace"] == A100_WORKSPACE


def test_a_step_without_a_matmul_allocates_no_workspace():
    x = torch.randn(64, 1024)
    estimate = memlab.estimate(lambda x: torch.nn.functional.gelu(x).softmax(-1), x, device="cuda")
    assert estimate.by_category("peak")["workspace"] == 0
    assert estimate.peak_allocated == 3 * 64 * 1024 * 4


def test_a_training_step_has_the_forward_threads_and_the_autograd_threads_workspaces():
    layer = torch.nn.Linear(1024, 1024, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step(layer, optimizer, x):
        optimizer.zero_grad()
        layer(x).sum().backward()
        optimizer.step()

    estimate = memlab.estimate(
        step, layer, optimizer, torch.randn(64, 1024), device="cuda", gpu="A100", steps=2
    )
    assert estimate.by_category("end")["workspace"] == 2 * A100_WORKSPACE
    keys = [key[3] for key in estimate.tracker.workspaces.keys]
    assert len(keys) == 2 and keys[1] == "autograd"


def test_naming_a_gpu_estimates_for_cuda_and_every_estimate_names_its_gpu():
    step, layer, x = linear_step()
    named = memlab.estimate(step, layer, x, gpu=(8, 0))
    assert named.device.type == "cuda" and named.gpu.name == "A100"
    on_cpu = memlab.estimate(step, layer, x)
    assert on_cpu.device.type == "cpu" and on_cpu.gpu.name == "H100"  # a tracked CPU run models one too
    assert on_cpu.by_category("end")["workspace"] == H100_WORKSPACE
    with pytest.raises(ValueError, match=r"^gpu 'Z80' is not a GPU memlab knows; valid: a GPU name"):
        memlab.estimate(step, layer, x, gpu="Z80")


def test_convolutions_on_cuda_name_cudnns_workspace_in_the_caveats():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 2))

    def step(model, x):
        model(x).sum().backward()

    x = torch.randn(2, 3, 8, 8)
    on_cuda = memlab.estimate(step, model, x, device="cuda")
    (caveat,) = [c for c in on_cuda.caveats if "cuDNN" in c]
    assert caveat == (
        "aten.convolution, aten.convolution_backward ran: on CUDA, cuDNN allocates a workspace through the "
        "caching allocator for each convolution call (forward and backward) and frees it when the call "
        "returns; its size depends on the algorithm cuDNN picks at run time (torch.backends.cudnn.benchmark, "
        "the free memory), so it is not modelled and can raise the peak by the largest such workspace "
        "(aten/src/ATen/native/cudnn/Conv_v8.cpp)."
    )
    assert f"caveat: {caveat}" in repr(on_cuda)
    assert not any("cuDNN" in c for c in memlab.estimate(step, model, x, device="cpu").caveats)
    linear_only = memlab.estimate(lambda x: x @ x, torch.randn(8, 8), device="cuda")
    assert linear_only.caveats == []


def test_the_estimate_hands_its_gpu_to_cudas_kernels(monkeypatch):
    from memlab.estimate import kernels

    made = []
    original = kernels.CudaKernels.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.gpu.name)

    monkeypatch.setattr(kernels.CudaKernels, "__init__", record)
    step, layer, x = linear_step()
    memlab.estimate(step, layer, x, gpu="L4")
    memlab.estimate(step, layer, x, device="cuda")
    assert made == ["L4", "H100"]
    assert kernels.CudaKernels().gpu.name == "H100"


# -- grad modes --------------------------------------------------------------------------------------
class TinyAttention(torch.nn.Module):
    """One projection and causal scaled-dot-product attention in float16 (2 x 4 heads x 16 x 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 16).permute(2, 0, 3, 1, 4).half().unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_an_estimate_under_inference_mode_counts_the_workspace_as_under_no_grad(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with torch.no_grad(), memlab.TensorTracker(gpu="H100") as tracker:  # ground truth: a tracked run
        model(x)
    with mode():
        estimate = memlab.estimate(lambda model, x: model(x), model, x, device="cuda", gpu="H100")
    assert estimate.by_category("peak")["workspace"] == LT_WORKSPACE + LT_CALL
    # the first Linear's output (32x256 float32), the workspace, ReLU's output; the input counted too;
    # torch 2.8: at the second Linear's cuBLASLt call, its output (8,192 B) and workspace instead
    last = 8_192 + LT_CALL if LT_CALL else 32_768
    assert tracker.max_memory_allocated() == 32_768 + LT_WORKSPACE + last
    assert estimate.by_category("peak")["input"] == 8_192
    parameters = estimate.by_category("peak")["parameter"]
    assert estimate.peak_allocated - 8_192 - parameters == 32_768 + LT_WORKSPACE + last


def test_an_estimate_under_inference_mode_runs_cudas_attention_as_under_no_grad():
    model, x = TinyAttention(), torch.randn(2, 16, 64)
    with torch.no_grad():
        no_grad = memlab.estimate(lambda model, x: model(x), model, x, device="cuda", gpu="A100")
    with torch.inference_mode():
        inference = memlab.estimate(lambda model, x: model(x), model, x, device="cuda", gpu="A100")
    assert no_grad.substituted == inference.substituted == {"scaled_dot_product_attention": 1}
    assert [inference.stats[key] for key in KEYS] == [no_grad.stats[key] for key in KEYS]
    assert inference.by_category("peak") == no_grad.by_category("peak")


def test_a_step_rerun_on_cpu_copies_says_it_ran_twice(capsys):
    from memlab.estimate.result import RERUN

    def step(model, x):
        print("called")  # a side effect outside the objects an estimate copies and puts back
        hidden = model(x)
        if hidden.mean() > 100:  # a value the fake run has not: the estimate runs again, for real
            hidden = hidden * 2
        return hidden.sum()

    estimate = memlab.estimate(step, torch.nn.Linear(16, 16), torch.randn(4, 16))
    assert estimate.method == "cpu"
    assert capsys.readouterr().out == "called\ncalled\n"
    assert estimate.caveats == [RERUN]
    assert f"caveat: {RERUN}" in repr(estimate)
    fake = memlab.estimate(lambda model, x: model(x).sum(), torch.nn.Linear(16, 16), torch.randn(4, 16))
    assert (fake.method, fake.caveats) == ("fake", [])
