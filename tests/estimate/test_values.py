"""Steps that read their tensors' values on the host (``loss.item()``, an attention-mask check,
``clip_grad_norm_(...).item()``) stay data-free and exact: models built from ``transformers``
configs, estimates equal to tracked real steps, steps 1-3. Values that decide a size give the
exact answer and name the op and the line."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import memlab
from memlab.history import categories
from tests.estimate.test_config_models import MODELS, TOKENS, VOCAB
from tests.estimate.test_steady_state import KEYS

BATCH = 4


def t5():
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            num_layers=2,
            num_decoder_layers=2,
            d_model=64,
            d_kv=16,
            num_heads=4,
            d_ff=128,
            vocab_size=VOCAB,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )


def vit():
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=32,
            patch_size=8,
            num_channels=3,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=10,
        )
    )


def padded_mask():
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, 20:] = 0  # the second sequence is padded
    return mask


def batches(name):
    """The keyword arguments of one batch for model ``name`` (the step passes them to the model)."""
    tokens = torch.randint(1, VOCAB, (BATCH, TOKENS))
    labels = torch.randint(0, VOCAB, (BATCH, TOKENS))
    if name == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 10, (BATCH,))}
    if name == "bert-padded":
        return {"input_ids": tokens, "attention_mask": padded_mask(), "labels": labels}
    if name == "bert-ones":
        ones = torch.ones(BATCH, TOKENS, dtype=torch.long)
        return {"input_ids": tokens, "attention_mask": ones, "labels": labels}
    return {"input_ids": tokens, "labels": labels}


BUILDERS = {
    "gpt2": MODELS["gpt2"],
    "bert-padded": MODELS["bert"],
    "bert-ones": MODELS["bert"],
    "llama": MODELS["llama"],
    "t5": t5,
    "vit": vit,
}


def item_step(model, optimizer, batch):
    """A training step as users write it: the loss read on the host at the end."""
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def clipped_step(model, optimizer, batch):
    """The same with the gradient norm clipped and read on the host for logging."""
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    optimizer.step()
    return f"loss {loss.item():.4f} norm {norm:.3f}"


def tracked_steps(step, model, optimizer, batch, steps):
    """``steps`` real calls of ``step`` under a tracker, as an estimate with ``steps`` runs them."""
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=list(batch.values()), category=categories.INPUT)
        for _ in range(steps):
            result = step(model, optimizer, batch)
        stats = tracker.memory_stats()
    assert isinstance(result, (float, str))
    return {key: stats[key] for key in KEYS}


def check(name, step, steps):
    torch.manual_seed(0)
    model = BUILDERS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batches(name)
    estimate = memlab.estimate(step, model, optimizer, batch, steps=steps)
    assert (estimate.method, estimate.forced_by, estimate.caveats) == ("fake", None, [])
    assert {key: estimate.stats[key] for key in KEYS} == tracked_steps(step, model, optimizer, batch, steps)


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_step_ending_in_loss_item_is_estimated_data_free_and_exactly(name, steps):
    check(name, item_step, steps)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_clipped_gradient_norm_read_on_the_host_stays_data_free(steps):
    check("gpt2", clipped_step, steps)


# -- small steps: what each kind of read gives ------------------------------------------------------
MASK = [1, 1, 0, 1, 0, 0, 1, 1]


def tracked(step, model, *inputs):
    """One real call of ``step`` under a tracker that counts the model and the inputs first."""
    with memlab.TensorTracker(history=True, model=model) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=list(inputs), category=categories.INPUT)
        result = step(model, *inputs)
        stats = tracker.memory_stats()
    del result
    model.zero_grad(set_to_none=True)
    return {key: stats[key] for key in KEYS}


def estimate_and_track(step, mask=MASK):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 256)
    inputs = (torch.randn(8, 16), torch.tensor(mask))
    estimate = memlab.estimate(step, model, *inputs)
    assert {key: estimate.stats[key] for key in KEYS} == tracked(step, model, *inputs)
    return estimate


def line_of(code):
    """``file:line: code`` of the line of this file whose text is ``code``."""
    lines = open(__file__).read().splitlines()
    return f"{__file__}:{next(n for n, text in enumerate(lines, 1) if text.strip() == code)}: {code}"


def slice_by_known_count(model, x, mask):
    return model(x[: mask.sum().item()]).sum()


def nonzero_of_known(model, x, mask):
    return model(x[mask.nonzero()[:, 0]]).sum()


def boolean_mask_of_known(model, x, mask):
    return model(x[mask.bool()]).sum()


@pytest.mark.parametrize("step", [slice_by_known_count, nonzero_of_known, boolean_mask_of_known])
def test_a_size_that_known_values_decide_is_exact_and_data_free(step):
    estimate = estimate_and_track(step)
    assert (estimate.method, estimate.forced_by, estimate.caveats) == ("fake", None, [])
    # 5 of the 8 rows through the layer: 5 x 256 float32 = 5,120 B, where all 8 would take 8,192 B.
    sizes = [e["size"] for e in estimate.tracker.snapshot()["device_traces"][0] if e["action"] == "alloc"]
    assert 5120 in sizes and 8192 not in sizes


def branch_on_a_listed_mask(model, x, mask):
    out = model(x)
    if mask.tolist()[2] == 0 and mask.numpy()[4] == 0:
        out = out * 2  # one more activation-sized tensor, on this side only
    return out.sum()


def test_a_branch_on_known_values_takes_the_side_the_real_run_takes(monkeypatch):
    # torch 2.8's cuBLASLt takes 1 MiB for the Linear's call, which would be both runs' peak
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "0")
    padded = estimate_and_track(branch_on_a_listed_mask)
    full = estimate_and_track(branch_on_a_listed_mask, mask=[1] * 8)
    assert (padded.method, padded.caveats, full.method, full.caveats) == ("fake", [], "fake", [])
    # Peak with the padded mask: output and its product (8 x 256 float32, 8,192 B each); with the
    # full mask: the output and the sum's 512 B block.
    assert padded.peak_allocated - full.peak_allocated == 8192 - 512


def integer_from_unknown(model, x, mask):
    n = (model(x) > 0).sum()
    return torch.empty(int(n))


def slice_by_unknown_count(model, x, mask):
    h = model(x)
    return h[: (h > 0).sum().item()].sum()


def nonzero_of_unknown(model, x, mask):
    return (model(x) > 0).nonzero()


def branch_on_unknown(model, x, mask):
    value = model(x).sum().item()
    if value > 1.0:
        return torch.zeros(64)
    return None


def tensor_of_a_placeholder(model, x, mask):
    loss = torch.tensor(model(x).sum().item())  # made of a placeholder: not a known value
    if loss > 0:
        return torch.zeros(64)
    return None


@pytest.mark.parametrize(
    ("step", "forced_by"),
    [
        (
            integer_from_unknown,
            "an integer the estimate does not have (int(), an index, a size) at "
            + line_of("return torch.empty(int(n))"),
        ),
        (
            slice_by_unknown_count,
            "aten.slice takes a size the estimate does not have at "
            + line_of("return h[: (h > 0).sum().item()].sum()"),
        ),
        (
            nonzero_of_unknown,
            "nonzero (torch.nonzero, torch.where(mask), indexing with a boolean mask) at "
            + line_of("return (model(x) > 0).nonzero()"),
        ),
        (
            branch_on_unknown,
            "a branch on a value the estimate does not have (if, bool(), a comparison) at "
            + line_of("if value > 1.0:")
            + "; read from a tensor at "
            + line_of("value = model(x).sum().item()"),
        ),
        (
            tensor_of_a_placeholder,
            "a branch on a value the estimate does not have (if, bool(), a comparison) at "
            + line_of("if loss > 0:"),
        ),
    ],
)
def test_a_value_the_run_does_not_have_that_decides_memory_runs_for_real_and_names_the_line(step, forced_by):
    estimate = estimate_and_track(step)
    assert (estimate.method, estimate.forced_by) == ("cpu", forced_by)


def log_of_the_loss(model, x, mask):
    loss = model(x).pow(2).sum()
    loss.backward()
    return math.log(loss.item())  # the placeholder 0.0 has no logarithm; the real loss has


def test_a_step_that_fails_on_a_placeholder_runs_for_real():
    estimate = estimate_and_track(log_of_the_loss)
    assert (estimate.method, estimate.forced_by) == (
        "cpu",
        "the run failed (ValueError: math domain error) after reading a value the estimate does not have at "
        + line_of("return math.log(loss.item())  # the placeholder 0.0 has no logarithm; the real loss has"),
    )


FINITE = "rests on the assumption that values the estimate does not have are finite (no inf, no NaN)"


def checked_for_nan(model, x, mask):
    loss = model(x).sum()
    if torch.isnan(loss) or torch.isinf(loss) or not torch.isfinite(loss).all():
        return None
    loss.backward()
    return f"loss {loss.item():.4f}"


def scaled_step(model, x, mask):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


@pytest.mark.parametrize(
    ("step", "line"),
    [
        (checked_for_nan, "if torch.isnan(loss) or torch.isinf(loss) or not torch.isfinite(loss).all():"),
        (scaled_step, "scaler.step(optimizer)"),
    ],
)
def test_finiteness_checks_take_unknown_values_as_finite_and_say_so(step, line):
    estimate = estimate_and_track(step)
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert estimate.caveats == [f"a value read at {line_of(line)} {FINITE}"]


def metric_in_numpy(model, x, mask):
    loss = model(x).sum()
    loss.backward()
    return float(loss.detach().numpy())


def test_numpy_of_an_unknown_value_gives_zeros_and_says_so():
    estimate = estimate_and_track(metric_in_numpy)
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert estimate.caveats == [
        f".numpy() at {line_of('return float(loss.detach().numpy())')} read values the estimate does not "
        "have: it gave zeros"
    ]
