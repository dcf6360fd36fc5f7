"""memlab's data-free runs keep PyTorch's fake-tensor logger quiet: an op that fails on fake tensors
raises its own error, without the few dozen ``failed while attempting to run meta`` lines PyTorch
logs before it raises; the logger's level is restored afterwards."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import memlab
from memlab.estimate.quiet import FAKE_TENSOR_LOGGER, fake_tensor_logs_quiet


def mismatched(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.ones(3, 3)


def test_an_estimate_whose_step_raises_shows_only_the_error(caplog: Any) -> None:
    caplog.set_level(logging.DEBUG, logger=FAKE_TENSOR_LOGGER)
    with pytest.raises(RuntimeError) as raised:
        memlab.estimate(mismatched, torch.ones(2, 4))
    assert str(raised.value) == "a and b must have same reduction dim, but got [2, 4] X [3, 3]."
    assert [r for r in caplog.records if r.name == FAKE_TENSOR_LOGGER and r.levelno >= logging.ERROR] == []
    assert logging.getLogger(FAKE_TENSOR_LOGGER).level == logging.DEBUG  # as it was before


def test_the_same_op_outside_memlab_is_logged_as_pytorch_logs_it(caplog: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    caplog.set_level(logging.DEBUG, logger=FAKE_TENSOR_LOGGER)
    with pytest.raises(RuntimeError, match="same reduction dim"), FakeTensorMode():
        mismatched(torch.ones(2, 4))
    logged = [
        r.getMessage() for r in caplog.records if r.name == FAKE_TENSOR_LOGGER and r.levelno >= logging.ERROR
    ]
    assert logged == ["failed while attempting to run meta for aten.mm.default"]


def test_the_level_is_restored_when_the_block_raises() -> None:
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    before = logger.level
    with pytest.raises(KeyError), fake_tensor_logs_quiet():
        assert logger.level == logging.CRITICAL
        raise KeyError("boom")
    assert logger.level == before
