"""The ``--memlab`` table under pytest-xdist, simulated (pytest-xdist is not installed here): a
real pytest run in the role of a worker (``config.workerinput`` / ``config.workeroutput`` set
as xdist sets them before ``pytest_configure``), whose ``workeroutput`` then reaches the
controller's plugin through ``pytest_testnodedown``, as xdist delivers it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memlab.pytest_plugin.plugin import MeasuringPlugin

pytest_plugins = ["pytester"]

WORKER_CONFTEST = """\
import json
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.workerinput = {"workerid": "gw1"}  # what xdist sets in a worker, before pytest_configure
    config.workeroutput = {}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):  # xdist sends workeroutput to the controller here
    with open("workeroutput.json", "w") as file:
        json.dump(session.config.workeroutput, file)
"""

TESTS = """\
import torch


def test_small():
    a = torch.empty(1024 * 1024)


def test_big():
    a = torch.empty(4 * 1024 * 1024)
"""


@pytest.fixture(autouse=True, scope="module")
def measuring_imported() -> None:
    """As in test_plugin.py: pytester removes the modules a run imported; torch cannot import
    them twice."""
    from memlab.pytest_plugin.measure import measured

    with measured(history=True, leaks=True):
        torch.empty(1)


class Reporter:
    """The part of pytest's terminal reporter the summary uses, keeping its lines."""

    def __init__(self) -> None:
        self.config = SimpleNamespace()
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title}")

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def worker_output(pytester: pytest.Pytester) -> tuple[Any, list[str]]:
    pytester.makeconftest(WORKER_CONFTEST)
    pytester.makepyfile(test_file=TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--memlab")
    result.assert_outcomes(passed=2)
    with open(pytester.path / "workeroutput.json", encoding="utf-8") as file:
        return json.load(file), result.outlines


def test_a_worker_sends_its_peaks_and_prints_no_table_of_its_own(pytester):
    output, lines = worker_output(pytester)
    # float32: 4 MiB in a 4 MiB block of a 20 MiB segment; 16 MiB: its own 16 MiB segment
    assert output == {
        "memlab_peaks": [
            ["test_file.py::test_small", "cpu", 4 * 2**20, 20 * 2**20, ""],
            ["test_file.py::test_big", "cpu", 16 * 2**20, 16 * 2**20, ""],
        ]
    }
    assert not any("memlab: tests with the highest tensor peaks" in line for line in lines)


def test_the_controller_lists_every_worker_s_tests_and_names_a_worker_that_crashed(pytester):
    output, _ = worker_output(pytester)
    controller = MeasuringPlugin(None, True, 5)
    controller.pytest_testnodedown(
        SimpleNamespace(workerinput={"workerid": "gw1"}, workeroutput=output), None
    )
    crashed = SimpleNamespace(workerinput={"workerid": "gw2"})  # xdist sets no workeroutput then
    controller.pytest_testnodedown(crashed, "Not properly terminated")
    reporter = Reporter()
    controller.pytest_terminal_summary(reporter)
    assert reporter.lines == [
        "== memlab: tests with the highest tensor peaks",
        " allocated   reserved  device  test",
        "    16.00M     16.00M  cpu     test_file.py::test_big",
        "     4.00M     20.00M  cpu     test_file.py::test_small",
        "Peaks of each test call's own tensors (setup and teardown excluded); cuda: torch.cuda.memory_stats, "
        "other devices: the CUDA caching allocator modelled by memlab.TensorTracker (with the cuBLAS "
        "workspaces of the GPU it models, named after the test where a matmul made them; "
        "CUBLAS_WORKSPACE_CONFIG=:0:0 turns them off)",
        "Not in this table: the tests of pytest-xdist worker gw2: Not properly terminated",
    ]
