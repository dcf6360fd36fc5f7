"""memlab._gpus: the table of modelled GPUs and the one reading of a ``gpu=`` argument."""

from __future__ import annotations

import pytest
import torch

from memlab._gpus import CONTEXT_ALLOWANCE, DEFAULT_GPU, GPU, GPUS, resolve_gpu
from memlab._torch_version import torch_at_least


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
        (
            "H1000",
            ValueError,
            "gpu 'H1000' is not a GPU memlab knows; valid: a GPU name (V100, V100-32GB, T4,",
        ),
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


_MiB = 2**20


@pytest.mark.parametrize(
    ("spelling", "entry", "mib"),
    [
        ("A100-80GB", "A100", 81_920),
        ("A100 80GB", "A100", 81_920),
        ("A100 80 GB", "A100", 81_920),
        ("A100-SXM4-80GB", "A100", 81_920),
        ("NVIDIA A100-SXM4-80GB", "A100", 81_920),
        ("NVIDIA A100 80GB PCIe", "A100", 81_920),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB", 40_960),
        ("a100_pcie_40gb", "A100-40GB", 40_960),
        ("A100-40GB", "A100-40GB", 40_960),
        ("H100-SXM", "H100", 81_559),
        ("H100 PCIe", "H100", 81_559),
        ("NVIDIA H100 PCIe", "H100", 81_559),
        ("NVIDIA H100 80GB HBM3", "H100", 81_559),
        ("h100 sxm5 80gb", "H100", 81_559),
        ("H100 NVL", "H100-NVL", 95_830),
        ("NVIDIA H100 NVL", "H100-NVL", 95_830),
        ("H100-NVL", "H100-NVL", 95_830),
        ("GH200", "GH200", 97_871),
        ("NVIDIA GH200 480GB", "GH200", 97_871),
        ("NVIDIA GH200 120GB", "GH200", 97_871),
        ("gh200_96gb", "GH200", 97_871),
        ("NVIDIA H200", "H200", 143_771),
        ("NVIDIA H200 NVL", "H200", 143_771),
        ("RTX 4090", "RTX4090", 24_564),
        ("NVIDIA GeForce RTX 4090", "RTX4090", 24_564),
        ("rtx_4090", "RTX4090", 24_564),
        ("RTX4090", "RTX4090", 24_564),
        ("NVIDIA GeForce RTX 3090", "RTX3090", 24_576),
        ("L40S", "L40S", 46_068),
        ("nvidia l40s", "L40S", 46_068),
        ("NVIDIA L4", "L4", 23_034),
        ("NVIDIA A10G", "A10G", 23_028),
        ("Tesla T4", "T4", 15_360),
        ("Tesla V100-SXM2-16GB", "V100", 16_384),
        ("Tesla V100-SXM2-32GB", "V100-32GB", 32_768),
        ("NVIDIA B200", "B200", 183_359),
    ],
)
def test_the_spellings_people_and_drivers_write_name_their_table_entry(spelling, entry, mib):
    gpu = resolve_gpu(spelling)
    assert gpu is GPUS[entry]
    assert gpu.total_memory == mib * _MiB


def test_models_named_without_their_memory_are_the_first_size_of_the_table():
    assert resolve_gpu("a100") is GPUS["A100"] and GPUS["A100"].total_memory == 81_920 * _MiB
    assert resolve_gpu("V100") is GPUS["V100"] and GPUS["V100"].total_memory == 16_384 * _MiB


def test_new_table_entries_are_hopper_and_volta_gpus_whose_sm_picks_the_first_entry():
    assert [(g.name, g.capability) for g in (GPUS["H100-NVL"], GPUS["GH200"], GPUS["V100-32GB"])] == [
        ("H100-NVL", (9, 0)),
        ("GH200", (9, 0)),
        ("V100-32GB", (7, 0)),
    ]
    assert resolve_gpu((9, 0)) is GPUS["H100"] and resolve_gpu("sm70") is GPUS["V100"]


def test_the_capabilities_are_those_pytorch_builds_cuda_code_for():
    import inspect
    import re

    from torch.utils import cpp_extension

    from memlab._gpus import CAPABILITIES

    source = inspect.getsource(cpp_extension._get_cuda_arch_flags)
    listed = re.search(r"supported_arches = \[(.*?)\]", source, re.S).group(1)
    arches = {tuple(map(int, a.split("."))) for a in re.findall(r"'([\d.]+)a?'", listed)}
    # memlab's table is torch 2.13's list (2.9-2.13 agree); torch 2.8 (CUDA 12.8) names Thor sm101,
    # which CUDA 13 renamed sm110; 2.14 adds sm107
    if not torch_at_least(2, 9):
        arches = arches - {(10, 1)} | {(11, 0)}
    if torch_at_least(2, 14):
        arches = arches - {(10, 7)}
    assert set(CAPABILITIES) == arches
    assert len(CAPABILITIES) == len(arches) == 21
    assert [resolve_gpu(c).sm for c in [(12, 0), (10, 3), (11, 0)]] == ["sm120", "sm103", "sm110"]
