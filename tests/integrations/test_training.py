"""The pieces of ``memlab estimate`` below the command: the closed-form formulas and the setup's checks."""

from __future__ import annotations

import pytest
import torch

from memlab.integrations.formulas import closed_forms
from memlab.integrations.training import TrainingSetup

LLAMA_3_8B = 8_030_261_248  # parameters of Llama-3-8B (untied embedding and head)
EMBEDDING = 128_256 * 4096  # its largest layer: the embedding (and the head)
GiB = 2**30


def test_the_formulas_give_the_numbers_quoted_for_llama_3_8b():
    forms = {form.key: form.bytes for form in closed_forms(LLAMA_3_8B, EMBEDDING, torch.float32, "adamw")}
    # issue 24: "params x 16 B says 119.7 GiB and DeepSpeed's ZeRO-3 formula 136.6 GiB"
    assert forms == {
        "model_states": LLAMA_3_8B * 16,
        "accelerate": LLAMA_3_8B * 16,
        "deepspeed_zero3": LLAMA_3_8B * 18 + 4 * EMBEDDING,
    }
    assert (round(forms["model_states"] / GiB, 1), round(forms["deepspeed_zero3"] / GiB, 1)) == (119.7, 136.6)


def test_the_formulas_per_rank_under_fsdp_and_ddp():
    fsdp = {f.key: f.bytes for f in closed_forms(LLAMA_3_8B, EMBEDDING, torch.float32, "adamw", 8, "fsdp")}
    # "the formulas 15-19 GiB" per rank on 8
    assert (round(fsdp["model_states"] / GiB, 1), round(fsdp["deepspeed_zero3"] / GiB, 1)) == (15.0, 18.8)
    ddp = {f.key: f.bytes for f in closed_forms(LLAMA_3_8B, EMBEDDING, torch.float32, "adamw", 8, "ddp")}
    assert ddp == {"model_states": LLAMA_3_8B * 16, "accelerate": LLAMA_3_8B * 16}


def test_the_formulas_for_half_precision_weights_and_sgd():
    forms = {f.key: f.bytes for f in closed_forms(1000, 100, torch.bfloat16, "sgd")}
    # bfloat16 weights, gradients and one momentum buffer; accelerate: 2 x the float32 size
    assert forms == {"model_states": 6000, "accelerate": 8000, "deepspeed_zero3": 18_000 + 400}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": "lion"}, "optimizer must be one of adamw, adam, sgd; got 'lion'"),
        ({"parallel": "zero"}, "parallel must be None, 'fsdp' or 'ddp'; got 'zero'"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"seq_len": 0}, "seq_len must be >= 1, got 0"),
    ],
)
def test_a_bad_setup_is_a_value_error(options, message):
    with pytest.raises(ValueError) as raised:
        TrainingSetup(**options)
    assert str(raised.value) == message
