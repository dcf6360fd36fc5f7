"""How close memlab's numbers for a GPU come to the GPU's own: real training steps, four columns.

For a zoo of training steps (an MLP, a conv net with BatchNorm, a transformer encoder with dropout, a
GPT-style decoder, an LSTM, and the transformer and the GPT-style model under bf16 autocast; AdamW;
steps 1 and 2), each column in its own process so the allocator starts empty:

- ``gpu``: the GPU's own peak allocated and reserved bytes (``torch.cuda.max_memory_allocated`` /
  ``max_memory_reserved``), from the start of the process through the end of step k;
- ``gpu_tracker``: a ``memlab.TensorTracker`` attached to that same GPU run;
- ``cpu_tracker``: the same code on CPU under ``TensorTracker(allocator="cuda", gpu=<this GPU>)``;
- ``estimate``: ``memlab.estimate(step, ..., device="cuda", gpu=<this GPU>, steps=k)`` on CPU.

It prints the columns, then one table with every difference from the GPU column and the known
causes that account for it (:data:`CAUSES`), and exits 1 when a difference has no known cause.
Without a GPU it runs the CPU columns (for ``--gpu``, default: memlab's default GPU), says the GPU
columns are missing and exits 0. Where the installed memlab's ``TensorTracker`` or ``estimate`` takes
no ``gpu=`` argument, they run without it and the output says so.
Run: ``python benchmarks/gpu_fidelity.py [--quick] [--cases mlp,gpt] [--gpu H100]``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

COLUMNS = ("gpu", "gpu_tracker", "cpu_tracker", "estimate")
STEPS = (1, 2)
MiB = 2**20
_ROOT = Path(__file__).resolve().parent.parent


# -- the zoo -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    batch: int
    width: int
    heads: int
    length: int
    layers: int
    vocab: int
    image: int


QUICK = Size(batch=4, width=32, heads=4, length=16, layers=2, vocab=128, image=16)
FULL = Size(batch=16, width=256, heads=8, length=128, layers=4, vocab=8192, image=64)


class MLP(torch.nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(s.width, 4 * s.width),
            torch.nn.ReLU(),
            torch.nn.Linear(4 * s.width, 4 * s.width),
            torch.nn.ReLU(),
            torch.nn.Linear(4 * s.width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(torch.nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        c = s.width // 2
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, c, 3, padding=1),
            torch.nn.BatchNorm2d(c),
            torch.nn.ReLU(),
            torch.nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(2 * c),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * c, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Encoder(torch.nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(s.width, s.heads, 4 * s.width, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(s.width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


class Block(torch.nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.heads = s.heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(s.width), torch.nn.LayerNorm(s.width)
        self.qkv, self.proj = torch.nn.Linear(s.width, 3 * s.width), torch.nn.Linear(s.width, s.width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(s.width, 4 * s.width), torch.nn.GELU(), torch.nn.Linear(4 * s.width, s.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.tokens, self.positions = (
            torch.nn.Embedding(s.vocab, s.width),
            torch.nn.Embedding(s.length, s.width),
        )
        self.blocks = torch.nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm, self.head = torch.nn.LayerNorm(s.width), torch.nn.Linear(s.width, s.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LSTMNet(torch.nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(s.width, s.width, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(s.width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


@dataclass(frozen=True)
class Case:
    """One training step of the zoo: its model, its batch, and what it runs that GPUs run otherwise."""

    name: str
    model: Callable[[Size], torch.nn.Module]
    batch: Callable[[Size, str], tuple[torch.Tensor, torch.Tensor]]
    bf16: bool = False
    features: frozenset[str] = frozenset()  # "conv", "dropout", "attention", "recurrent"


def _classes(s: Size, device: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(*shape, device=device), torch.randint(0, 10, (s.batch,), device=device)


def _tokens(s: Size, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, s.vocab, (s.batch, s.length + 1), device=device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


_ATTENTION = frozenset({"dropout", "attention"})


def _flat(s: Size, d: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _classes(s, d, (s.batch, s.width))


def _images(s: Size, d: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _classes(s, d, (s.batch, 3, s.image, s.image))


def _sequences(s: Size, d: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _classes(s, d, (s.batch, s.length, s.width))


CASES = {
    case.name: case
    for case in (
        Case("mlp", MLP, _flat),
        Case("conv_bn", ConvNet, _images, features=frozenset({"conv"})),
        Case("transformer", Encoder, _sequences, features=_ATTENTION),
        Case("gpt", GPT, _tokens, features=frozenset({"attention"})),
        Case("lstm", LSTMNet, _sequences, features=frozenset({"recurrent"})),
        Case("transformer_bf16", Encoder, _sequences, bf16=True, features=_ATTENTION),
        Case("gpt_bf16", GPT, _tokens, bf16=True, features=frozenset({"attention"})),
    )
}


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, bf16: bool
) -> None:
    """Forward (under ``torch.autocast("cuda", torch.bfloat16)`` when ``bf16``), cross-entropy,
    backward, AdamW step, gradients set to None."""
    region = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with region:
        out = model(x)
        loss = F.cross_entropy(out.flatten(0, -2).float(), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# -- the columns, each in its own process --------------------------------------------------------
def takes_gpu(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (``memlab.TensorTracker`` or ``memlab.estimate``) accepts ``gpu=``."""
    return "gpu" in inspect.signature(fn).parameters


