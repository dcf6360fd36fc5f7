"""Remedies hold when applied: each one the report marks "fits" runs, right after the failure, from
the allocator state the process is in (its cached segments, the blocks of the live model, gradients,
optimizer state and inputs), under the same tracker and capacity, for two training steps."""

from __future__ import annotations

import gc
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memlab
from memlab._gpus import GPUS
from memlab._torch_version import torch_at_least
from memlab.oom.postmortem import NOTE_WIDTH, replay_peak, trace_events
from memlab.oom.report import shown_path
from memlab.oom.step import Accumulation
from memlab.plan.checkpointing import checkpoint as checkpoint_blocks
from memlab.sources.workspaces import workspace_sizes
from tests.oom.test_step import Net, train_step

MIB = 1 << 20
#: The two 32 MiB cuBLAS workspaces of the H100 a tracker models (the forward's thread's and the
#: autograd thread's), each a segment of its own, on top of each scenario's memory for tensors.
WORKSPACES = 64 * MIB
VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 512, 128, 4, 3, 64


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    gc.collect()
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, WIDTH))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = torch.nn.LayerNorm(WIDTH), Attention(), torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """Token and position embeddings, transformer blocks, a language-model head; ``checkpointing``
    runs each block under activation checkpointing, as a user applies that remedy."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Embedding(CONTEXT, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.checkpointing = False

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(self.ln(x))


def lm_loss(model, idx, targets):
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


def lm_step(model, optimizer, idx, targets):
    loss = lm_loss(model, idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _lm_failure(remedies: bool = True):
    """AdamW on a small GPT at batch 16 in 44 MiB: step 1 fits, step 2 (with the optimizer state)
    runs out of memory. Returns the report, the tracker and the live objects right after it."""
    torch.manual_seed(0)
    watched = memlab.explain_oom(lm_step, stream=io.StringIO(), remedies=remedies)
    tracker = memlab.TensorTracker(capacity=44 * MIB + WORKSPACES, history=True)
    with tracker:
        model = GPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, VOCAB, (16, CONTEXT))
        targets = torch.randint(0, VOCAB, (16, CONTEXT))
        watched(model, optimizer, idx, targets)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, idx, targets)
    gc.collect()  # the failing call's frames are gone, as after an except block
    return memlab.oom.last_report(), tracker, (model, optimizer, idx, targets)


def _apply(remedy, tracker, model, optimizer, idx, targets) -> int:
    """Two training steps with ``remedy`` applied as a user writes it, under ``tracker``; the peak
    reserved bytes from now on."""
    tracker.reset_peak_memory_stats()
    with tracker:
        for _ in range(2):
            if remedy.kind == "micro_batch":
                micro, steps = remedy.details["micro_batch"], remedy.details["accumulation_steps"]
                for part, part_targets in zip(idx.split(micro), targets.split(micro), strict=True):
                    (lm_loss(model, part, part_targets) / steps).backward()
                optimizer.step()
                optimizer.zero_grad()
            elif remedy.kind == "autocast_bf16":
                with torch.autocast("cpu", torch.bfloat16):
                    lm_step(model, optimizer, idx, targets)
            else:
                assert remedy.kind == "checkpointing"
                blocks = [model.get_submodule(name) for name in remedy.details["checkpointed"]]
                checkpoint_blocks(blocks)  # the blocks the remedy names, as memlab.plan applies them
                lm_step(model, optimizer, idx, targets)
    return tracker.max_memory_reserved()


def test_every_remedy_marked_fits_completes_two_steps_when_applied_right_after_the_failure():
    report, _, _ = _lm_failure()
    assert report.verdict == "fragmentation"
    # torch 2.8: each cuBLASLt call (GPT-2's Conv1D addmm) also takes its own 1 MiB workspace (a
    # 2 MiB small-pool segment), so micro-batches of 12 no longer fit the 108 MiB; 8 do; bf16 peaks
    # at 118 MiB (with CUBLASLT_WORKSPACE_SIZE=0 torch 2.8 gives the numbers below for 2.9 on)
    per_call = not torch_at_least(2, 9) and workspace_sizes(GPUS["H100"]).cublaslt > 0
    micro, bf16 = (8, 118 * MIB) if per_call else (12, 112 * MIB)
    assert [(r.action, r.peak_reserved, r.fits) for r in report.remedies] == [
        ("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:1024", 112 * MIB, False),
        (f"micro-batches of {micro} (of 16), 2 accumulation steps", 108 * MIB, True),
        ('torch.autocast("cpu", torch.bfloat16) (bf16)', bf16, False),
        ("checkpoint 1 of the 3 Block blocks (blocks.0)", 108 * MIB, True),  # memlab.plan's least
    ]
    # the history before the failing call, replayed under expandable segments (what a restart with
    # them meets), already runs out of the capacity at a 32 MiB workspace: left out, with a note
    assert report.notes[0].startswith(
        "expandable segments: not estimated: OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "32.00 MiB. GPU 0 has a total capacity of 108.00 MiB of which 28.00 MiB is free."
    )
    assert len(report.notes[0]) == NOTE_WIDTH and report.notes[0].endswith("…")  # one line, cut
    assert f"note: {report.notes[0]}" in report.text().splitlines()
    for remedy in report.remedies:
        if remedy.kind in ("expandable_segments", "max_split_size_mb"):
            continue  # a restart with another allocator setting: see the test below
        _, tracker, live = _lm_failure(remedies=False)
        if remedy.fits:
            # the same numbers as the estimate from the state at the failure, byte for byte
            assert _apply(remedy, tracker, *live) == remedy.peak_reserved
        else:
            with pytest.raises(torch.OutOfMemoryError):
                _apply(remedy, tracker, *live)


@pytest.fixture
def without_workspaces(monkeypatch):
    """The pinned-segment scenario is one of small-pool segments and allocator settings, sized for
    its tensors alone: run it with no cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG=:0:0``, which
    PyTorch reads as 0 bytes). The GPT scenario above keeps the workspaces."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")  # torch 2.8: cuBLASLt's own, per call


