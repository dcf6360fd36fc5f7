"""``memlab run`` and the pytest plugin count the tensors of threads the measured code starts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from memlab.cli import main
from memlab.line_profiler import decorators
from memlab.pytest_plugin.measure import measured

MiB = 2**20

SCRIPT = """\
import threading
import torch

def load(held):
    held.append(torch.empty(262144))  # 1 MiB of float32, made in another thread

def step():
    held = []
    worker = threading.Thread(target=load, args=(held,))
    worker.start(); worker.join()
    return held

step()
"""


@pytest.fixture(autouse=True)
def fresh_global_profiler(monkeypatch: Any) -> None:
    """Each in-process run gets its own decorators' profiler, as a new process would."""
    monkeypatch.setattr(decorators, "_global", None)


def test_memlab_run_counts_a_tensor_made_in_a_thread_the_script_starts(tmp_path: Path, capsys: Any):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT, encoding="utf-8")
    assert main(["run", "-f", "step", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.split(f"## step  ({script}:7)\n\n", 1)[1].splitlines()[
        3:
    ] == [  # active_bytes peak, reserved_bytes peak
        "       0.00B          0.00B    7  def step():",
        "       0.00B          0.00B    8      held = []",
        "       0.00B          0.00B    9      worker = threading.Thread(target=load, args=(held,))",
        "       1.00M          2.00M   10      worker.start(); worker.join()",
        "       1.00M          2.00M   11      return held",
    ]
    assert threading.getprofile() is None


def test_the_pytest_plugin_measures_a_tensor_made_in_another_thread():
    held: list[torch.Tensor] = []
    with measured() as measurement:
        worker = threading.Thread(target=lambda: held.append(torch.empty(3 * MiB // 4)))
        worker.start()
        worker.join()
        held.clear()
    assert (measurement.allocated_peak, measurement.leaked, measurement.device) == (3 * MiB, 0, "cpu")
    assert threading.getprofile() is None
