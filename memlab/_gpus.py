"""The GPUs memlab can model, and the one reading of a ``gpu=`` argument.

A modelled run for ``device="cuda"`` behaves as on one GPU: which cuBLAS workspace its matmuls take,
which attention kernel PyTorch picks, how much memory there is. :data:`GPUS` holds what memlab needs
of each: the compute capability and the total memory. :func:`resolve_gpu` reads a name (``"H100"``),
a compute capability (``"sm90"``, ``(9, 0)``), or ``None``: the GPU in use on a machine with CUDA,
else :data:`DEFAULT_GPU`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["CONTEXT_ALLOWANCE", "DEFAULT_GPU", "GPU", "GPUS", "GpuLike", "resolve_gpu"]

_MiB = 2**20


@dataclass(frozen=True)
class GPU:
    """A GPU as memlab models it: ``name``, ``capability`` (major, minor), ``total_memory`` (bytes,
    what ``torch.cuda.get_device_properties().total_memory`` reports; ``None`` when only the
    compute capability was given)."""

    name: str
    capability: tuple[int, int]
    total_memory: int | None

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
#: as seen on this project's lent machines, the others as NVIDIA's data sheets give the memory).
GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("V100", (7, 0), 16_384 * _MiB),
        GPU("T4", (7, 5), 15_360 * _MiB),
        GPU("A100", (8, 0), 81_920 * _MiB),
        GPU("A100-40GB", (8, 0), 40_960 * _MiB),
        GPU("A10G", (8, 6), 23_028 * _MiB),
        GPU("RTX3090", (8, 6), 24_576 * _MiB),
        GPU("L4", (8, 9), 23_034 * _MiB),
        GPU("L40S", (8, 9), 46_068 * _MiB),
        GPU("RTX4090", (8, 9), 24_564 * _MiB),
        GPU("H100", (9, 0), 81_559 * _MiB),
        GPU("H200", (9, 0), 143_771 * _MiB),
        GPU("B200", (10, 0), 183_359 * _MiB),
    )
}

#: The GPU modelled when none is named on a machine without CUDA: the H100, the most common GPU of
#: training jobs today, whose sm90 is also the conservative choice where GPUs differ (its cuBLAS
#: workspace, 32 MiB per stream, is the largest).
DEFAULT_GPU = GPUS["H100"]

GpuLike = str | tuple[int, int] | GPU
_SM = re.compile(r"^sm_?(\d+)$")


def resolve_gpu(gpu: GpuLike | None = None, *, name: str = "gpu") -> GPU:
    """The :class:`GPU` that ``gpu`` names.

    A name from :data:`GPUS` (case and a leading ``"NVIDIA "`` ignored: ``"h100"``, ``"NVIDIA
    H100"``); a compute capability as ``"sm90"``, ``"sm_90"`` or ``(9, 0)`` (the GPU of the table
    with that capability when there is one, else one with no known total memory); a :class:`GPU`;
    ``None``: the current CUDA device on a machine with CUDA (its name, capability and total memory
    as PyTorch reads them), else :data:`DEFAULT_GPU`. ``TypeError`` / ``ValueError`` name
    ``name`` and list the valid forms.
    """
    if gpu is None:
        return _current_gpu() if torch.cuda.is_available() else DEFAULT_GPU
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, tuple):
        if len(gpu) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in gpu):
            raise ValueError(f"{name} {gpu!r} is not a compute capability; valid: {_VALID}")
        return _by_capability(gpu)
    if not isinstance(gpu, str):
        raise TypeError(f"{name} must be {_VALID}; got {type(gpu).__name__} {gpu!r}")
    key = gpu.strip().upper().removeprefix("NVIDIA ").replace(" ", "")
    for known in GPUS.values():
        if known.name.upper() == key:
            return known
    match = _SM.match(key.lower())
    if match and len(match.group(1)) >= 2:
        digits = match.group(1)
        return _by_capability((int(digits[:-1]), int(digits[-1])))
    raise ValueError(f"{name} {gpu!r} is not a GPU memlab knows; valid: {_VALID}")


_VALID = f"a GPU name ({', '.join(GPUS)}), a compute capability ('sm90', (9, 0)) or None"


def _by_capability(capability: tuple[int, int]) -> GPU:
    for known in GPUS.values():
        if known.capability == capability:
            return known
    return GPU(f"sm{capability[0]}{capability[1]}", capability, None)


def _current_gpu() -> GPU:
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    return GPU(properties.name, (properties.major, properties.minor), properties.total_memory)