def _pinned_failure(history: bool = True, remedies: bool = True):
    """Ten 2 MiB small-pool segments, each kept by a 4-byte tensor after the two 1 MiB tensors
    beside it were freed: 20 MiB of cached segments that no retry path can release. Then a step at
    batch 2048 in 128 MiB fails. Returns the report, the tracker and what is live right after."""
    torch.manual_seed(0)
    watched = memlab.explain_oom(train_step, stream=io.StringIO(), remedies=remedies)
    tracker = memlab.TensorTracker(capacity="128 MiB", history=history)
    with tracker:
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tags, beside = [], []
        for _ in range(10):
            beside.append(torch.empty(MIB // 4 - 128))
            tags.append(torch.zeros(1))
            beside.append(torch.empty(MIB // 4))
        del beside
        x, y = torch.randn(2048, 1024), torch.randn(2048, 1024)
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, x, y)
    gc.collect()
    return memlab.oom.last_report(), tracker, (model, optimizer, x, y, tags)


@pytest.mark.usefixtures("without_workspaces")
def test_a_remedy_that_fits_from_an_empty_allocator_but_not_from_the_state_is_not_marked_fits():
    report, tracker, (model, optimizer, x, y, tags) = _pinned_failure()
    assert len(tags) == 10
    bf16 = next(r for r in report.remedies if r.kind == "autocast_bf16")
    assert (bf16.peak_reserved, bf16.fits) == (140 * MIB, False)
    # from an empty allocator the same two steps would fit, with 6 MiB to spare
    with torch.autocast("cpu", torch.bfloat16):
        empty = memlab.estimate(train_step, model, optimizer, x, y, steps=2)
    assert empty.peak_reserved == 122 * MIB
    # and applied right after the failure, they do not
    tracker.reset_peak_memory_stats()
    with tracker, torch.autocast("cpu", torch.bfloat16), pytest.raises(torch.OutOfMemoryError):
        for _ in range(2):
            train_step(model, optimizer, x, y)


@pytest.mark.usefixtures("without_workspaces")
def test_an_allocator_setting_is_predicted_for_whole_steps_from_a_restart_with_it(monkeypatch):
    report, _, _ = _pinned_failure()
    remedy = next(r for r in report.remedies if r.kind == "expandable_segments")
    assert (remedy.peak_reserved, remedy.fits, remedy.unsure) == (142 * MIB, False, None)
    # a replay of the history up to the failing request alone would have said 122 MiB: "fits"
    with open(report.snapshot_path, "rb") as file:
        events = trace_events(pickle.load(file))
    assert replay_peak(events, "expandable_segments:True", report.requested) == 122 * MIB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    restarted, _, _ = _pinned_failure(remedies=False)  # the program again, with the setting: it fails
    assert restarted.message.startswith("CUDA out of memory.")


@pytest.mark.usefixtures("without_workspaces")
def test_without_history_the_report_shows_margins_and_says_why():
    report, _, _ = _pinned_failure(history=False)
    lines = report.text().splitlines()
    start = lines.index("remedies (predicted peak reserved, capacity 128.00M):")
    assert lines[start + 1 :] == [
        "  micro-batches of 1706 (of 2048), 2 accumulation steps       102.00M  margin 26.00M",
        '  torch.autocast("cpu", torch.bfloat16) (bf16)                122.00M  margin 6.00M',
        "  checkpoint 4 of the 4 Block blocks (blocks.0 to blocks.3)   122.00M  margin 6.00M",
        "  a margin is no promise: the state at the failure is unknown (no history), so estimated from an "
        "empty allocator",
    ]
    data = report.to_dict()["remedies"][1]
    assert (data["fits"], data["margin"]) == (None, 6 * MIB)
    assert data["unsure"] == (
        "the state at the failure is unknown (no history), so estimated from an empty allocator"
    )


class _Optimizer:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def step(self) -> None:
        self.calls.append("step")

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")


class _Copies:
    def __init__(self, calls: list[str]) -> None:
        self.optimizers, self.modules = [_Optimizer(calls)], []


@pytest.mark.parametrize("zero_first", [False, True])
def test_accumulation_steps_once_per_batch_and_zeroes_only_finished_steps(zero_first):
    calls: list[str] = []
    copies = _Copies(calls)
    optimizer = copies.optimizers[0]
    accumulation = Accumulation(3)
    for index in range(6):  # two batches of three micro-batches
        with accumulation(copies, index):  # a step that zeroes the gradients first, or last
            if zero_first:
                optimizer.zero_grad()
            calls.append("backward")
            optimizer.step()
            if not zero_first:
                optimizer.zero_grad()
    assert "step" not in vars(optimizer) and "zero_grad" not in vars(optimizer)  # the class's again
    batch = ["backward", "backward", "backward", "step", "zero_grad"]
    if zero_first:
        batch = ["zero_grad", "backward", "backward", "backward", "step"]
    assert calls == batch * 2


#: A tiny Hugging Face GPT-2 built from its config: 2 layers, width 64, 4 heads, vocabulary 512,
#: context 128; AdamW at batch 8 x 128 runs out of 36 MiB in the forward of its first step.
HF_BATCH, HF_CONTEXT = 8, 128


def hf_step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _hf_failure(remedies: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    watched = memlab.explain_oom(hf_step, stream=io.StringIO(), remedies=remedies)
    tracker = memlab.TensorTracker(capacity=36 * MIB, history=True)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=HF_CONTEXT)
    with tracker:
        model = GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 512, (HF_BATCH, HF_CONTEXT))
        with pytest.raises(torch.OutOfMemoryError):
            watched(model, optimizer, ids)
    gc.collect()
    return memlab.oom.last_report(), tracker, (model, optimizer, ids)


def _apply_hf(remedy, tracker, model, optimizer, ids) -> int:
    """Two training steps of the Hugging Face model with ``remedy`` applied as a user writes it."""
    tracker.reset_peak_memory_stats()
    with tracker:
        if remedy.kind == "checkpointing":  # the layers the remedy names, with their own switch
            checkpoint_blocks([model.get_submodule(name) for name in remedy.details["checkpointed"]])
        for _ in range(2):
            if remedy.kind == "micro_batch":
                micro, steps = remedy.details["micro_batch"], remedy.details["accumulation_steps"]
                for part in ids.split(micro):
                    (model(input_ids=part, labels=part).loss / steps).backward()
                optimizer.step()
                optimizer.zero_grad()
            elif remedy.kind == "autocast_bf16":
                with torch.autocast("cpu", torch.bfloat16):
                    hf_step(model, optimizer, ids)
            else:
                hf_step(model, optimizer, ids)
    return tracker.max_memory_reserved()


@pytest.mark.usefixtures("without_workspaces")
def test_a_hugging_face_model_is_checkpointed_its_own_way_and_every_remedy_holds():
    report, _, (model, _, _) = _hf_failure()
    lines = report.text().splitlines()
    line = hf_step.__code__.co_firstlineno + 1
    assert lines[:2] == [
        f"memlab: out of memory (OutOfMemoryError) at {shown_path(__file__)}:{line} in hf_step",
        f"  {line:>5} | loss = model(input_ids=ids, labels=ids).loss",
    ]
    start = lines.index("remedies (predicted peak reserved, capacity 36.00M):")
    assert lines[start + 1 : start + 6] == [
        "  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True            42.00M  does not fit",
        "  PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:1024              40.00M  does not fit",
        "  micro-batches of 5 (of 8), 2 accumulation steps             36.00M  fits",
        '  torch.autocast("cpu", torch.bfloat16) (bf16)                36.00M  fits',
        "  checkpoint 1 of the 2 GPT2Block blocks (transformer.h.0)    36.00M  fits",
    ]
    assert not report.notes
    checkpointing = report.remedies[-1]
    assert checkpointing.details == {
        "block": "GPT2Block",
        "blocks": 2,
        "checkpointed": ["transformer.h.0"],
        "transformers": True,  # each layer through its own switch
    }
    # the estimate checkpointed a copy: the user's model is as it was
    assert (model.is_gradient_checkpointing, model.config.use_cache) == (False, True)
    for remedy in report.remedies[2:]:
        _, tracker, live = _hf_failure(remedies=False)
        assert _apply_hf(remedy, tracker, *live) == remedy.peak_reserved


class CachingBlock(torch.nn.Module):
    """A block whose input grows with each call (as a key-value cache grows): run again in
    backward, as checkpointing recomputes it, it saves tensors of another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x.repeat(1, self.calls, 1))[:, -x.shape[1] :]


def caching_step(model, x):
    model(x).sum().backward()


@pytest.mark.usefixtures("without_workspaces")
def test_a_remedy_that_cannot_apply_says_why_in_one_line():
    torch.manual_seed(0)
    model = torch.nn.Sequential(CachingBlock(), CachingBlock())
    x = torch.randn(16, 256, 64)
    with memlab.TensorTracker(capacity="3 MiB", history=True), pytest.raises(torch.OutOfMemoryError):
        memlab.explain_oom(caching_step, stream=io.StringIO())(model, x)
    report = memlab.oom.last_report()
    assert "checkpointing" not in {r.kind for r in report.remedies}
    first_line = (
        "torch.utils.checkpoint: Recomputed values for the following tensors have different metadata "
        "than during the forward pass."
    )
    assert report.notes == (f"checkpointing: not estimated: CheckpointError: {first_line}",)
    assert report.text().splitlines()[-2] == f"note: {report.notes[0]}"
    # the same error as checkpointing the block in a real run
    block = CachingBlock()
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as raised:
        checkpoint(block, torch.randn(2, 4, 64, requires_grad=True), use_reentrant=False).sum().backward()
    assert str(raised.value).splitlines()[0] == first_line