def _build(
    case: Case, size: Size, device: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = case.model(size).to(device)
    return model, torch.optim.AdamW(model.parameters()), case.batch(size, device)


def worker(column: str, case: Case, size: Size, gpu: str | None) -> dict[str, Any]:
    """Peak allocated and reserved bytes through the end of each step for one column."""
    import memlab

    warnings.filterwarnings("ignore", message=".*CUDA is not available.*")  # autocast("cuda") on CPU
    out: dict[str, Any] = {"allocated": [], "reserved": []}
    if column == "gpu":
        from memlab._gpus import resolve_gpu

        this = resolve_gpu(None)
        out.update(
            name=this.name, capability=list(this.capability), tracker_allocated=[], tracker_reserved=[]
        )
        with memlab.TensorTracker(allocator="cuda") as tracker:
            model, optimizer, (x, y) = _build(case, size, "cuda")
            for _ in STEPS:
                train_step(model, optimizer, x, y, case.bf16)
                torch.cuda.synchronize()
                out["allocated"].append(torch.cuda.max_memory_allocated())
                out["reserved"].append(torch.cuda.max_memory_reserved())
                out["tracker_allocated"].append(tracker.max_memory_allocated("cuda"))
                out["tracker_reserved"].append(tracker.max_memory_reserved("cuda"))
        out["driver"] = _driver()
        return out
    if column == "cpu_tracker":
        options = {"gpu": gpu} if takes_gpu(memlab.TensorTracker) else {}
        with memlab.TensorTracker(allocator="cuda", **options) as tracker:
            model, optimizer, (x, y) = _build(case, size, "cpu")
            for _ in STEPS:
                train_step(model, optimizer, x, y, case.bf16)
                out["allocated"].append(tracker.max_memory_allocated("cpu"))
                out["reserved"].append(tracker.max_memory_reserved("cpu"))
        return out
    model, optimizer, (x, y) = _build(case, size, "cpu")
    options = {"gpu": gpu} if takes_gpu(memlab.estimate) else {}
    for steps in STEPS:
        estimate = memlab.estimate(
            train_step, model, optimizer, x, y, case.bf16, device="cuda", steps=steps, **options
        )
        out["allocated"].append(estimate.peak_allocated)
        out["reserved"].append(estimate.peak_reserved)
    out["caveats"] = estimate.caveats
    return out


def _driver() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    return "unknown"


def run_worker(column: str, case: str, quick: bool, gpu: str | None) -> dict[str, Any]:
    """Run one column of one case in a fresh process (an empty allocator); CPU columns see no GPU."""
    command = [sys.executable, __file__, "--worker", column, "--cases", case] + (["--quick"] if quick else [])
    command += ["--gpu", gpu] if gpu else []
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    )
    if column != "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}


# -- known causes of differences -----------------------------------------------------------------
@dataclass(frozen=True)
class Cause:
    """A known reason for a column to differ from the GPU's own numbers: which ``columns`` and
    ``metrics`` it touches, in which ``direction`` (+1: the column reads less than the GPU; -1: more;
    0: either), in which cases, and at most how many bytes (``math.inf``: size unknown off-GPU)."""

    name: str
    text: str
    columns: tuple[str, ...]
    metrics: tuple[str, ...]
    direction: int
    applies: Callable[[Case, Context], bool]
    bound: Callable[[Case, Context, str], float]


@dataclass(frozen=True)
class Context:
    """What the causes need to size themselves: the target GPU, the run's sizes and parameters."""

    capability: tuple[int, int]
    size: Size
    parameters: dict[str, int]  # case name -> parameter tensors
    parameter_bytes: dict[str, int]  # case name -> float32 parameter bytes
    autocast_modelled: bool


def workspace_bytes(capability: tuple[int, int], metric: str) -> int:
    """The cuBLAS workspaces of a training step, or the segments they take: one per handle and stream
    (CublasHandlePool.cpp: ``getChosenWorkspaceSize``: 4096 KiB x 8 on sm90 and newer, 4096 KiB x 2 +
    16 KiB x 8 before), and a step has two handles: the forward's thread and the autograd engine's."""
    size = 4096 * 1024 * 8 if capability >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    if metric == "reserved":  # CUDACachingAllocator: requests below 10 MiB get a 20 MiB segment
        size = 20 * MiB if size < 10 * MiB else math.ceil(size / (2 * MiB)) * 2 * MiB
    return 2 * size


