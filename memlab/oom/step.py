"""Remedies that estimate the failing step under a change (a smaller batch, autocast, activation
checkpointing) with :mod:`memlab.estimate`, without running it on the device."""

from __future__ import annotations

from collections.abc import Callable

from memlab.oom.capture import OOMCapture
from memlab.oom.report import Remedy

__all__ = ["STEP_REMEDIES"]

#: The step remedies, in the order they are listed.
STEP_REMEDIES: tuple[Callable[[OOMCapture], Remedy | None], ...] = ()
