"""OOM post-mortem: when ``torch.OutOfMemoryError`` passes a watch, say where it failed, what held
the memory, whether it was fragmentation or shortage, and what would fit, with numbers.

:mod:`.watch` holds :func:`explain_oom` (the context manager and decorator), :mod:`.capture` the
state captured at the moment of the error (:mod:`.names` names its largest live tensors),
:mod:`.postmortem` the verdict and remedies, :mod:`.step` the remedies estimated from the step,
:mod:`.report` the report and its renderers.
"""

from __future__ import annotations

from memlab.oom.report import OOMReport, Remedy
from memlab.oom.watch import OOMWatch, explain_oom, last_report

__all__ = ["OOMReport", "OOMWatch", "Remedy", "explain_oom", "last_report"]