NON_GPU = ("gpu_tracker", "cpu_tracker", "estimate")
BOTH = ("allocated", "reserved")
CAUSES: tuple[Cause, ...] = (
    Cause(
        "workspace",
        "cuBLAS/cuBLASLt workspaces: allocated through the caching allocator at the first matmul per "
        "thread and stream (the forward's, the autograd engine's), not tensors (CublasHandlePool.cpp); "
        "no tracker sees them, a modelled allocator only where the installed memlab models them",
        NON_GPU, BOTH, +1, lambda case, ctx: True,
        lambda case, ctx, metric: workspace_bytes(ctx.capability, metric),
    ),
    Cause(
        "cudnn_conv_workspace",
        "cuDNN convolution workspaces: allocated inside each convolution, sized by the algorithm cuDNN "
        "picks at run time",
        NON_GPU, BOTH, +1, lambda case, ctx: "conv" in case.features, lambda case, ctx, metric: math.inf,
    ),
    Cause(
        "cudnn_rnn",
        "cuDNN RNN: a flat copy of the weights and a reserve buffer whose size only cuDNN knows "
        "(cudnnGetRNNTrainingReserveSize); the CPU path keeps its gate tensors instead",
        NON_GPU, BOTH, 0, lambda case, ctx: "recurrent" in case.features, lambda case, ctx, metric: math.inf,
    ),
    Cause(
        "kernel_temporaries",
        "temporaries a CUDA kernel allocates inside one op (below the dispatcher: no tracker sees them); "
        "bounded here by 10% of the GPU's peak until a GPU run measures them",
        NON_GPU, BOTH, +1, lambda case, ctx: True, lambda case, ctx, metric: math.nan,  # see explain()
    ),
    Cause(
        "cpu_kernels",
        "the CPU run runs CPU kernels: float32 dropout masks, the math or CPU-flash attention path, "
        "the CPU LSTM, AdamW's per-tensor loop instead of foreach (up to 3x the parameters' bytes of "
        "temporaries)",
        ("cpu_tracker",), BOTH, 0, lambda case, ctx: True,
        lambda case, ctx, metric: math.inf if case.features & {"dropout", "attention", "recurrent"}
        else 3 * ctx.parameter_bytes[case.name],
    ),
    Cause(
        "autocast_on_cpu",
        "autocast('cuda') is disabled on a real CPU run: the step computes in float32 (activations up "
        "to 2x) without bf16 weight copies",
        ("cpu_tracker",), BOTH, 0, lambda case, ctx: case.bf16, lambda case, ctx, metric: math.inf,
    ),
    Cause(
        "autocast_not_modelled",
        "the installed memlab's estimate does not model CUDA autocast (DIFFERENCES marks it unhandled): "
        "the estimate computes in float32",
        ("estimate",), BOTH, 0, lambda case, ctx: case.bf16 and not ctx.autocast_modelled,
        lambda case, ctx, metric: math.inf,
    ),
    Cause(
        "host_tensors",
        "tensors a GPU keeps in host memory that a CPU run counts as 512-B device blocks: AdamW's step "
        "counters (one per parameter), memory-efficient attention's seed and offset",
        ("cpu_tracker", "estimate"), BOTH, -1, lambda case, ctx: True,
        lambda case, ctx, metric: 512 * ctx.parameters[case.name]
        + (1024 * ctx.size.layers if "attention" in case.features else 0),
    ),
    Cause(
        "segment_caching",
        "reserved bytes follow the order of allocations and frees: another order (kernel temporaries, "
        "stream-ordered frees) splits and caches segments differently, up to one 20 MiB segment",
        NON_GPU, ("reserved",), 0, lambda case, ctx: True, lambda case, ctx, metric: 20 * MiB,
    ),
)  # fmt: skip


def explain(
    case: Case, ctx: Context, column: str, metric: str, diff: int, gpu_value: int
) -> list[str] | None:
    """The known causes that together account for ``diff`` (column minus GPU), or None."""
    if diff == 0:
        return []
    found, budget = [], 0.0
    for cause in CAUSES:
        if column not in cause.columns or metric not in cause.metrics or not cause.applies(case, ctx):
            continue
        if cause.direction and (cause.direction > 0) != (diff < 0):
            continue
        bound = cause.bound(case, ctx, metric)
        found.append(cause.name)
        budget += 0.10 * gpu_value if math.isnan(bound) else bound
    return found if budget >= abs(diff) else None


