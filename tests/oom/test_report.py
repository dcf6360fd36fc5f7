"""The report's text and to_dict read the same fields; snapshots are named per process and rank;
on a GPU PyTorch's own state is reported."""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import socket

import pytest
import torch

import memlab
from memlab.oom.names import Culprit
from memlab.oom.report import shortened, shown_path

MIB = 1 << 20
#: The small GPUs below hold their tensors and the 32 MiB cuBLAS workspace of the H100 a tracker
#: models, which the step's first matmul allocates in a segment of its own.
WORKSPACE = 32 * MIB


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    gc.collect()
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))


def grow(model, x):
    h = model(x)
    return torch.empty(48 * MIB // 4) + h.sum()


def _report() -> memlab.oom.OOMReport:
    watched = memlab.explain_oom(grow, stream=io.StringIO())
    with memlab.TensorTracker(capacity=40 * MIB + WORKSPACE, history=True):
        model = torch.nn.Linear(2048, 1024, bias=False)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, torch.ones(4, 2048))
    return memlab.oom.last_report()


def test_the_text_fits_a_screen_and_names_everything_once():
    report = _report()
    here = shown_path(__file__)  # relative to the current directory, as the text prints it
    line = grow.__code__.co_firstlineno + 2
    made = _report.__code__.co_firstlineno + 3
    call = _report.__code__.co_firstlineno + 5
    assert report.text().splitlines() == [
        f"memlab: out of memory (OutOfMemoryError) at {here}:{line} in grow; includes 1 modelled cuBLAS "
        "workspace of the H100: 32.00M",
        f"  {line:>5} | return torch.empty(48 * MIB // 4) + h.sum()",
        "  requested 48.00M (block 48.00M, new segment 48.00M) on cpu, modelled CUDA caching allocator",
        "  capacity 72.00M  reserved 54.00M  allocated 40.05M  free 18.00M",  # 32 MiB of it the workspace
        "verdict: shortage: 31.95M free in all (18.00M on the device, 13.95M cached), less than the 48.00M "
        "block requested",
        "largest live tensors:",
        f"  {'weight':<32} {'parameter':<15} {'8.00M':>9}  {here}:{made}",
        f"  {'x':<32} {'activation':<15} {'32.00K':>9}  {here}:{call}",
        f"  {'h':<32} {'unknown':<15} {'16.00K':>9}  {here}:{line - 1}",
        # a 48 MiB tensor whatever the batch, and a 48 MiB sum: nothing fits
        "remedies (predicted peak reserved, capacity 72.00M):",
        "  micro-batches of 1 (of 4), 4 accumulation steps   198.00M  does not fit",
        '  torch.autocast("cpu", torch.bfloat16) (bf16)      198.00M  does not fit',
        f"snapshot: {report.snapshot_path} (memlab viz, or pytorch.org/memory_viz)",
    ]


def test_to_dict_holds_the_same_content_as_plain_data():
    report = _report()
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    line = grow.__code__.co_firstlineno + 2
    assert data["place"] == {
        "filename": __file__,
        "line": line,
        "function": "grow",
        "code": "return torch.empty(48 * MIB // 4) + h.sum()",
    }
    assert {k: data[k] for k in ("requested", "block_size", "segment_size", "capacity", "reserved")} == {
        "requested": 48 * MIB,
        "block_size": 48 * MIB,
        "segment_size": 48 * MIB,
        "capacity": 40 * MIB + WORKSPACE,
        "reserved": 22 * MIB + WORKSPACE,
    }
    assert data["allocated"] + data["cached_free"] == data["reserved"]
    assert data["free"] == 18 * MIB
    assert data["verdict"] == "shortage"
    assert data["culprits"][0] == {
        "name": "weight",
        "category": "parameter",
        "size": 8 * MIB,
        "shape": "(1024, 2048)",
        "dtype": "float32",
        "allocated_at": f"{__file__}:{_report.__code__.co_firstlineno + 3}",
    }
    assert data["error_type"] == "OutOfMemoryError"
    assert data["message"].startswith("CUDA out of memory. Tried to allocate 48.00 MiB.")
    assert data["caught"] is False
    assert data["remedies"] == [r.to_dict() for r in report.remedies]
    for remedy in data["remedies"]:
        assert remedy["fits"] == (remedy["peak_reserved"] <= remedy["capacity"])


