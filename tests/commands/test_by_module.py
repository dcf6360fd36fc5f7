"""``memlab run --by-module``: the memory per module of every model the script calls, after the table.

On CPU the script's tracker models the CUDA caching allocator: ``Linear(256, 1024)``'s weight is a
1 MiB block and its bias a 4 KiB one; the ReLU saves its 64 x 1024 float32 output (256 KiB).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
from memlab._units import format_size
from memlab.cli import main
from memlab.line_profiler import decorators
from memlab.sources.module_table import ModuleTable

SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
loss = nn.MSELoss()

def step():
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    loss(model(x), y).backward()

step()
"""
HEADER = "module   type        calls  forward  backward  parameter  gradient  optimizer  activation"


@pytest.fixture(autouse=True)
def fresh_global_profiler(monkeypatch: Any) -> None:
    """Each in-process run gets its own decorators' profiler, as a new process would."""
    monkeypatch.setattr(decorators, "_global", None)


def rows(text: str) -> list[list[str]]:
    """The rows of the module table printed in ``text``, split into cells."""
    lines = text.splitlines()
    start = lines.index(HEADER) + 1
    return [line.split() for line in lines[start:] if line.strip()]


def in_process() -> ModuleTable:
    """The module table of the script's code run in this process under a tracker entered before
    its first line, as ``memlab run`` enters one."""
    namespace = {"__name__": "__main__"}
    with memlab.TensorTracker(modules=True) as tracker:
        exec(compile(SCRIPT, "script.py", "exec"), namespace)
    namespace.clear()  # the script's model goes now, not at a later garbage collection
    return tracker.module_table()


def size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def test_run_by_module_prints_every_model_the_script_calls(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    assert main(["run", "--by-module", str(script)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # no "nothing was profiled": the module table is what was asked for
    lines = captured.out.splitlines()
    assert lines[0] == "memory per module on cpu, highest peak first"
    found = rows(captured.out)
    expected = in_process()
    assert [row[0] for row in found] == [
        row.path or "(root)" for row in expected.by_peak()
    ]  # highest peak first
    assert {row[0]: (row[3], row[4]) for row in found} == {
        row.path or "(root)": (size(row.forward_peak), size(row.backward_peak)) for row in expected.rows
    }
    # path, type, calls, then parameter, gradient, optimizer_state, activation
    assert sorted([row[:3] + row[5:] for row in found]) == [
        ["(root)", "Sequential", "1", "0.00B", "0.00B", "0.00B", "0.00B"],
        ["0", "Linear", "1", "1.00M", "1.00M", "0.00B", "64.00K"],  # it saved the batch x
        ["1", "ReLU", "1", "0.00B", "0.00B", "0.00B", "256.00K"],
        ["2", "Linear", "1", "1.00M", "1.00M", "0.00B", "0.00B"],  # its input was saved by the ReLU first
        ["MSELoss", "MSELoss", "1", "0.00B", "0.00B", "0.00B", "128.00K"],  # prediction and target
    ]


def test_run_by_module_follows_the_line_table(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    assert main(["run", "-f", "step", "--by-module", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.index("## step") < out.index("\n\nmemory per module on cpu, highest peak first\n")
    assert len(rows(out)) == 5


def test_without_by_module_no_module_is_recorded(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    assert main(["run", "-f", "step", str(script)]) == 0
    assert "memory per module" not in capsys.readouterr().out
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_the_programs_tensors_are_gone_when_main_returns(tmp_path: Path, capsys: Any, monkeypatch: Any):
    """The script's namespace is a reference cycle (``step`` reads the module's globals, which hold
    ``step``); an in-process ``memlab run`` lets it go as a process's end would, so a profile after
    it does not count the script's model as tensors that existed before profiling."""
    probe = types.ModuleType("memlab_test_probe")
    monkeypatch.setitem(sys.modules, probe.__name__, probe)
    script = tmp_path / "script.py"
    script.write_text(
        SCRIPT + "import sys, weakref\n"
        "sys.modules['memlab_test_probe'].weight = weakref.ref(model[0].weight)\n",
        encoding="utf-8",
    )
    assert main(["run", "-f", "step", str(script)]) == 0
    capsys.readouterr()
    assert probe.weight() is None