# -- the report ---------------------------------------------------------------------------------
def _bytes(value: int | None) -> str:
    return "missing" if value is None else f"{value:,}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a minute or two on CPU)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--gpu", default=None, help="GPU to model without one (default: memlab's default GPU)"
    )
    parser.add_argument("--worker", choices=COLUMNS[:1] + COLUMNS[2:], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; valid: {', '.join(CASES)}")
    size = QUICK if args.quick else FULL
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, CASES[names[0]], size, args.gpu)))
        return 0

    import memlab
    from memlab._gpus import resolve_gpu
    from memlab.estimate.kernels import DIFFERENCES

    results: dict[str, dict[str, dict[str, Any]]] = {}
    has_gpu = torch.cuda.is_available()
    gpu_spec = args.gpu
    for name in names:
        results[name] = {}
        if has_gpu:
            results[name]["gpu"] = found = run_worker("gpu", name, args.quick, None)
            if "capability" in found and gpu_spec is None:
                gpu_spec = "sm{}{}".format(*found["capability"])
        for column in ("cpu_tracker", "estimate"):
            results[name][column] = run_worker(column, name, args.quick, gpu_spec or resolve_gpu(None).name)
    target = resolve_gpu(gpu_spec)

    print(
        f"gpu_fidelity: {'quick' if args.quick else 'full'} sizes, torch {torch.__version__}, "
        f"target {target.name} ({target.sm})"
    )
    for fn, label in ((memlab.TensorTracker, "TensorTracker"), (memlab.estimate, "memlab.estimate")):
        state = "passed" if takes_gpu(fn) else "not accepted by this memlab: run without it"
        print(f"{label}(gpu={target.name!r}): {state}")
    if has_gpu:
        first = next(iter(results.values()))["gpu"]
        print(f"GPU: {first.get('name', '?')}, driver {first.get('driver', '?')}")
    else:
        print("GPU column missing: no CUDA device on this machine (gpu and gpu_tracker not measured)")
    print(
        "CUDA context: excluded from every column (torch.cuda.max_memory_* count the caching allocator only)"
    )
    print()
    header = f"{'case':<18}{'step':>5}  {'metric':<10}" + "".join(f"{column:>14}" for column in COLUMNS)
    print(header + "   (bytes)")
    rows = []
    for name in names:
        gpu_run = results[name].get("gpu", {})
        for index, step in enumerate(STEPS):
            for metric in BOTH:
                values = {
                    "gpu": _pick(gpu_run, metric, index),
                    "gpu_tracker": _pick(gpu_run, f"tracker_{metric}", index),
                    "cpu_tracker": _pick(results[name]["cpu_tracker"], metric, index),
                    "estimate": _pick(results[name]["estimate"], metric, index),
                }
                rows.append((name, step, metric, values))
                print(
                    f"{name:<18}{step:>5}  {metric:<10}"
                    + "".join(f"{_bytes(values[c]):>14}" for c in COLUMNS)
                )
    errors = {
        (name, column): run["error"]
        for name, runs in results.items()
        for column, run in runs.items()
        if "error" in run
    }
    for (name, column), error in errors.items():
        print(f"{name} {column}: failed: {error}")
    if not has_gpu:
        return 1 if errors else 0

    autocast = any(d.name == "autocast" and d.handled for d in DIFFERENCES)
    models = {name: CASES[name].model(size) for name in names}
    ctx = Context(
        target.capability,
        size,
        {name: len(list(model.parameters())) for name, model in models.items()},
        {name: sum(p.numel() * 4 for p in model.parameters()) for name, model in models.items()},
        autocast,
    )
    print()
    print(f"{'case':<18}{'step':>5}  {'metric':<10}{'column':<13}{'difference':>14}  known causes")
    unexplained = 0
    for name, step, metric, values in rows:
        if values["gpu"] is None:
            continue
        for column in NON_GPU:
            if values[column] is None:
                continue
            diff = values[column] - values["gpu"]
            if diff == 0:
                continue
            causes = explain(CASES[name], ctx, column, metric, diff, values["gpu"])
            unexplained += causes is None
            text = ", ".join(causes) if causes else "NO KNOWN CAUSE"
            print(f"{name:<18}{step:>5}  {metric:<10}{column:<13}{diff:>14,}  {text}")
    print()
    for cause in CAUSES:
        print(f"{cause.name}: {cause.text}")
    print(f"{unexplained} difference(s) without a known cause")
    return 1 if unexplained or errors else 0


def _pick(run: dict[str, Any], key: str, index: int) -> int | None:
    values = run.get(key)
    return values[index] if values else None


if __name__ == "__main__":
    sys.exit(main())
