"""memlab.plan on a Hugging Face Llama built from a config (a model nobody here wrote): its layers are
checkpointed with their own switch, which drops the KV cache a recomputed forward would append to
twice; the plan fits when applied, in a real tracked run under the budget, as pasted code too."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

import memlab
from memlab.plan.checkpointing import is_checkpointed
from tests.plan.test_planner import STEPS
from tests.plan.test_planner import tracked_steps as tracked

VOCAB = 512


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config)


def train_step(model, optimizer, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def tracked_steps(model, optimizer, tokens, capacity=None) -> dict[str, int]:
    return tracked(model, optimizer, tokens, capacity, step=train_step)


@pytest.fixture(scope="module")
def job():
    model = make_model()
    torch.manual_seed(1)
    return model, torch.optim.AdamW(model.parameters()), torch.randint(0, VOCAB, (8, 256))


@pytest.fixture(scope="module")
def found(job):
    return memlab.plan(train_step, *job, budget="284 MiB", steps=STEPS)


def test_a_llama_plan_fits_when_applied_in_a_real_run(job, found):
    model, optimizer, tokens = job
    before = [dict(vars(module)) for module in model.modules()]
    assert (found.fits, found.layers) == (True, True)
    assert found.checkpointed == ["model.layers.0", "model.layers.1"]
    # 354 MiB on torch 2.13, 414 MiB on 2.8: compared with the real run
    assert found.baseline.peak_reserved == tracked_steps(model, optimizer, tokens)["reserved"]
    with found.apply(model):
        assert [is_checkpointed(layer) for layer in model.model.layers] == [True, True, False, False]
        real = tracked_steps(model, optimizer, tokens, capacity="284 MiB")
    assert real == {"reserved": found.estimate.peak_reserved, "allocated": found.estimate.peak_allocated}
    assert [dict(vars(module)) for module in model.modules()] == before  # removed: as it was


def test_the_pasted_code_uses_the_layers_own_switch(job, found):
    model, optimizer, tokens = job
    assert found.code == (
        "from memlab.plan.checkpointing import checkpoint\n"
        "checkpoint([model.get_submodule(name) for name in ['model.layers.0', 'model.layers.1']])"
    )
    exec(found.code, {"model": model})
    try:
        assert (
            tracked_steps(model, optimizer, tokens, capacity="284 MiB")["reserved"]
            == found.estimate.peak_reserved
        )
    finally:
        for name in found.checkpointed:
            layer = model.get_submodule(name)
            del layer.gradient_checkpointing, layer._gradient_checkpointing_func


def test_a_llama_plans_flops_are_those_pytorchs_counter_counts_in_a_real_run(job, found):
    """Attention included: the estimate runs CUDA's attention kernels on fake tensors, the real run
    CPU's, and PyTorch's formulas count both the same."""
    model, optimizer, tokens = job

    def real_flops() -> int:
        with FlopCounterMode(display=False) as counter:
            train_step(model, optimizer, tokens)
        return counter.get_total_flops()

    before = real_flops()
    with found.apply(model):
        after = real_flops()
    assert (found.baseline_flops, found.recomputed_flops) == (before, after - before)
    assert found.recomputed_flops > 0


def test_a_gpt2_plan_whose_model_passes_its_kv_cache_by_position_fits_when_applied():
    """GPT-2's model passes ``past_key_values`` to its blocks by position (leaving it out only when
    the whole model is checkpointed): a checkpointed block drops it too, as it drops a cache passed by
    keyword, or the recompute appends to the cache again (``CheckpointError``)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, VOCAB, (8, 128))
    as_it_is = memlab.estimate(train_step, model, optimizer, tokens, steps=STEPS).peak_reserved
    found = memlab.plan(train_step, model, optimizer, tokens, budget=as_it_is * 7 // 8, steps=STEPS)
    assert found.fits and found.layers and 0 < len(found.checkpointed) < 4
    with found.apply(model):
        real = tracked_steps(model, optimizer, tokens, capacity=as_it_is * 7 // 8)
    assert real == {"reserved": found.estimate.peak_reserved, "allocated": found.estimate.peak_allocated}
