from __future__ import annotations

import sys

import pytest
import torch


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


@pytest.fixture(autouse=True)
def forget_the_dummy_nested_tensor():
    """PyTorch keeps, from the first nested jagged tensor of a process, a dummy one (two meta
    tensors): forgotten after each test, so that later tests that count the tensors alive before
    they profile do not find it (it is made again when needed)."""
    yield
    nested_tensor = sys.modules.get("torch.nested._internal.nested_tensor")
    if nested_tensor is not None:
        nested_tensor._dummy_instance = None
