"""Snapshot diffs: what appeared, disappeared, grew or shrank between two memory snapshots.

Made for per-batch growth: take ``MemReporter.snapshot()`` before a step and
``MemReporter.diff(before)`` after it; the diff names the tensors that changed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from memlab._devices import DeviceLike
from memlab._outputs import check_stream
from memlab._units import format_size
from memlab.reporter.snapshot import (
    NAME_WIDTH,
    RULE,
    SIZE_WIDTH,
    TensorRecord,
    TensorSnapshot,
    device_key,
    device_matches,
    device_order,
    format_shape,
    sizes_line,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DiffEntry", "SnapshotDiff"]


@dataclass(frozen=True)
class DiffEntry:
    """How one named tensor changed between two snapshots.

    ``change`` is ``"appeared"``, ``"disappeared"``, ``"grew"`` or ``"shrank"``; ``before`` and
    ``after`` are the bytes the report counted for it (``0`` where it did not exist).
    """

    change: str
    device: str
    name: str
    category: str
    shape: tuple[int | str, ...] | None
    before: int
    after: int

    @property
    def delta(self) -> int:
        """``after - before`` in bytes."""
        return self.after - self.before


@dataclass(frozen=True)
class SnapshotDiff:
    """What appeared, disappeared, grew or shrank between two :class:`TensorSnapshot` s.

    Tensors are matched by device and name: parameters, buffers, gradients and optimizer state by
    their names (a gradient replaced by a new tensor of the same size is no change), other tensors
    by the ``TensorN`` name a reporter keeps for the same tensor object while it lives. Bytes are
    those the report counts (each storage once, under its owner), so both snapshots must come from
    reporters with the same ``device_model``. Tensors whose size is symbolic only appear or disappear.
    """

    before: TensorSnapshot
    after: TensorSnapshot
    entries: tuple[DiffEntry, ...]

    @classmethod
    def between(cls, before: TensorSnapshot, after: TensorSnapshot) -> SnapshotDiff:
        """Compare ``before`` with the later ``after``; ``ValueError`` if they count bytes differently
        (one taken with ``device_model="cuda"``, the other without)."""
        if before.device_model != after.device_model:
            raise ValueError(
                f"cannot compare a snapshot taken with device_model={before.device_model!r} with one "
                f"taken with device_model={after.device_model!r}: they count bytes differently"
            )
        old = {(r.device, r.name): r for r in before.records}
        new = {(r.device, r.name): r for r in after.records}
        entries = []
        for key, record in new.items():
            previous = old.get(key)
            now = record.memory or 0
            if previous is None:
                entries.append(_entry("appeared", record, 0, now))
            elif (previous.memory or 0) != now:
                then = previous.memory or 0
                entries.append(_entry("grew" if now > then else "shrank", record, then, now))
        entries += [_entry("disappeared", r, r.memory or 0, 0) for key, r in old.items() if key not in new]
        entries.sort(key=lambda e: device_order(e.device))
        return cls(before, after, tuple(entries))

    def _of(self, change: str) -> list[DiffEntry]:
        return [entry for entry in self.entries if entry.change == change]

    @property
    def appeared(self) -> list[DiffEntry]:
        """Tensors present only in the later snapshot."""
        return self._of("appeared")

    @property
    def disappeared(self) -> list[DiffEntry]:
        """Tensors present only in the earlier snapshot."""
        return self._of("disappeared")

    @property
    def grew(self) -> list[DiffEntry]:
        """Tensors counted with more bytes in the later snapshot."""
        return self._of("grew")

    @property
    def shrank(self) -> list[DiffEntry]:
        """Tensors counted with fewer bytes in the later snapshot."""
        return self._of("shrank")

    def memory_change(self, device: DeviceLike | None = None) -> int:
        """Change in counted bytes on ``device`` (``None`` = all devices, ``"cuda"`` = all CUDA)."""
        wanted = device_key(device)
        return sum(e.delta for e in self.entries if device_matches(e.device, wanted))

    def render(self, device: DeviceLike | None = None) -> str:
        """The diff as text: one block per device, one line per changed tensor, counts, and the line
        that says where the sizes come from."""
        device = device_key(device)
        entries = [e for e in self.entries if device_matches(e.device, device)]
        width = max([NAME_WIDTH - 12, *(len(e.name) + 2 for e in entries)])
        line = f"{{:<12s}}{{:<{width}s}}{{:>{SIZE_WIDTH}s}}{{:>10s}}{{:>10s}}{{:>10s}}"
        rule = "-" * max(len(RULE), 12 + width + SIZE_WIDTH + 30)
        out = [line.format("Change", "Element type", "Size", "Before", "After", "Delta")]
        for dev in sorted({e.device for e in entries}, key=device_order):
            out += [rule, f"Storage on {dev}"]
            for e in (e for e in entries if e.device == dev):
                size = format_shape(e.shape)
                out.append(
                    line.format(
                        e.change, e.name, size, format_size(e.before), format_size(e.after), _signed(e.delta)
                    )
                )
        out.append(rule)
        counts = "  ".join(
            f"{c.capitalize()}: {len(self._of(c))}" for c in ("appeared", "disappeared", "grew", "shrank")
        )
        out.append(f"{counts}  Used Memory change: {_signed(self.memory_change(device))}")
        out.append(sizes_line(self.after.device_model, (e.device for e in entries)))
        return "\n".join(out)

    def report(self, device: DeviceLike | None = None, stream: TextIO | None = None) -> None:
        """Write :meth:`render` to ``stream`` (default: ``sys.stdout`` at call time)."""
        check_stream(stream)
        print(self.render(device), file=sys.stdout if stream is None else stream)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per change: ``change``, ``device``, ``name``, ``category``, ``shape``, ``before``,
        ``after``, ``delta`` (bytes)."""
        import pandas as pd

        columns = ["change", "device", "name", "category", "shape", "before", "after", "delta"]
        return pd.DataFrame(
            [
                [e.change, e.device, e.name, e.category, e.shape, e.before, e.after, e.delta]
                for e in self.entries
            ],
            columns=columns,
        )

    def __str__(self) -> str:
        return self.render()


def _entry(change: str, record: TensorRecord, before: int, after: int) -> DiffEntry:
    return DiffEntry(change, record.device, record.name, record.category, record.shape, before, after)


def _signed(nbytes: int) -> str:
    return ("+" if nbytes > 0 else "") + format_size(nbytes)
