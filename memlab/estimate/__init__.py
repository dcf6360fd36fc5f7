"""Will it fit? Memory estimates before running (:func:`estimate`), the largest batch that fits
(:func:`max_batch_size`) and automatic micro-batching with exact gradients (:func:`autobatch`)."""

from memlab.estimate.estimate import Estimate, EstimateError, estimate

__all__ = ["Estimate", "EstimateError", "estimate"]
