"""The GPUs memlab can model, and the one reading of a ``gpu=`` argument.

A modelled run for ``device="cuda"`` behaves as on one GPU: which cuBLAS workspace its matmuls take,
which attention kernel PyTorch picks, how much memory there is. :data:`GPUS` holds what memlab needs
of each: the compute capability and the total memory. :func:`resolve_gpu` reads a name as people
and drivers spell it (``"H100"``, ``"A100 80GB"``, ``"NVIDIA A100-SXM4-40GB"``), a compute capability
(``"sm90"``, ``(9, 0)``), or ``None``: the GPU in use on a machine with CUDA, else :data:`DEFAULT_GPU`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["CAPABILITIES", "CONTEXT_ALLOWANCE", "DEFAULT_GPU", "GPU", "GPUS", "GpuLike", "resolve_gpu"]

_MiB = 2**20


@dataclass(frozen=True)
class GPU:
    """A GPU as memlab models it: ``name``, ``capability`` (major, minor), ``total_memory`` (bytes,
    what ``torch.cuda.get_device_properties().total_memory`` reports; ``None`` when only the
    compute capability was given); for a roofline of its time (:mod:`memlab.plan.flops`), its peak
    dense FLOP/s in float32 (``fp32_flops``) and in 16-bit tensor-core matmuls with float32
    accumulation (``tensor_flops``: bf16, or fp16 where the GPU has no bf16), and its memory
    bandwidth in bytes per second (``bandwidth``); ``None`` where unknown."""

    name: str
    capability: tuple[int, int]
    total_memory: int | None
    fp32_flops: float | None = None
    tensor_flops: float | None = None
    bandwidth: float | None = None

    @property
    def sm(self) -> str:
        """The compute capability as ``"sm90"``."""
        return f"sm{self.capability[0]}{self.capability[1]}"

    def default_budget(self) -> int:
        """The memory a modelled run on this GPU may use when no budget is given, in bytes: the
        total memory less :data:`CONTEXT_ALLOWANCE` (the CUDA context, which no tracker sees).
        ``ValueError`` for a GPU known only by its compute capability."""
        if self.total_memory is None:
            raise ValueError(
                f"gpu {self.sm} has no known total memory: name a GPU ({', '.join(GPUS)}) or pass a budget"
            )
        return self.total_memory - CONTEXT_ALLOWANCE


#: What the CUDA context of a PyTorch process takes on the GPU, set aside from a GPU's total memory
#: for a default budget: the context, cuBLAS/cuDNN handles and loaded kernels take about 0.5 GiB on
#: recent GPUs and drivers (it varies with the driver, CUDA version and lazy loading; measure yours
#: with ``torch.cuda.mem_get_info`` after the first kernel and pass ``budget`` to be exact).
CONTEXT_ALLOWANCE = 512 * _MiB

#: Per GPU name: compute capability and total memory (MiB as ``nvidia-smi`` lists it; H100 and H200
#: as seen on this project's lent machines, the others as NVIDIA's data sheets give the memory, except
#: where a comment names the ``nvidia-smi`` output it was read from); then the roofline's peaks, from
#: NVIDIA's data sheets (dense, without sparsity; the SXM board where there are several: "H100" is
#: the H100 SXM5, whose PCIe board is slower): float32 and 16-bit tensor TFLOP/s, memory GB/s. Not
#: given for the A10G (AWS's variant, whose data sheet is not public) and the B200.
_T, _G = 1e12, 1e9
GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("V100", (7, 0), 16_384 * _MiB, 15.7 * _T, 125 * _T, 900 * _G),  # fp16 tensor cores: no bf16
        # Tesla V100-SXM2-32GB: 32 GB HBM2 (NVIDIA V100 data sheet); sm70 as the 16 GB V100.
        GPU("V100-32GB", (7, 0), 32_768 * _MiB, 15.7 * _T, 125 * _T, 900 * _G),
        GPU("T4", (7, 5), 15_360 * _MiB, 8.1 * _T, 65 * _T, 320 * _G),  # fp16 tensor cores: no bf16
        GPU("A100", (8, 0), 81_920 * _MiB, 19.5 * _T, 312 * _T, 2039 * _G),
        GPU("A100-40GB", (8, 0), 40_960 * _MiB, 19.5 * _T, 312 * _T, 1555 * _G),
        GPU("A10G", (8, 6), 23_028 * _MiB),
        GPU("RTX3090", (8, 6), 24_576 * _MiB, 35.6 * _T, 71 * _T, 936 * _G),
        GPU("L4", (8, 9), 23_034 * _MiB, 30.3 * _T, 121 * _T, 300 * _G),
        GPU("L40S", (8, 9), 46_068 * _MiB, 91.6 * _T, 362.05 * _T, 864 * _G),
        GPU("RTX4090", (8, 9), 24_564 * _MiB, 82.6 * _T, 165.2 * _T, 1008 * _G),
        GPU("H100", (9, 0), 81_559 * _MiB, 67 * _T, 989.4 * _T, 3350 * _G),
        # H100 NVL: 94 GB HBM3, sm90 (NVIDIA H100 data sheet); "NVIDIA H100 NVL ... 95830MiB" in the
        # nvidia-smi output of several public bug reports and READMEs.
        GPU("H100-NVL", (9, 0), 95_830 * _MiB, 60 * _T, 835 * _T, 3900 * _G),
        # GH200 Grace Hopper superchip: a Hopper GPU (sm90) with 96 GB HBM3 (NVIDIA GH200 data sheet);
        # "NVIDIA GH200 480GB ... 97871MiB" (and "GH200 120GB ... 97871MiB") in public nvidia-smi
        # outputs. The 480GB / 120GB of its name are the Grace CPU's LPDDR5X, not the GPU's memory.
        GPU("GH200", (9, 0), 97_871 * _MiB, 67 * _T, 989.4 * _T, 4000 * _G),
        GPU("H200", (9, 0), 143_771 * _MiB, 67 * _T, 989.4 * _T, 4800 * _G),
        GPU("B200", (10, 0), 183_359 * _MiB),
    )
}

#: The GPU modelled when none is named on a machine without CUDA: the H100, the most common GPU of
#: training jobs today, whose sm90 is also the conservative choice where GPUs differ (its cuBLAS
#: workspace, 32 MiB per stream, is the largest).
DEFAULT_GPU = GPUS["H100"]

#: The compute capabilities of NVIDIA GPUs that PyTorch builds CUDA code for: the
#: ``supported_arches`` of ``torch.utils.cpp_extension`` (torch 2.13; tests/test_gpus.py compares),
#: without the ``a`` (architecture-specific) variants. A capability outside it names no GPU.
CAPABILITIES: tuple[tuple[int, int], ...] = (
    (3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0),
    (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1),
)  # fmt: skip

#: How people and drivers spell each model, read word by word (case, spaces, hyphens and underscores
#: alike): the model's words (``RTX 4090`` or ``RTX4090``; ``H100 NVL``), optionally a memory size
#: (``80GB``, ``80G``), board and memory words (:data:`_BOARD_WORDS`, ignored) and the vendor's
#: brands (``NVIDIA``, ``Tesla``, ``GeForce``, ignored). Per model, the table entry per memory size in
#: GB as names write it; the first is the entry meant when no size is written.
_MODELS: dict[str, dict[int, str]] = {
    "V100": {16: "V100", 32: "V100-32GB"},
    "T4": {16: "T4"},
    "A100": {80: "A100", 40: "A100-40GB"},
    "A10G": {24: "A10G"},
    "RTX3090": {24: "RTX3090"},
    "L4": {24: "L4"},
    "L40S": {48: "L40S"},
    "RTX4090": {24: "RTX4090"},
    "H100": {80: "H100"},  # SXM5 and PCIe alike: 80 GB, 81559MiB in nvidia-smi
    "H100NVL": {94: "H100-NVL"},
    "GH200": {96: "GH200", 480: "GH200", 120: "GH200"},  # torch names it "NVIDIA GH200 480GB"
    "H200": {141: "H200"},
    "H200NVL": {141: "H200"},  # "NVIDIA H200 NVL": 143771MiB in nvidia-smi, as the H200 SXM
    "B200": {180: "B200", 192: "B200"},  # announced with 192 GB, sold with 180 GB
}
_BRANDS = frozenset({"NVIDIA", "TESLA", "GEFORCE"})
_BOARD_WORDS = frozenset({"SXM", "SXM2", "SXM4", "SXM5", "PCIE", "HBM2", "HBM2E", "HBM3", "HBM3E"})
_JOINED_WORDS = frozenset({"RTX"})  # "RTX 4090" is one model, RTX4090
_SUFFIX_WORDS = frozenset({"NVL"})  # "H100 NVL" is another model than the H100, H100NVL
_WORD_SEPARATORS = re.compile(r"[\s_-]+")
_SIZE = re.compile(r"^(\d+)GB?$")
_SM = re.compile(r"^sm(\d+)$")

GpuLike = str | tuple[int, int] | GPU


def resolve_gpu(gpu: GpuLike | None = None, *, name: str = "gpu") -> GPU:
    """The :class:`GPU` that ``gpu`` names.

    A name as people and drivers write it (case ignored, spaces, hyphens and underscores alike):
    a table name (``"H100"``, ``"A100-40GB"``), a model with its memory or board (``"A100 80GB"``,
    ``"A100-SXM4-40GB"``, ``"H100 PCIe"``, ``"RTX 4090"``), what ``torch.cuda.get_device_name``
    prints (``"NVIDIA A100-SXM4-40GB"``, ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA GeForce RTX 4090"``);
    a compute capability as ``"sm90"``, ``"sm_90"`` or ``(9, 0)``, one of :data:`CAPABILITIES` (the
    GPU of the table with that capability when there is one, else one with no known total memory);
    a :class:`GPU`; ``None``: the current CUDA device on a machine with CUDA (its name, capability
    and total memory as PyTorch reads them), else :data:`DEFAULT_GPU`. ``TypeError`` /
    ``ValueError`` name ``name`` and list the valid names and capabilities.
    """
    if gpu is None:
        return _current_gpu() if torch.cuda.is_available() else DEFAULT_GPU
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, tuple):
        if len(gpu) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in gpu):
            raise ValueError(f"{name} {gpu!r} is not a compute capability; valid: {_VALID}")
        return _by_capability(gpu, f"{name} {gpu!r}")
    if not isinstance(gpu, str):
        raise TypeError(f"{name} must be {_VALID}; got {type(gpu).__name__} {gpu!r}")
    words = [word for word in _WORD_SEPARATORS.split(gpu.strip().upper()) if word]
    match = _SM.match("".join(words).lower())
    if match and len(match.group(1)) >= 2:
        digits = match.group(1)
        return _by_capability((int(digits[:-1]), int(digits[-1])), f"{name} {gpu!r}")
    return _by_words(words, f"{name} {gpu!r}")


def _by_words(words: list[str], what: str) -> GPU:
    """The table entry that a name's ``words`` (upper case) spell, else ``ValueError``."""
    words = [word for word in words if word not in _BRANDS]
    model = words.pop(0) if words else ""
    if model in _JOINED_WORDS and words:
        model += words.pop(0)
    if words and words[0] in _SUFFIX_WORDS:
        model += words.pop(0)
    sizes = _MODELS.get(model)
    if sizes is None:
        raise ValueError(f"{what} is not a GPU memlab knows; valid: {_VALID}")
    size = None
    while words:
        word = words.pop(0)
        if word.isdigit() and words and words[0] in ("G", "GB"):  # "80 GB"
            word += words.pop(0)
        found = _SIZE.match(word)
        if found and size is None:
            size = int(found.group(1))
        elif word not in _BOARD_WORDS:
            raise ValueError(f"{what} is not a GPU memlab knows (it does not read {word!r}); valid: {_VALID}")
    if size is None:
        return GPUS[next(iter(sizes.values()))]
    if size not in sizes:
        memory: dict[str, int] = {}
        for gb, entry in sizes.items():
            memory.setdefault(entry, gb)
        known = " or ".join(f"{gb} GB ({entry})" for entry, gb in memory.items())
        raise ValueError(f"{what}: memlab knows the {model} with {known}, not {size} GB; valid: {_VALID}")
    return GPUS[sizes[size]]


def _sm(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


_VALID = (
    f"a GPU name ({', '.join(GPUS)}), a compute capability ('sm90', (9, 0)) or None; "
    f"the compute capabilities: {', '.join(map(_sm, CAPABILITIES))}"
)


def _by_capability(capability: tuple[int, int], what: str) -> GPU:
    if capability not in CAPABILITIES:
        raise ValueError(f"{what} is not the compute capability of any NVIDIA GPU; valid: {_VALID}")
    for known in GPUS.values():
        if known.capability == capability:
            return known
    return GPU(_sm(capability), capability, None)


def _current_gpu() -> GPU:
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    try:  # the roofline's peaks of the table's entry of that name, where it has one
        known = _by_words([w for w in _WORD_SEPARATORS.split(properties.name.upper()) if w], "")
        peaks = (known.fp32_flops, known.tensor_flops, known.bandwidth)
    except ValueError:
        peaks = (None, None, None)
    return GPU(properties.name, (properties.major, properties.minor), properties.total_memory, *peaks)
