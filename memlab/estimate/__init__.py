"""Will it fit? Memory estimates before running (:func:`estimate`), the largest batch that fits
(:func:`max_batch_size`) and micro-batching with exact gradients (:func:`autobatch`)."""

from memlab.estimate.estimate import Estimate, EstimateError, estimate
from memlab.estimate.fit import BatchFit, max_batch_size
from memlab.estimate.microbatch import AutoBatched, autobatch

__all__ = ["AutoBatched", "BatchFit", "Estimate", "EstimateError", "autobatch", "estimate", "max_batch_size"]
