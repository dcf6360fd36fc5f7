"""The statistics every memory source reports: the key set of ``torch.cuda.memory_stats()``.

The keys are defined beside the counters the allocator models keep
(:mod:`memlab.sources.allocator.stats`, a layer below the sources that read them); sources, renderers
and users read them here.
"""

from __future__ import annotations

from memlab.sources.allocator.stats import COUNTERS, METRICS, POOLED_STATS, POOLS, STAT_KEYS, UNPOOLED_STATS

__all__ = ["COUNTERS", "METRICS", "POOLED_STATS", "POOLS", "STAT_KEYS", "UNPOOLED_STATS"]
