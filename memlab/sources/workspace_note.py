"""The sentence every table, estimate, plot and summary puts in its first line when its numbers
include modelled cuBLAS/cuBLASLt workspaces: ``includes 2 modelled cuBLAS workspaces of the H100:
64.00M``.

A tracker that models a GPU for tensors that are not on one (a CPU or ``meta`` run, an estimate's
fake tensors) allocates the workspaces PyTorch's first matmul of each thread and stream takes on
that GPU (:mod:`memlab.sources.workspaces`, category ``workspace``): 32 MiB each on an H100, so a
6 MiB model's table starts at 70 MiB. :func:`workspaces_note` builds the sentence that says so;
nothing is said where none was modelled (a run measured on a real GPU, whose own allocator holds
them; a tracker with ``allocator=None``; a run without a matmul). The one switch that turns them
off is PyTorch's own: ``CUBLAS_WORKSPACE_CONFIG=:0:0`` in the environment (:data:`SWITCH`) makes
every workspace 0 bytes, in memlab's model as on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memlab._units import format_size
from memlab.history import categories

__all__ = [
    "SWITCH",
    "ModelledWorkspaces",
    "snapshot_workspaces",
    "tracker_workspaces",
    "with_note",
    "workspaces_note",
]

#: The environment setting that turns the modelled workspaces off (PyTorch's own, which memlab reads).
SWITCH = "CUBLAS_WORKSPACE_CONFIG=:0:0"


@dataclass(frozen=True)
class ModelledWorkspaces:
    """The modelled workspaces some numbers include: ``count`` of them, ``nbytes`` in all, on the
    GPU named ``gpu`` (``None`` where a snapshot does not say), ``cublaslt`` of them cuBLASLt's own
    (``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``; otherwise cuBLASLt shares cuBLAS's)."""

    count: int
    nbytes: int
    gpu: str | None
    cublaslt: int = 0


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def tracker_workspaces(tracker: Any, device: torch.device | None = None) -> ModelledWorkspaces | None:
    """The workspaces a :class:`~memlab.sources.tracker.TensorTracker` allocated in its allocator
    model (on ``device`` only, where given: a storage's device, ``meta`` for an estimate's fake
    tensors), or ``None`` where it modelled none of more than 0 bytes."""
    workspaces = getattr(tracker, "_workspaces", None)  # made at the first matmul: not made here
    if workspaces is None:
        return None
    held = [
        (key[0], nbytes)
        for key, nbytes in zip(workspaces.keys, workspaces.nbytes, strict=True)
        if nbytes and (device is None or _same_device(key[1], device))
    ]
    if not held:
        return None
    lt = sum(1 for pool, _ in held if pool == "cublaslt")
    return ModelledWorkspaces(len(held), sum(n for _, n in held), workspaces.gpu.name, lt)


def snapshot_workspaces(snapshot: dict[str, Any], device: int | None = None) -> ModelledWorkspaces | None:
    """The workspaces a memlab tracker's memory snapshot (``tracker.snapshot()``, a pickle
    ``memlab.dump_snapshot`` wrote) allocated: the ``alloc`` entries of category ``workspace`` in
    its ``device_traces`` (of ``device``, default the first with entries); ``None`` where there are
    none (a GPU's own snapshot: PyTorch marks no workspace). A snapshot does not name the GPU."""
    traces = snapshot.get("device_traces") or []
    if device is None:
        trace = next((t for t in traces if t), [])
    else:
        trace = traces[device] if device < len(traces) else []
    sizes = [
        entry.get("size", 0)
        for entry in trace
        if entry.get("action") == "alloc" and entry.get("category") == categories.WORKSPACE
    ]
    sizes = [size for size in sizes if size]
    return ModelledWorkspaces(len(sizes), sum(sizes), None) if sizes else None


def workspaces_note(found: ModelledWorkspaces | None) -> str | None:
    """``"includes 2 modelled cuBLAS workspaces of the H100: 64.00M"`` (sizes as memlab prints
    them, :func:`memlab._units.format_size`), or ``None`` for ``None`` (nothing modelled). The
    sentence every output puts in its first line; :data:`SWITCH` turns the workspaces off."""
    if found is None:
        return None
    if found.cublaslt == found.count:
        kind = "cuBLASLt"
    elif found.cublaslt:
        kind = "cuBLAS/cuBLASLt"
    else:
        kind = "cuBLAS"
    plural = "s" if found.count != 1 else ""
    gpu = "" if found.gpu is None else f" of the {found.gpu}"
    return f"includes {found.count} modelled {kind} workspace{plural}{gpu}: {format_size(found.nbytes)}"


def with_note(text: str, found: ModelledWorkspaces | None) -> str:
    """``text`` followed by ``"; "`` and :func:`workspaces_note` of ``found``, when there is one."""
    note = workspaces_note(found)
    return text if note is None else f"{text}; {note}"
