"""Models nobody here wrote, built from ``transformers`` configs (small sizes): estimates of a fresh
model's step and of later steps (gradients and AdamW state from real steps) equal the same step run
for real under a tracker, byte for byte."""

from __future__ import annotations

import pytest
import torch
import transformers

import memlab
from memlab.history import categories
from tests.estimate.test_steady_state import KEYS

VOCAB, TOKENS = 512, 32
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    ),
    "bert": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
    ),
}


#: How each estimate runs: BERT's code reads token values (is the pad token among the last ones?),
#: which the data-free run knows (they come from the inputs: memlab.estimate.values), so all are fake.
METHODS = {"gpt2": "fake", "bert": "fake", "llama": "fake"}


def train_step(model, optimizer, tokens, labels):
    optimizer.zero_grad()
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss


def tracked_step(model, optimizer, *batch):
    with memlab.TensorTracker(history=True, model=model, optimizer=optimizer) as tracker:
        tracker.adopt(roots=[model])
        tracker.adopt(roots=[optimizer])
        tracker.adopt(roots=list(batch), category=categories.INPUT)
        loss = train_step(model, optimizer, *batch)
        stats = tracker.memory_stats()
    del loss
    return {key: stats[key] for key in KEYS}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fresh_and_later_steps_of_a_model_built_from_a_config(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (4, TOKENS))
    batch = (tokens, torch.randint(0, VOCAB, (4, TOKENS)))
    for trained in range(3):  # step 1 of a fresh model, then steps 2 and 3
        estimate = memlab.estimate(train_step, model, optimizer, *batch)
        assert (trained, estimate.method, estimate.caveats) == (trained, METHODS[name], [])
        assert {key: estimate.stats[key] for key in KEYS} == tracked_step(model, optimizer, *batch)
    assert [int(state["step"]) for state in optimizer.state.values()] == [3] * len(optimizer.state)
