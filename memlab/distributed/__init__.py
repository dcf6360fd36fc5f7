"""One memory report across the ranks of a ``torch.distributed`` job, and any job size from one process.

:func:`gather` sends each rank's line records (a :class:`memlab.LineProfiler`) or tracker statistics
(a :class:`memlab.TensorTracker`) to one rank through ``torch.distributed``'s object collectives
(any backend) and returns there a :class:`~memlab.distributed.merge.MergedLines` or
:class:`~memlab.distributed.merge.MergedStats`. :func:`fake_group` makes this process rank 0 (or
another) of a job of any size, for estimates of sharded training without the other ranks
(:mod:`memlab.distributed.fake`).
``torch.distributed`` is imported only when :func:`gather` or :func:`fake_group` runs.
"""

from __future__ import annotations

from memlab.distributed.fake import FakeCollectiveError, FakeGroupError, fake_group
from memlab.distributed.gather import gather, rank_report
from memlab.distributed.merge import MergedLines, MergedStats, RankReport, merge_reports

__all__ = [
    "FakeCollectiveError",
    "FakeGroupError",
    "MergedLines",
    "MergedStats",
    "RankReport",
    "fake_group",
    "gather",
    "merge_reports",
    "rank_report",
]
