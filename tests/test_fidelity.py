"""A CPU run shows what a GPU would: tensors made before profiling count, however memlab is started.

On a GPU, a profiled function's ``def`` row holds everything already on the device (model, optimizer
state, batch). Without one, memlab's tracker adopts those tensors when profiling starts, or tracks
the script from its first line (``memlab run``); either way the active and allocated bytes agree.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memlab.line_profiler import read_json

COLUMNS = ("active_bytes.all.peak", "allocated_bytes.all.peak", "reserved_bytes.all.peak")

SCRIPT = """\
import sys

import torch

import memlab

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
inputs = torch.randn(64, 256)
targets = torch.randint(0, 10, (64,))


@memlab.profile(columns={columns!r})
def train_step():
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


for _ in range(3):
    train_step()
memlab.line_profiler.global_line_profiler().to_json(sys.argv[1], train_step)
"""


def cuda_bytes(*nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for storages of ``nbytes`` each (all of them in
    its small pool here): each request rounded up to a multiple of 512 B."""
    return sum(-(-n // 512) * 512 for n in nbytes)


# At the 2nd and 3rd entries: parameters, their gradients and SGD's momentum buffers (three copies of
# 256x512 + 512 + 512x10 + 10 floats), then the inputs (64x256 floats) and targets (64 int64).
PARAMETERS = (256 * 512 * 4, 512 * 4, 512 * 10 * 4, 10 * 4)
# And the two 32 MiB cuBLAS workspaces of the modelled H100: the forward's thread's, the autograd thread's.
ALIVE_AT_ENTRY = 3 * cuda_bytes(*PARAMETERS) + cuda_bytes(64 * 256 * 4, 64 * 8) + 2 * 32 * 2**20


def profile_script(tmp_path: Path, *command: str) -> Any:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(columns=COLUMNS))
    output = tmp_path / f"{len(command)}.json"
    subprocess.run([*command, str(script), str(output)], check=True, capture_output=True, timeout=300)
    return read_json(output)


def test_python_memlab_run_and_memlab_run_f_show_the_same_active_and_allocated_bytes(tmp_path: Path):
    assert ALIVE_AT_ENTRY == 1_708_032 + 67_108_864
    plain = profile_script(tmp_path, sys.executable)
    memlab_run = (sys.executable, "-m", "memlab", "run", "-c", "allocated_bytes.all.peak")
    run = profile_script(tmp_path, *memlab_run)
    named = profile_script(tmp_path, *memlab_run, "-f", "train_step")
    for frame in (plain, run, named):
        assert frame["active_bytes.all.peak"].dropna().iloc[0] == ALIVE_AT_ENTRY  # the def row
    for column in ("active_bytes.all.peak", "allocated_bytes.all.peak"):
        assert plain[column].tolist() == run[column].tolist() == named[column].tolist()


@pytest.fixture
def ip() -> Iterator[Any]:
    from IPython.testing import globalipapp

    shell = globalipapp.get_ipython()
    shell.extension_manager.load_extension("memlab")
    names = set(shell.user_ns)
    shell.history_manager.output_hist.clear()  # earlier results would hold tensors
    gc.collect()
    yield shell
    for name in set(shell.user_ns) - names:
        del shell.user_ns[name]


def def_row(profiler: Any) -> int:
    return int(
        profiler.to_dataframe("f", ("active_bytes.all.peak",))["active_bytes.all.peak"].dropna().iloc[0]
    )


def test_ipython_def_rows_count_a_model_built_in_an_earlier_cell_every_time(ip: Any):
    ip.run_cell(
        "import torch\nmodel = torch.nn.Linear(256, 256)\nbatch = torch.randn(32, 256)", store_history=True
    )
    expected = cuda_bytes(256 * 256 * 4, 256 * 4, 32 * 256 * 4)
    assert expected == 295_936
    cell = textwrap.dedent(
        """\
        def f():
            out = model(batch)
            return out.sum()
        f()
        """
    )
    first = ip.run_cell_magic("mlrun", "-q -r -f f", cell)
    assert def_row(first) == expected
    assert first.source_line() == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        "(memlab.TensorTracker); 3 tensor storages (289.00K) existed before profiling; includes 1 modelled "
        "cuBLAS workspace of the H100: 32.00M"  # the forward's matmul
    )
    again = ip.run_line_magic("mlrun", "-q -r -f f f()")
    assert def_row(again) == expected
