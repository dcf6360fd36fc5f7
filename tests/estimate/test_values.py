"""Steps that read their tensors' values on the host (``loss.item()``, an attention-mask check,
``clip_grad_norm_(...).item()``) stay data-free and exact: models built from ``transformers``
configs, estimates equal to tracked real steps, steps 1-3. Values that decide a size give the
exact answer and name the op and the line."""

from __future__ import annotations

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
        return {"input_ids": tokens, "attention_mask": torch.ones(BATCH, TOKENS, dtype=torch.long), "labels": labels}
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
