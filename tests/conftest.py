from __future__ import annotations

import gc
import os
import signal
import sys

import pytest
import torch

from memlab._torch_version import torch_at_least

# The suite's exact outputs (README, CLI and notebook tables, plots, reports) are written for the
# cuBLAS workspaces of torch 2.12 and later, where cuBLASLt shares the handle's cuBLAS workspace.
# torch 2.9-2.11 give cuBLASLt a 1 MiB workspace of its own per handle unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=1; torch 2.8 allocates one for each cuBLASLt call unless
# CUBLASLT_WORKSPACE_SIZE=0. Both are PyTorch's own switches, which the model reads as PyTorch does:
# set here (and so inherited by the scripts the tests run) so that those outputs hold on every
# supported release. tests/sources/test_workspaces.py unsets them and checks each release's own
# default layout.
if not torch_at_least(2, 9):
    os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")
elif not torch_at_least(2, 12):
    os.environ.setdefault("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")


def pytest_collection_modifyitems(config, items):
    """The trainer integrations' tests run last: the frameworks they import keep tensors for the
    life of the process (torchmetrics' module-level ``_EPS_SMOOTHING``, imported with Lightning) and
    leave trainers in reference cycles, which the tests that walk every live tensor (a profile's
    "no tensors existed before profiling") would count. Then CUDA-only tests are skipped without a GPU."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/integrations/"))  # stable: order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def collected_heap():
    """Each test file starts from a collected heap, as when run alone: garbage that an earlier
    file's tests left in reference cycles (a script's namespace, a model and its optimizer) holds
    tensors until the collector runs, and a profile adopts every tensor alive, as a GPU counts
    their memory until then; when the collector runs depends on everything run before. One
    collection per file (about 0.1 s), not per test."""
    gc.collect()


@pytest.fixture
def ctrl_c():
    """Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` during the test, as in a terminal, also where the
    suite was started with SIGINT ignored (a shell's ``&`` without job control does that, and then
    Python installs no handler of its own); put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def forget_the_dummy_nested_tensor():
    """PyTorch keeps, from the first nested jagged tensor of a process, a dummy one (two meta
    tensors): forgotten after each test, so that later tests that count the tensors alive before
    they profile do not find it (it is made again when needed)."""
    yield
    nested_tensor = sys.modules.get("torch.nested._internal.nested_tensor")
    if nested_tensor is not None:
        nested_tensor._dummy_instance = None
