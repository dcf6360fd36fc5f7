"""Every remedy the report marks "fits" runs when applied as a user applies it: right after the
failure (the except block left, no ``gc.collect()``), in the same process, under the same tracker
and capacity, for two training steps; its peak is the predicted one, byte for byte. Three model
shapes (an MLP, a small transformer, a conv net), AdamW, a tight and a medium budget."""

from __future__ import annotations

import gc
import io

import pytest
import torch
import torch.nn.functional as F

import memlab
from memlab.oom.accumulation import MIDDLE_ESTIMATED, MicroBatches
from memlab.plan.checkpointing import checkpoint, uncheckpoint

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    gc.collect()
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))


def step(model, optimizer, x, y):
    loss = loss_of(model, x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class Block(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(torch.nn.Module):
    """Vocabulary 512, width 64, 2 blocks; tokens in, logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 64)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(64, 512)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ConvBlock(torch.nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = torch.nn.Sequential(*(ConvBlock() for _ in range(3)))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def make(kind: str, batch: int):
    if kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )  # fmt: skip
        return model, torch.randn(batch, 512), torch.randint(0, 10, (batch,))
    if kind == "lm":
        return TinyLM(), torch.randint(0, 512, (batch, 32)), torch.randint(0, 512, (batch, 32))
    return ConvNet(), torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))


def failure(kind: str, batch: int, capacity: int, remedies: bool = True):
    """The first AdamW step of ``kind`` at ``batch`` runs out of ``capacity``; the report, the
    tracker and what is live once the except block is left (nothing collected)."""
    torch.manual_seed(0)
    watched = memlab.explain_oom(step, stream=io.StringIO(), remedies=remedies)
    tracker = memlab.TensorTracker(capacity=capacity, history=True)
    with tracker:
        model, x, y = make(kind, batch)
        optimizer = torch.optim.AdamW(model.parameters())
        try:
            watched(model, optimizer, x, y)
        except torch.OutOfMemoryError:
            failed = True
        else:
            failed = False
    assert failed
    return memlab.oom.last_report(), tracker, (model, optimizer, x, y)


def apply(remedy, tracker, model, optimizer, x, y) -> int:
    """Two training steps with ``remedy`` applied as a user writes it, under ``tracker``; the peak
    reserved bytes from there. Micro-batches: ``x.split(micro)``, each loss divided by their
    number; autocast around each step; checkpointing of the blocks the remedy names."""
    tracker.reset_peak_memory_stats()
    with tracker:
        for _ in range(2):
            if remedy.kind == "micro_batch":
                micro, steps = remedy.details["micro_batch"], remedy.details["accumulation_steps"]
                for part_x, part_y in zip(x.split(micro), y.split(micro), strict=True):
                    (loss_of(model, part_x, part_y) / steps).backward()
                optimizer.step()
                optimizer.zero_grad()
            elif remedy.kind == "autocast_bf16":
                with torch.autocast("cpu", torch.bfloat16):
                    step(model, optimizer, x, y)
            else:
                assert remedy.kind == "checkpointing"
                blocks = [model.get_submodule(name) for name in remedy.details["checkpointed"]]
                checkpoint(blocks)  # the blocks the remedy names, as memlab.plan applies them
                try:
                    step(model, optimizer, x, y)
                finally:
                    uncheckpoint(blocks)
    return tracker.max_memory_reserved()


@pytest.fixture(autouse=True)
def no_cublaslt_workspace(monkeypatch):
    """The scenarios are sized for the cuBLAS workspaces alone: torch 2.8's cuBLASLt takes 1 MiB
    for each call (a 2 MiB small-pool segment) besides them, which would move every margin."""
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")


#: (model, batch, capacity, [(remedy, predicted peak reserved in MiB, fits, micro-batch)]). 64 MiB
#: of each capacity go to the two 32 MiB cuBLAS workspaces of the H100 the tracker models.
SCENARIOS = [
    ("mlp", 6144, 100, [("micro_batch", 100, True, 1024), ("autocast_bf16", 100, None, None)]),
    ("mlp", 4096, 100, [("micro_batch", 92, True, 3072), ("autocast_bf16", 90, True, None)]),
    ("lm", 512, 120, [("micro_batch", 118, True, 85)]),
    ("conv", 64, 100, [("micro_batch", 98, True, 14)]),
    ("conv", 128, 140, [("micro_batch", 134, True, 32)]),
]


@pytest.mark.parametrize(
    ("kind", "batch", "capacity", "expected"), SCENARIOS, ids=[f"{s[0]}-{s[1]}-{s[2]}MiB" for s in SCENARIOS]
)
def test_every_remedy_marked_fits_runs_when_applied_right_after_the_failure(kind, batch, capacity, expected):
    report, _, _ = failure(kind, batch, capacity * MIB)
    held = [r for r in report.remedies if r.fits is not False]
    assert [(r.kind, r.peak_reserved // MIB, r.fits, r.details.get("micro_batch")) for r in held] == expected
    assert all(r.peak_reserved % MIB == 0 for r in held)
    assert all(r.peak_reserved > capacity * MIB for r in report.remedies if r.fits is False)
    for remedy in held:
        _, tracker, live = failure(kind, batch, capacity * MIB, remedies=False)
        assert apply(remedy, tracker, *live) == remedy.peak_reserved  # byte for byte, within the capacity


def test_a_margin_says_why_it_promises_nothing():
    report, _, _ = failure("mlp", 6144, 100 * MIB)
    lines = report.text().splitlines()
    start = lines.index("remedies (predicted peak reserved, capacity 100.00M):")
    assert lines[start + 1 :][:4] == [
        "  micro-batches of 1024 (of 6144), 6 accumulation steps   100.00M  fits",
        '  torch.autocast("cpu", torch.bfloat16) (bf16)            100.00M  margin 0.00B',
        "  checkpoint 2 of the 3 Linear blocks (0 to 2)            122.00M  does not fit",
        "  a margin is no promise: it fits with less than 2.00M to spare, which a small tensor the loop "
        "keeps beyond the step (a logged loss) can take",
    ]


def test_the_micro_batch_an_estimate_without_the_rows_left_chose_runs_out_of_memory():
    # 6144 rows in micro-batches of 1881: three of 1881, then one of 501. Estimated as three
    # micro-batches of 1881 (the last one's rows not cut), it "fit" in 100 MiB; applied, it does not
    _, tracker, live = failure("mlp", 6144, 100 * MIB, remedies=False)
    plan = MicroBatches(6144, 1881, 0)
    assert (plan.count, plan.per_step) == (4, 4)
    rows = []
    for index in range(plan.per_step):
        plan._position = index
        rows.append(plan.rows())
    assert rows == [(0, 1881), (1881, 1881), (3762, 1881), (5643, 501)]
    remedy = memlab.oom.Remedy(
        "micro_batch", "", 0, 100 * MIB, {"micro_batch": 1881, "accumulation_steps": 4}
    )
    with pytest.raises(torch.OutOfMemoryError):
        apply(remedy, tracker, *live)


def test_middle_micro_batches_are_estimated_until_the_allocator_repeats():
    plan = MicroBatches(4096, 1, 0)
    assert (plan.count, plan.per_step) == (4096, 2 + MIDDLE_ESTIMATED)
    assert MicroBatches(10, 5, 0).per_step == 2
    assert MicroBatches(10, 10, 0).per_step == 1


def test_a_cublas_workspace_that_ran_out_of_memory_is_allocated_by_the_next_matmul():
    tracker = memlab.TensorTracker(capacity=40 * MIB)
    a = torch.randn(64, 64)
    with tracker:
        hog = torch.empty(4 * MIB)  # 16 MiB: the 32 MiB workspace does not fit beside it
        with pytest.raises(torch.OutOfMemoryError):
            a @ a
        assert tracker.memory_allocated() == 16 * MIB
        del hog
        a @ a  # PyTorch asks for the workspace again: it has none
        assert tracker.memory_allocated() == 32 * MIB
