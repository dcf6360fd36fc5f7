"""One memory report across the ranks of a ``torch.distributed`` job.

:func:`gather` sends each rank's line records (a :class:`memlab.LineProfiler`) or tracker statistics
(a :class:`memlab.TensorTracker`) to one rank through ``torch.distributed``'s object collectives
(any backend) and returns there a :class:`~memlab.distributed.merge.MergedLines` or
:class:`~memlab.distributed.merge.MergedStats`. ``torch.distributed`` is imported only when
:func:`gather` runs.
"""

from __future__ import annotations

from memlab.distributed.gather import gather, rank_report
from memlab.distributed.merge import MergedLines, MergedStats, RankReport, merge_reports

__all__ = ["MergedLines", "MergedStats", "RankReport", "gather", "merge_reports", "rank_report"]
