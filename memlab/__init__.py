"""memlab: where does my PyTorch memory go, line by line, and will it fit?

Importing memlab has no side effects: it does not initialise CUDA, install a trace function or print.
"""

from __future__ import annotations

from memlab.sources.stats import STAT_KEYS

__version__ = "0.1.0"

__all__ = [
    "STAT_KEYS",
    "__version__",
]