def _mlp_oom(capacity: str) -> memlab.oom.OOMReport:
    """An MLP on meta tensors (no data) whose known model runs out of ``capacity``: a 512 x 256
    batch (512 KiB), hidden layers of 4096 (8 MiB per activation)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 256),
    ).to("meta")
    x = torch.ones(512, 256, device="meta")
    tracker = memlab.TensorTracker(capacity=capacity, model=model)
    with (
        pytest.raises(torch.OutOfMemoryError),
        tracker,
        memlab.explain_oom(stream=io.StringIO(), remedies=False),
    ):
        tracker.adopt(roots=[model, x])
        model(x).sum().backward()
    return memlab.oom.last_report()


@pytest.mark.parametrize(
    ("capacity", "running", "holding"),
    [
        # the second layer's output does not fit; only the first layer has saved anything: the batch
        ("100 MiB", ("1", "forward"), ("0", 512 * 1024)),
        # the backward of the middle layer; the last ReLU's saved output is freed by then
        ("140 MiB", ("2", "backward"), ("1", 8 * MIB)),
    ],
)
def test_the_report_names_the_module_running_and_the_one_holding_the_most_activations(
    capacity, running, holding, monkeypatch
):
    # sized for the tensors alone: no cuBLAS workspace (PyTorch reads ":0:0" as 0 bytes)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")  # torch 2.8: cuBLASLt's own, per call
    report = _mlp_oom(capacity)
    assert (report.module, report.activations) == (running, holding)
    lines = report.text().splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("verdict: "))
    size = "512.00K" if holding[1] < MIB else "8.00M"
    assert lines[verdict + 1 : verdict + 3] == [
        f"module running: {running[0]} ({running[1]})",
        f"most activations: {holding[0]} holds {size} saved for backward",
    ]
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["module"] == {"path": running[0], "phase": running[1]}
    assert data["activations"] == {"path": holding[0], "bytes": holding[1]}


def test_without_a_known_model_the_report_names_no_module():
    report = _report()
    assert (report.module, report.activations) == (None, None)
    assert not any(
        line.startswith(("module running:", "most activations:")) for line in report.text().splitlines()
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torch_distributed_the_snapshot_is_named_by_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with memlab.explain_oom(stream=io.StringIO()) as watch:
            with memlab.TensorTracker(capacity="10 MiB", history=True):
                with pytest.raises(torch.OutOfMemoryError):
                    torch.empty(16 * MIB // 4)
    finally:
        dist.destroy_process_group()
    name = os.path.basename(watch.report.snapshot_path)
    assert name.startswith(f"memlab-oom-rank0-{os.getpid()}-") and name.endswith(".pickle")
    assert os.path.dirname(watch.report.snapshot_path) == str(tmp_path)


@pytest.mark.cuda
def test_a_gpu_oom_is_explained_from_pytorch_s_observer(tmp_path):
    torch.cuda.init()
    stream = io.StringIO()
    with memlab.explain_oom(stream=stream, snapshot_dir=tmp_path) as watch:
        keep = torch.empty(1024, device="cuda")
        _free, total = torch.cuda.mem_get_info()
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # more than the GPU has
    assert keep.is_cuda
    report = watch.report
    assert (report.device, report.source, report.verdict) == ("cuda:0", "measured (torch.cuda)", "shortage")
    assert (
        report.place.code
        == 'torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # more than the GPU has'
    )
    assert report.requested >= 2 * total
    assert report.allocated == torch.cuda.memory_allocated()


@pytest.mark.cuda
def test_a_gpu_oom_swallowed_by_a_library_is_still_reported(tmp_path):
    torch.cuda.init()
    with memlab.explain_oom(stream=io.StringIO(), snapshot_dir=tmp_path) as watch:
        _free, total = torch.cuda.mem_get_info()
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
    assert watch.report.caught
    assert watch.report.device == "cuda:0"


class Loop:
    """A training loop as trainers write it: the model and optimizer are attributes of ``self``,
    the step a bound method that takes only the batch (a tiny Hugging Face GPT-2 from its config)."""

    def __init__(self) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        self.model = GPT2LMHeadModel(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def training_step(self, ids):
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return out.loss.detach()


def test_a_hugging_face_oom_names_parameters_and_outputs_and_points_at_the_users_lines(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # sized for the tensors alone
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")  # torch 2.8: cuBLASLt's own, per call
    torch.manual_seed(0)
    with memlab.TensorTracker(capacity=int(3.5 * MIB), history=True):
        loop = Loop()
        watched = memlab.explain_oom(loop.training_step, stream=io.StringIO(), remedies=False)
        with pytest.raises(torch.OutOfMemoryError):
            watched(torch.randint(0, 512, (2, 32)))
    lines = memlab.oom.last_report().text().splitlines()
    here = shown_path(__file__)
    made = Loop.__init__.__code__.co_firstlineno + 4  # self.model = GPT2LMHeadModel(config)
    forward = Loop.training_step.__code__.co_firstlineno + 1  # out = self.model(...)
    # inside transformers and torch, the user's own line: the call that ran out, the allocations
    assert lines[:2] == [
        f"memlab: out of memory (OutOfMemoryError) at {here}:{forward + 1} in training_step",
        f"  {forward + 1:>5} | out.loss.backward()",
    ]
    start = lines.index("largest live tensors:")
    culprits = lines[start + 1 : start + 6]
    # a tensor that only autograd holds (saved for backward) has no name of its own: its shape and
    # dtype, after the named tensors of its size
    assert culprits == [
        f"  transformer.wte.weight+lm_head.weight parameter         128.00K  {here}:{made}",
        f"  out.logits                            unknown           128.00K  {here}:{forward}",
        f"  unnamed (64, 512) float32             activation        128.00K  {here}:{forward}",
        f"  transformer.h.0.mlp.c_fc.weight       parameter          64.00K  {here}:{made}",
        f"  transformer.h.0.mlp.c_proj.weight     parameter          64.00K  {here}:{made}",
    ]


def test_long_names_are_shortened_in_the_middle_keeping_what_tells_them_apart():
    culprits = tuple(
        Culprit(name, "optimizer_state", 128 * 1024, "(512, 64)", "float32", None)
        for name in (
            "AdamW.transformer.wte.weight+lm_head.weight.exp_avg",
            "AdamW.transformer.wte.weight+lm_head.weight.exp_avg_sq",
            "AdamW.transformer.h.11.mlp.c_proj.weight.exp_avg_sq",
            "weight",
        )
    )
    report = memlab.oom.OOMReport("OutOfMemoryError", "", None, culprits=culprits)
    assert report.text().splitlines()[1:] == [
        "  ",
        "  (no allocator state was captured for this error)",
        "largest live tensors:",
        "  AdamW.transform…te.weight+lm_head.weight.exp_avg optimizer_state   128.00K",
        "  AdamW.transform…weight+lm_head.weight.exp_avg_sq optimizer_state   128.00K",
        "  AdamW.transform….11.mlp.c_proj.weight.exp_avg_sq optimizer_state   128.00K",
        "  weight                                           optimizer_state   128.00K",
    ]
    assert shortened("transformer.h.0.attn", 32) == "transformer.h.0.attn"
    assert shortened("abcdefghij", 7) == "ab…ghij"


def hf_step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_optimizer_state_of_a_tied_hugging_face_weight_keeps_the_names_that_tell_it_apart(monkeypatch):
    """AdamW's first step on a tiny GPT-2 (its embedding tied to its head) runs out of memory while
    making the moments: the two moments of the tied weight differ only at the end of their names."""
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")  # torch 2.8: cuBLASLt's own, per call
    torch.manual_seed(0)
    watched = memlab.explain_oom(hf_step, stream=io.StringIO(), remedies=False)
    with memlab.TensorTracker(capacity=3968 * 1024, history=True):
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        model = GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, torch.randint(0, 512, (1, 8)))
    lines = memlab.oom.last_report().text().splitlines()
    here, first = shown_path(__file__), hf_step.__code__.co_firstlineno
    made = test_optimizer_state_of_a_tied_hugging_face_weight_keeps_the_names_that_tell_it_apart
    made = made.__code__.co_firstlineno + 11  # model = GPT2LMHeadModel(config)
    assert lines[:2] == [
        f"memlab: out of memory (OutOfMemoryError) at {here}:{first + 3} in hf_step",
        f"  {first + 3:>5} | optimizer.step()",
    ]
    start = lines.index("largest live tensors:")
    assert lines[start + 1 : start + 6] == [
        f"  transformer.wte.weight+lm_head.weight            parameter         128.00K  {here}:{made}",
        f"  transformer.wte.weight+lm_head.weight.grad       gradient          128.00K  {here}:{first + 2}",
        f"  AdamW.transform…te.weight+lm_head.weight.exp_avg optimizer_state   128.00K  {here}:{first + 3}",
        f"  AdamW.transform…weight+lm_head.weight.exp_avg_sq optimizer_state   128.00K  {here}:{first + 3}",
        f"  transformer.h.0.mlp.c_fc.weight                  parameter          64.00K  {here}:{made}",
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_remedies_being_estimated_are_shown(monkeypatch, caplog):
    monkeypatch.delenv("MEMLAB_PROGRESS", raising=False)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    caplog.set_level(logging.INFO, logger="memlab")
    report = _report()
    names = ["expandable segments", "max split size", "free held", "micro batch", "bf16 autocast"]
    names += ["fp16 autocast", "checkpointing"]
    lines = [f"memlab explain_oom: estimating {name} ({i} of 7)" for i, name in enumerate(names, 1)]
    lines.append(f"memlab explain_oom: {len(report.remedies)} remedies estimated of 7 tried")
    widths = [0, *(len(line) for line in lines)]
    # each line rewrites the one before, spaces over what is left of it
    assert (
        terminal.getvalue()
        == "".join("\r" + line.ljust(width) for line, width in zip(lines, widths, strict=False)) + "\n"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "memlab"] == [
        "explain_oom: 2 remedies estimated of 7 tried"
    ]
