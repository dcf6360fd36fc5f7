"""The closed-form training-memory numbers users know, beside memlab's estimate, and why they differ.

Each is ``parameters x bytes per parameter``, counting model states only (weights, gradients,
optimizer state): no activations, no temporaries, no workspaces, no allocator caching.

- model states: the parameters' own bytes, their gradients' (the same dtype) and the optimizer's
  state (AdamW and Adam: two tensors of the parameter's dtype, ``exp_avg`` and ``exp_avg_sq``;
  SGD with momentum: one), per rank divided by the world size under FSDP. For float32 AdamW this
  is the 16 B/parameter of the ZeRO paper's mixed-precision count (2 + 2 + 12).
- ``accelerate estimate-memory``'s "Training using Adam" (``estimate_training_usage``): the largest
  of its model, gradient, optimizer and step sizes; for float32 weights 4 x their size
  (16 B/parameter), for float16 or bfloat16 the optimizer's 2 x the float32 size (8 B/parameter).
- DeepSpeed ZeRO-3 without offload (``estimate_zero3_model_states_mem_needs``): 18 B per parameter
  divided by the GPUs, plus 4 B per parameter of the largest layer (gathered whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memlab._units import format_size

__all__ = ["ClosedForm", "closed_forms", "why_they_differ"]

_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # optimizer state tensors per parameter
_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD with momentum"}


@dataclass(frozen=True)
class ClosedForm:
    """One formula: ``key`` (its JSON name), ``label`` (what it computes, said), ``bytes``."""

    key: str
    label: str
    bytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def closed_forms(
    parameters: int,
    largest_layer: int,
    dtype: torch.dtype,
    optimizer: str,
    world_size: int = 1,
    parallel: str | None = None,
) -> list[ClosedForm]:
    """The formulas of the module docstring for a model of ``parameters`` parameters (the largest
    layer holding ``largest_layer``) of ``dtype``, trained with ``optimizer`` (``adamw``, ``adam``,
    ``sgd``), per rank of a ``world_size`` job under ``parallel`` (``"fsdp"``, ``"ddp"``, ``None``).
    ZeRO-3's formula is left out under DDP, which shards nothing."""
    size = torch.empty((), dtype=dtype).element_size()
    per_parameter = size * (2 + _STATES[optimizer])
    shards = world_size if parallel == "fsdp" else 1
    label = (
        f"params x {per_parameter} B ({_dtype_name(dtype)} weights + gradients + {_NAMES[optimizer]}'s "
        f"{_STATES[optimizer]} state{'s' if _STATES[optimizer] > 1 else ''})"
    )
    if shards > 1:
        label += f" / {shards} ranks"
    forms = [ClosedForm("model_states", label, parameters * per_parameter // shards)]
    float32 = parameters * 4
    if dtype == torch.float32:
        forms.append(
            ClosedForm(
                "accelerate",
                'accelerate estimate-memory, "Training using Adam" (4 x float32 size)',
                4 * float32,
            )
        )
    else:
        forms.append(
            ClosedForm(
                "accelerate",
                'accelerate estimate-memory, "Training using Adam" (2 x float32 size)',
                2 * float32,
            )
        )
    if parallel != "ddp":
        gpus = world_size if parallel == "fsdp" else 1
        forms.append(
            ClosedForm(
                "deepspeed_zero3",
                f"DeepSpeed ZeRO-3 (18 B x params / {gpus} GPU{'s' if gpus > 1 else ''} "
                "+ 4 B x largest layer)",
                18 * parameters // gpus + 4 * largest_layer,
            )
        )
    return forms


def why_they_differ(
    by_category: dict[str, int], peak_allocated: int, peak_reserved: int, foreach: bool, sharded: bool
) -> str:
    """One sentence: what memlab's peak holds that the formulas do not count, from the estimate's
    bytes per category at its peak (``by_category``) and its peaks. ``foreach``: the optimizer
    ran PyTorch's foreach kernels (CUDA's default), whose step makes intermediate results of the
    parameters' size; ``sharded``: FSDP, whose all-gathered parameters and unsharded gradients
    live for a layer's forward or backward."""
    temporary = by_category.get("temporary", 0)
    parts = []
    if temporary:
        causes = []
        if sharded:
            causes.append("FSDP's all-gathered parameters and unsharded gradients")
        if foreach:
            causes.append("the foreach optimizer step's intermediate results, the size of the parameters")
        what = " or ".join(causes) if causes else "intermediate results"
        parts.append(f"{format_size(temporary)} of temporaries ({what})")
    for key, name in (("activation", "activations"), ("workspace", "cuBLAS workspaces")):
        if by_category.get(key, 0):
            parts.append(f"{format_size(by_category[key])} of {name}")
    held = ", ".join(parts) if parts else "nothing beyond model states"
    return (
        f"the formulas count model states only; at memlab's peak the step also holds {held}, "
        f"and the caching allocator reserves {format_size(peak_reserved - peak_allocated)} more than "
        "it allocates"
    )
