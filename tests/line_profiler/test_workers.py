"""``@memlab.profile`` in DataLoader worker processes (``num_workers > 0``, fork and spawn): the
calls there are not profiled, and the process that made the DataLoader says so in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlab.line_profiler.workers import calls_folder

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
import os
import sys
import torch
import memlab
from torch.utils.data import DataLoader, Dataset


@memlab.profile
def make(i):
    x = torch.ones(256)
    return x * i


class Squares(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return make(i)


if __name__ == "__main__":
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context=sys.argv[1])
    print(sum(int(batch.sum()) for batch in loader))
    print(os.getpid(), file=sys.stderr)
"""

LINE = "6 calls of make ran in 2 DataLoader worker processes and were not collected\n"


def run(tmp_path: Path, context: str, *memlab_run: str) -> subprocess.CompletedProcess[str]:
    """The script, as ``python load.py CONTEXT`` or (``memlab_run``: memlab's options) under
    ``python -m memlab run``, in a fresh process."""
    script = tmp_path / "load.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # spawned workers import this checkout's memlab too
    prefix = ["-m", "memlab", "run", *memlab_run] if memlab_run else []
    return subprocess.run(
        [sys.executable, *prefix, str(script), context],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_calls_in_dataloader_workers_are_one_line_at_exit(tmp_path, context):
    done = run(tmp_path, context)
    # 256 ones times 0..5: the workers ran make, unprofiled, and returned its results
    assert (done.returncode, done.stdout) == (0, f"{256 * 15}\n\n{LINE}"), done.stderr
    assert not os.path.exists(calls_folder(int(done.stderr.split()[-1])))  # the counts, read, are gone


def test_memlab_run_says_so_after_the_table(tmp_path):
    done = run(tmp_path, "fork", "-c", "active_bytes.all.peak", "-D")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (  # load.py is outside the working directory: named as run, absolute
        f"{256 * 15}\n## make  ({tmp_path / 'load.py'}:9)\n\n"
        f"registered, but never called while profiling\n\n{LINE}"
    )
