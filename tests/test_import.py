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


def test_memlab_estimate_is_the_function_after_its_subpackage_is_imported():
    code = (
        "import memlab\n"
        "from memlab.estimate import max_batch_size\n"
        "import memlab.estimate.kernels\n"
        "from memlab.estimate.estimate import estimate\n"
        "assert memlab.estimate is estimate and memlab.max_batch_size is max_batch_size\n"
        "print(sorted(set(memlab.__all__) - set(dir(memlab))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (result.stdout, result.stderr) == ("[]\n", "")
