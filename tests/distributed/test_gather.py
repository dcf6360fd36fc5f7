"""Gathering across real processes: gloo on CPU, spawned with torch.multiprocessing.

Each rank profiles ``workers.work(rank)``: a ``(rank + 1)`` MiB tensor, then 256 floats (1 KiB,
a 1 KiB block), so rank 0 peaks at 1 MiB + 1 KiB and rank 1 at 2 MiB + 1 KiB.
"""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import memlab
from memlab.distributed import gather
from tests.distributed.workers import run_rank

MiB = 1024 * 1024
DEADLINE_S = 150


def spawn_ranks(fn, args: tuple, world: int) -> None:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes and wait for all of them, failing the
    test after ``DEADLINE_S`` seconds; no process is left running."""
    context = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish in {DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def run_ranks(tmp_path, world: int, scenario: str) -> tuple[dict, dict, str]:
    spawn_ranks(run_rank, (world, str(tmp_path), scenario), world)
    lines = json.loads((tmp_path / "lines.json").read_text())
    stats = json.loads((tmp_path / "stats.json").read_text())
    return lines, stats, (tmp_path / "lines.txt").read_text()


def test_rank_0_merges_both_ranks_exact_values_and_the_skew(tmp_path):
    lines, stats, text = run_ranks(tmp_path, 2, "all")
    assert lines["status"] == "2 of 2 ranks reported (0, 1)"
    assert lines["columns"] == ["hits", "active_bytes.all.peak", "reserved_bytes.all.peak", "delta"]
    rows = {number: values for _, number, _, values in lines["lines"]}
    first = min(rows)
    assert rows[first + 1]["active_bytes.all.peak"] == [MiB, 2 * MiB]
    assert rows[first + 2]["active_bytes.all.peak"] == [MiB + 1024, 2 * MiB + 1024]
    assert rows[first + 2]["reserved_bytes.all.peak"] == [2 * MiB, 22 * MiB]
    assert rows[first + 1]["hits"] == [1, 1]
    row = next(line for line in text.splitlines() if line.endswith("small = torch.empty(256)"))
    assert row.split()[:8] == [str(first + 2), "1.00M", "2.00M", "2.00M", "(1)", "1.00M", "(0)", "1.00M"]
    # the peak comes at the last line: two sums and their total, three 512 B blocks, on top
    assert [r["stats"]["allocated_peak"] for r in stats["ranks"]] == [MiB + 2560, 2 * MiB + 2560]
    assert rows[first + 3]["active_bytes.all.peak"] == [MiB + 2560, 2 * MiB + 2560]
    assert [r["stats"]["reserved_peak"] for r in stats["ranks"]] == [2 * MiB, 22 * MiB]
    assert all(isinstance(r["stats"]["peak_time_us"], int) for r in stats["ranks"])


def test_a_rank_that_profiled_nothing_and_one_that_raised_do_not_block_the_others(tmp_path):
    lines, stats, text = run_ranks(tmp_path, 3, "idle")
    status = "1 of 3 ranks reported (0); rank 1 profiled nothing; rank 2 failed: RuntimeError: rank 2 failed"
    assert lines["status"] == stats["status"] == status
    assert [r["status"] for r in lines["ranks"]] == ["profiled", "empty", "error"]
    rows = {number: values for _, number, _, values in lines["lines"]}
    assert rows[min(rows) + 2]["active_bytes.all.peak"] == [MiB + 1024, None, None]
    assert text.splitlines()[0] == f"memlab: active_bytes.all.peak across ranks: {status}"
    assert [r["stats"] for r in stats["ranks"]][1:] == [None, None]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
    )
    yield
    dist.destroy_process_group()


def test_gather_on_one_rank_returns_its_own_table(one_rank):
    def step():
        x = torch_empty(MiB // 4)
        return x

    profiler = memlab.LineProfiler(step, target_gpu="cpu", source="tracker")
    with memlab.TensorTracker():
        profiler(step)()
    merged = gather(profiler)
    assert merged.reported == [0] and merged.world_size == 1
    frame = merged.to_dataframe()
    assert list(frame.columns) == ["rank 0", "max", "max_rank", "min", "min_rank", "skew", "code"]
    line = step.__code__.co_firstlineno + 1
    row = frame.loc[("test_gather_on_one_rank_returns_its_own_table.<locals>.step", line)]
    assert row.tolist() == [MiB, MiB, 0, MiB, 0, 0, "        x = torch_empty(MiB // 4)"]


def torch_empty(n: int):
    import torch

    return torch.empty(n)


def test_a_bad_source_takes_part_in_the_gather_then_raises(one_rank):
    with pytest.raises(
        TypeError, match=re.escape("source must be a memlab.LineProfiler, a memlab.TensorTracker or None")
    ):
        gather("profiler")
    # it took part in that collective: the next one pairs with the next call
    assert gather(None).status() == "0 of 1 ranks reported (none); rank 0 profiled nothing"


def test_gather_needs_a_process_group():
    with pytest.raises(ValueError, match=re.escape("call torch.distributed.init_process_group")):
        gather(None)
