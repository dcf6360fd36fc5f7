"""memlab._gpus: the table of modelled GPUs and the one reading of a ``gpu=`` argument."""

from __future__ import annotations

import pytest
import torch

from memlab._gpus import CONTEXT_ALLOWANCE, DEFAULT_GPU, GPU, GPUS, resolve_gpu


def test_names_capabilities_and_none_resolve_to_one_gpu():
    assert resolve_gpu("H100") is resolve_gpu("nvidia h100") is resolve_gpu("sm90") is GPUS["H100"]
    assert resolve_gpu((8, 0)) is resolve_gpu("sm_80") is GPUS["A100"]
    assert resolve_gpu("L4").capability == (8, 9)
    assert resolve_gpu("sm120") == GPU("sm120", (12, 0), None)
    assert resolve_gpu(GPUS["T4"]) is GPUS["T4"]
    assert not torch.cuda.is_available() and resolve_gpu(None) is DEFAULT_GPU is GPUS["H100"]
    assert GPUS["H100"].sm == "sm90"


def test_a_default_budget_is_the_total_memory_less_the_context_allowance():
    assert CONTEXT_ALLOWANCE == 512 * 2**20
    assert GPUS["H100"].default_budget() == 81_559 * 2**20 - 512 * 2**20
    with pytest.raises(ValueError, match="gpu sm120 has no known total memory: name a GPU"):
        resolve_gpu("sm120").default_budget()


@pytest.mark.parametrize(
    ("gpu", "error", "message"),
    [
        ("H1000", ValueError, "gpu 'H1000' is not a GPU memlab knows; valid: a GPU name (V100, T4,"),
        ((9,), ValueError, "gpu (9,) is not a compute capability; valid: "),
        ((9, -1), ValueError, "gpu (9, -1) is not a compute capability; valid: "),
        (90, TypeError, "gpu must be a GPU name (V100, "),
    ],
)
def test_bad_gpus_are_typed_errors_that_list_the_valid_forms(gpu, error, message):
    with pytest.raises(error) as raised:
        resolve_gpu(gpu)
    assert str(raised.value).startswith(message)
    assert "a compute capability ('sm90', (9, 0)) or None" in str(raised.value)
