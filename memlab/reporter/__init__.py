"""MemReporter: every tensor ``gc`` can reach, named, each storage counted once.

:mod:`~memlab.reporter.reporter` finds and names the tensors, :mod:`~memlab.reporter.records` turns
them into plain records, :mod:`~memlab.reporter.snapshot` holds and renders them (text, DataFrame),
:mod:`~memlab.reporter.diff` compares two snapshots.
"""

from __future__ import annotations

from memlab.reporter.diff import DiffEntry, SnapshotDiff
from memlab.reporter.reporter import AllocatedMemorySource, MemReporter
from memlab.reporter.snapshot import TensorRecord, TensorSnapshot

__all__ = [
    "AllocatedMemorySource",
    "DiffEntry",
    "MemReporter",
    "SnapshotDiff",
    "TensorRecord",
    "TensorSnapshot",
]
