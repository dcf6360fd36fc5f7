"""Every subcommand of ``python -m torch.cuda._memory_viz`` reads a memlab snapshot unchanged.

``segments`` and ``memory`` pipe their lines through ``~/.cache/flamegraph.pl``, which PyTorch
downloads on first use; these tests run with ``HOME`` in a temporary folder that holds a stand-in
script, which wraps its input in ``<svg>`` tags, so nothing is fetched from the web.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import pickle
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.cuda import _memory_viz

import memlab
from memlab import TensorTracker

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[tuple[Path, dict, object]]:
    """A folder holding ``snapshot.pickle`` (a Linear layer kept, a 4,000 B tensor freed) and the
    stand-in flamegraph.pl where the installed torch's _memory_viz looks for it (``~/.cache``, HOME
    being that folder; torch 2.8: ``/tmp/<uid>_flamegraph.pl``, a file already there put back after);
    the snapshot; and a runner of _memory_viz there."""
    home = tmp_path_factory.mktemp("home")
    if "~/.cache/" in inspect.getsource(_memory_viz.format_flamegraph):
        script = home / ".cache" / "flamegraph.pl"
        script.parent.mkdir()
    else:
        script = Path(f"/tmp/{os.getuid()}_flamegraph.pl")
    aside = home / "flamegraph.pl.aside"
    if script.exists():
        script.rename(aside)
    script.write_text("#!/bin/sh\necho '<svg>'\ncat\necho '</svg>'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    with TensorTracker(history=True) as tracker:
        layer = torch.nn.Linear(100, 100)
        x = torch.ones(1000)
        del x
    memlab.dump_snapshot(home / "snapshot.pickle", tracker)
    assert layer.bias.nbytes == 400

    def memory_viz(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "torch.cuda._memory_viz", *args],
            cwd=home,
            env={**os.environ, "HOME": str(home)},
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout

    yield home, tracker.snapshot(), memory_viz
    script.unlink()
    if aside.exists():
        aside.rename(script)


def test_stats_sums_the_one_small_segment(run):
    _, _, memory_viz = run
    out = memory_viz("stats", "snapshot.pickle")
    assert "segments: 1\n" in out
    assert "total_reserved: 2.0MiB\n" in out
    assert "total_allocated: 39.5KiB\n" in out  # 40,000 + 400 requested bytes


def test_trace_prints_every_event(run):
    _, snapshot, memory_viz = run
    out = memory_viz("trace", "snapshot.pickle")
    assert len(snapshot["device_traces"][0]) == 6
    assert out.startswith("Device 0 ----------------\n6 entries\n")
    assert "a = cudaMalloc(" in out and "del d # 3.9KiB\n" in out


def test_segments_writes_a_flamegraph_of_each_block_and_its_frames(run):
    home, snapshot, memory_viz = run
    memory_viz("segments", "snapshot.pickle", "-o", "segments.svg")
    lines = (home / "segments.svg").read_text().splitlines()
    address = snapshot["segments"][0]["address"]
    here = f"test_memory_viz.py:{_line_of('layer = torch.nn.Linear')}:run"
    assert lines[0] == "<svg>" and lines[-1] == "</svg>"
    assert [line.rsplit(" ", 1)[1] for line in lines[1:-1]] == ["40000", "448", "400", "112", "0", "2056192"]
    assert lines[1].startswith(f"stream_0;seg_{address};active_allocated;") and lines[1].endswith(
        f";{here} 40000"
    )
    assert lines[-2] == f"stream_0;seg_{address};inactive;<gaps> 2056192"  # a free block requests 0 B


def test_memory_writes_a_flamegraph_of_the_allocating_lines(run):
    home, _, memory_viz = run
    memory_viz("memory", "snapshot.pickle", "-o", "memory.svg")
    lines = (home / "memory.svg").read_text().splitlines()
    assert lines[1].startswith("stream_0;active_allocated;") and lines[1].endswith(" 40000")
    assert lines[-2] == "stream_0;inactive;<gaps> 2056192"


@pytest.mark.parametrize(
    ("command", "kind"),
    [("trace_plot", "Active Memory Timeline"), ("segment_plot", "Allocator State History")],
)
def test_plots_embed_the_snapshot(run, command, kind):
    home, snapshot, memory_viz = run
    memory_viz(command, "snapshot.pickle", "-o", f"{command}.html")
    html = (home / f"{command}.html").read_text()
    (embedded,) = json.loads(re.search(r"const local_files = (.*)\n", html).group(1))
    assert pickle.loads(base64.b64decode(embedded["base64"])) == snapshot
    assert f"add_local_files(local_files, {kind!r})" in html


def test_compare_names_the_segment_only_in_the_later_snapshot():
    with TensorTracker(history=True) as tracker:
        layer = torch.nn.Linear(100, 100)
        before = tracker.snapshot()
        big = torch.ones(3 * MiB // 4)
        after = tracker.snapshot()
    # compare() takes the segment lists (its command line passes whole snapshots: broken in torch 2.13)
    lines = _memory_viz.compare(before["segments"], after["segments"], format_flamegraph=str).splitlines()
    new = after["segments"][1]
    assert (new["total_size"], layer.weight.nbytes, big.nbytes) == (20 * MiB, 40_000, 3 * MiB)
    assert [line.rsplit(" ", 1)[1] for line in lines] == [str(3 * MiB), "0", str(17 * MiB)]
    assert all(line.startswith(f"only_after;stream_0;seg_{new['address']};") for line in lines)


def _line_of(text: str) -> int:
    source = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if text in line)
