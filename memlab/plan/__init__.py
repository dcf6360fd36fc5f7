"""Make it fit: the cheapest change to a training step that fits a budget (:func:`plan`), proved
by the estimate of the changed step, applied to a model and removed again (:class:`Plan`)."""

from memlab.plan.planner import plan
from memlab.plan.result import Plan

__all__ = ["Plan", "plan"]
