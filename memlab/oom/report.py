"""The OOM post-mortem as plain data, and its two renderers: a terminal screen of text and a dict.

:class:`OOMReport` holds no tensor and no frame; :mod:`memlab.oom.postmortem` builds it from a
capture, and ``text()`` / ``to_dict()`` read the same fields.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from memlab._units import format_size
from memlab.oom.names import Culprit

__all__ = ["FRAGMENTATION", "SHORTAGE", "OOMReport", "Place", "Remedy", "shortened"]

FRAGMENTATION = "fragmentation"
SHORTAGE = "shortage"
_NAME_WIDTH = 32  # the name column's width at least
_LONGEST_NAME = 48  # and at most: longer names are shortened in the middle
_ACTION_WIDTH = 72


@dataclass(frozen=True)
class Place:
    """Where the failing request was made: the innermost frame in the user's code (outside torch,
    memlab and installed packages: :func:`memlab.oom.capture.failing_frame`)."""

    filename: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{shown_path(self.filename)}:{self.line}"


def shown_path(path: str) -> str:
    """``path`` as the report prints it: relative to the current directory when it lies inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if relative.startswith(os.pardir) else relative


def shortened(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters: whole when it fits, else its first third and its
    last two thirds around ``…``, so that the end, where names differ (``….exp_avg`` /
    ``….exp_avg_sq``, ``h.0.…`` / ``h.11.…``), stays."""
    if len(name) <= width:
        return name
    head = (width - 1) // 3
    return f"{name[:head]}…{name[len(name) - (width - 1 - head) :]}"


def _shown_place(place: str) -> str:
    path, _, line = place.rpartition(":")
    return f"{shown_path(path)}:{line}" if path else place


@dataclass(frozen=True)
class Remedy:
    """One remedy and the peak reserved bytes it predicts, computed (a replay of the recorded
    allocations or an estimate of the step), never guessed. ``kind`` names the remedy
    (``expandable_segments``, ``max_split_size_mb``, ``free_held``, ``micro_batch``,
    ``autocast_bf16``, ``autocast_fp16``, ``checkpointing``), ``action`` says what to do, and
    ``details`` holds its own numbers (the micro-batch size, the bytes freed, ...).

    A prediction is complete when it covers the remedy as the user applies it: whole training
    steps (:data:`memlab.oom.step.REMEDY_STEPS`) from the allocator state they meet (right after
    the failure for a change to the step; for an allocator setting, the history before the
    failing call replayed under it, as a restart with it would run). Otherwise ``unsure`` says
    what it does not cover (the state at the failure unknown, so estimated from an empty
    allocator; a replay that ends at the failing request; a change to the step that leaves less
    than one small segment free, see :func:`memlab.oom.step.unsure`), and the report shows the
    :attr:`margin` instead of "fits". The state a step remedy starts from is the one once the error
    is released: inside the ``except`` block that caught it (or while a notebook keeps it as
    ``sys.last_value``) the failing call's frames, and the tensors they hold, are still alive."""

    kind: str
    action: str
    peak_reserved: int
    capacity: int
    details: dict[str, Any] = field(default_factory=dict)
    unsure: str | None = None

    @property
    def fits(self) -> bool | None:
        """``True`` when the predicted peak reserved bytes fit in the capacity and the prediction
        is complete, ``False`` when they exceed the capacity, ``None`` when they are within it but
        the prediction is not complete (see ``unsure``): a margin, not a promise."""
        if self.peak_reserved > self.capacity:
            return False
        return True if self.unsure is None else None

    @property
    def margin(self) -> int:
        """Capacity minus the predicted peak reserved bytes (negative: what is missing)."""
        return self.capacity - self.peak_reserved

    def to_dict(self) -> dict[str, Any]:
        """``kind``, ``action``, ``peak_reserved``, ``capacity``, ``fits``, ``margin``,
        ``unsure`` and the details."""
        return {
            "kind": self.kind,
            "action": self.action,
            "peak_reserved": self.peak_reserved,
            "capacity": self.capacity,
            "fits": self.fits,
            "margin": self.margin,
            "unsure": self.unsure,
            **self.details,
        }


@dataclass(frozen=True)
class OOMReport:
    """Why a request ran out of memory, what held the memory and what would fit; bytes throughout.

    ``requested`` is the failing storage's size, ``block_size`` the allocator's rounded block for
    it, ``segment_size`` the device allocation it tried. ``capacity`` / ``reserved`` /
    ``allocated`` / ``free`` (the device's unreserved bytes) / ``cached_free`` (reserved but
    unallocated) / ``largest_free_block`` (the largest cached free block) /
    ``inactive_split_bytes`` are the allocator's at the moment of the failure, after its retry
    path released unused cached segments. ``verdict`` is :data:`FRAGMENTATION` when the free bytes
    in all (``free + cached_free``) would hold the block but no free block does, else
    :data:`SHORTAGE`; ``None`` when no allocator state was captured (then the numbers are
    ``None`` too). ``caught`` is True when the error did not leave the watched block as it was
    raised (a ``try`` inside swallowed or replaced it). ``snapshot_path`` is where the memory
    snapshot was written, ``snapshot_error`` why it could not be (then ``snapshot_path`` is ``None``).
    Where a tracker recorded memory per module, ``module`` is ``(path, "forward" | "backward")`` of
    the module running at the failure and ``activations`` ``(path, bytes)`` of the module whose
    saved tensors held the most then (paths as ``by_module`` gives them; ``""`` is the root).
    ``workspaces``: the sentence naming the modelled cuBLAS workspaces the numbers include, which
    the first line ends with (a tracker's run; ``None`` for a GPU's own error or where none was
    modelled; ``CUBLAS_WORKSPACE_CONFIG=:0:0`` turns them off).
    ``notes`` are one line each: what could not be captured, and each remedy left out and why
    (``checkpointing: not estimated: CheckpointError: …``, the exception's first line).
    """

    error_type: str
    message: str
    place: Place | None
    device: str | None = None
    source: str | None = None
    requested: int | None = None
    block_size: int | None = None
    segment_size: int | None = None
    capacity: int | None = None
    reserved: int | None = None
    allocated: int | None = None
    free: int | None = None
    cached_free: int | None = None
    largest_free_block: int | None = None
    inactive_split_bytes: int | None = None
    verdict: str | None = None
    culprits: tuple[Culprit, ...] = ()
    remedies: tuple[Remedy, ...] = ()
    snapshot_path: str | None = None
    snapshot_error: str | None = None
    caught: bool = False
    notes: tuple[str, ...] = ()
    module: tuple[str, str] | None = None
    activations: tuple[str, int] | None = None
    workspaces: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-ready): every field, ``place`` as ``file``, ``line``,
        ``function``, ``code``, culprits and remedies as lists of dicts, ``module`` as ``path`` and
        ``phase``, ``activations`` as ``path`` and ``bytes``."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["place"] = None if self.place is None else dataclasses.asdict(self.place)
        data["culprits"] = [dataclasses.asdict(c) for c in self.culprits]
        data["remedies"] = [r.to_dict() for r in self.remedies]
        data["notes"] = list(self.notes)
        module, activations = self.module, self.activations
        data["module"] = None if module is None else {"path": module[0], "phase": module[1]}
        data["activations"] = (
            None if activations is None else {"path": activations[0], "bytes": activations[1]}
        )
        return data

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        """The report as it is printed: a screen of text, sizes 1024-based (``40.00K``), files
        inside the current directory relative to it (``to_dict`` keeps them whole)."""
        where = "" if self.place is None else f" at {self.place} in {self.place.function}"
        caught = " (caught before it left the watched block)" if self.caught else ""
        lines = [f"memlab: out of memory ({self.error_type}){where}{caught}"]
        if self.workspaces is not None:
            lines[0] += f"; {self.workspaces}"
        if self.place is not None and self.place.code:
            lines.append(f"  {self.place.line:>5} | {self.place.code}")
        if self.requested is None:
            lines.append(f"  {self.message.splitlines()[0] if self.message else ''}"[:200])
            lines.append("  (no allocator state was captured for this error)")
            lines += [f"  {note}" for note in self.notes]
        else:
            lines += self._state_lines()
        if self.module is not None:
            lines.append(f"module running: {self.module[0] or '(root)'} ({self.module[1]})")
        if self.activations is not None:
            path, held = self.activations[0] or "(root)", format_size(self.activations[1])
            lines.append(f"most activations: {path} holds {held} saved for backward")
        if self.culprits:
            lines.append("largest live tensors:")
            width = min(max(_NAME_WIDTH, *(len(c.name) for c in self.culprits)), _LONGEST_NAME)
            for c in self.culprits:
                name = shortened(c.name, width)
                place = f"  {_shown_place(c.allocated_at)}" if c.allocated_at else ""
                lines.append(f"  {name:<{width}} {c.category:<15} {format_size(c.size):>9}{place}")
        if self.remedies:
            lines.append(
                f"remedies (predicted peak reserved, capacity {format_size(self.remedies[0].capacity)}):"
            )
            width = min(max(len(r.action) for r in self.remedies), _ACTION_WIDTH)
            for r in self.remedies:
                verdict = {True: "fits", False: "does not fit", None: f"margin {format_size(r.margin)}"}
                lines.append(f"  {r.action:<{width}} {format_size(r.peak_reserved):>9}  {verdict[r.fits]}")
            unsure = dict.fromkeys(r.unsure for r in self.remedies if r.fits is None)
            lines += [f"  a margin is no promise: {reason}" for reason in unsure]
        if self.requested is not None:
            lines += [f"note: {note}" for note in self.notes]
        if self.snapshot_path is not None:
            lines.append(f"snapshot: {self.snapshot_path} (memlab viz, or pytorch.org/memory_viz)")
        elif self.snapshot_error is not None:
            lines.append(f"snapshot: not written: {self.snapshot_error}")
        return "\n".join(lines)

    def _state_lines(self) -> list[str]:
        assert self.requested is not None and self.block_size is not None
        size = format_size
        lines = [
            f"  requested {size(self.requested)} (block {size(self.block_size)}, new segment "
            f"{size(self.segment_size or 0)}) on {self.device}, {self.source}",
            f"  capacity {size(self.capacity or 0)}  reserved {size(self.reserved or 0)}  allocated "
            f"{size(self.allocated or 0)}  free {size(self.free or 0)}",
        ]
        free, cached = size(self.free or 0), size(self.cached_free or 0)
        total = size((self.free or 0) + (self.cached_free or 0))
        free_in_all = f"{total} free in all ({free} on the device, {cached} cached)"
        if self.verdict == FRAGMENTATION:
            lines.append(
                f"verdict: fragmentation: {free_in_all}, but the largest free block is "
                f"{size(self.largest_free_block or 0)}; inactive split blocks hold "
                f"{size(self.inactive_split_bytes or 0)}"
            )
        else:
            lines.append(
                f"verdict: shortage: {free_in_all}, less than the {size(self.block_size)} block requested"
            )
        return lines
