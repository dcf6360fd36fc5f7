"""Importing memlab has no side effects: no CUDA initialisation, no trace function, no output."""

from __future__ import annotations

import subprocess
import sys

import memlab


def test_import_has_no_side_effects():
    code = (
        "import sys, threading, torch\n"
        "import memlab\n"
        "assert sys.gettrace() is None, sys.gettrace()\n"
        "assert threading.gettrace() is None\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(sorted(m for m in ('IPython', 'matplotlib', 'pandas') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr == ""
    assert result.stdout == "[]\n"


def test_public_api_names():
    for name in ("TensorTracker", "CachingAllocatorModel", "STAT_KEYS"):
        assert name in memlab.__all__
        assert getattr(memlab, name) is not None
    assert len(memlab.STAT_KEYS) == 9 * 3 * 4 + 2 * 4 + 7  # pooled, oversize_*, counters
