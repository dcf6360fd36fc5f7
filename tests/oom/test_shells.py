"""explain_oom is active by itself in `memlab run` and %mlrun."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SCRIPT = """\
import torch
import memlab


@memlab.profile
def step(n):
    with memlab.TensorTracker(capacity="10 MiB"):
        return torch.empty(n)


step(4 * 2**20)
"""


def test_memlab_run_explains_an_oom_in_a_profiled_function(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "MEMLAB_OOM_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "memlab", "run", str(script)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    err = done.stderr.splitlines()
    assert err[:4] == [
        f"memlab: out of memory (OutOfMemoryError) at {script}:8 in step",
        "      8 | return torch.empty(n)",
        "  requested 16.00M (block 16.00M, new segment 16.00M) on cpu, modelled CUDA caching allocator",
        "  capacity 10.00M  reserved 0.00B  allocated 0.00B  free 10.00M",
    ]
    # then the program's own traceback, as python prints it
    assert err[-1].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 MiB.")
    assert list(tmp_path.iterdir()) == [script]  # no history: no snapshot


@pytest.fixture
def ip() -> Iterator[Any]:
    globalipapp = pytest.importorskip("IPython.testing.globalipapp")
    shell = globalipapp.get_ipython()
    shell.reset(new_session=False)
    shell.extension_manager.load_extension("memlab")
    yield shell
    shell.reset(new_session=False)
    shell.InteractiveTB.tb = shell.last_execution_result = None


def test_mlrun_explains_an_oom(ip: Any, capsys: Any, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))
    ip.run_cell("import torch, memlab\ndef grow(n):\n    return torch.empty(n)\n")
    result = ip.run_cell(
        'with memlab.TensorTracker(capacity="10 MiB"):\n    %mlrun -f grow grow(4 * 2**20)\n'
    )
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("memlab: out of memory (OutOfMemoryError) at ") and first.endswith(":3 in grow")
    assert "  requested 16.00M (block 16.00M, new segment 16.00M) on cpu" in err
