"""Shared by the tests of sharded training in this process."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def collect_sharded_models():
    """Collect, after each test, the models it sharded: FSDP2's and DDP's state refer back to the
    modules (reference cycles), so a dropped model's tensors stay alive until the garbage collector
    runs, and a later test that counts the tensors existing before it profiles would count them."""
    yield
    gc.collect()
