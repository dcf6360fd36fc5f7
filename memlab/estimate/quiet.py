"""PyTorch's fake-tensor logger, quiet while memlab runs code on fake tensors.

When an op fails under ``FakeTensorMode`` (a shape error in the user's step, or an op an OOM remedy
estimate cannot run), PyTorch logs the whole traceback at ``ERROR`` level before it raises, a few
dozen ``E… failed while attempting to run meta`` lines on stderr. The error itself still reaches
the caller (``memlab.estimate`` raises it, the OOM report names the remedy that could not be
computed), so during memlab's own data-free runs those lines say nothing new.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["FAKE_TENSOR_LOGGER", "fake_tensor_logs_quiet"]

#: The logger of ``torch._subclasses.fake_tensor`` (``logging.getLogger(__name__)`` there).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


@contextlib.contextmanager
def fake_tensor_logs_quiet() -> Iterator[None]:
    """Raise the fake-tensor logger's level above ``ERROR`` for the block, then restore the level
    it had (also when the block raises). Only that logger: the rest of PyTorch's logs, and the
    user's own, are untouched."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
