"""``memlab run`` in a torchrun job: rank-suffixed files, and ``--gather``'s merged table on rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memlab.cli import main
from memlab.commands._command import CommandError
from memlab.commands._ranks import RankEnvironment, rank_environment
from memlab.line_profiler import decorators, read_json

MiB = 1024 * 1024
# Rank r profiles step(r): an (r + 1) MiB tensor; the program closes its process group at the end,
# so --gather opens one of its own.
SCRIPT = """\
import torch
import torch.distributed as dist


def step(rank):
    x = torch.empty((rank + 1) * 1024 * 1024 // 4)
    return x.sum()


dist.init_process_group("gloo")
step(dist.get_rank())
dist.destroy_process_group()
"""


@pytest.fixture(autouse=True)
def fresh_global_profiler(monkeypatch: Any) -> None:
    monkeypatch.setattr(decorators, "_global", None)


def test_rank_environment_reads_torchruns_variables():
    assert rank_environment({}) is None
    assert rank_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == RankEnvironment(1, 2, 1)
    assert rank_environment({"RANK": "3", "WORLD_SIZE": "4"}) == RankEnvironment(3, 4, 3)
    assert RankEnvironment(1, 2, 1).path("out/table.json") == "out/table.rank1.json"
    assert RankEnvironment(0, 2, 0).path(None) is None
    with pytest.raises(CommandError, match="RANK=2 is not a rank of WORLD_SIZE=2"):
        rank_environment({"RANK": "2", "WORLD_SIZE": "2"})


def test_each_rank_writes_its_own_files(tmp_path: Path, monkeypatch: Any, capsys: Any):
    script = tmp_path / "one.py"
    script.write_text(
        "import torch\n\ndef step():\n    return torch.empty(256)\n\nstep()\n", encoding="utf-8"
    )
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["run", "-f", "step", "-o", str(tmp_path / "out.csv"), str(script)]) == 0
    assert capsys.readouterr().out.startswith("memlab run: rank 1 of 2\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.py", "out.rank1.csv"]


def test_gather_outside_a_torchrun_job_is_a_usage_error(tmp_path: Path, capsys: Any, monkeypatch: Any):
    monkeypatch.delenv("RANK", raising=False)
    script = tmp_path / "one.py"
    script.write_text("pass\n", encoding="utf-8")
    assert main(["run", "--gather", str(script)]) == 2
    assert capsys.readouterr().err == (
        "memlab run: error: --gather merges the ranks of a torchrun job, "
        "but RANK and WORLD_SIZE are not set\n"
    )


def test_torchrun_writes_both_ranks_files_and_the_merged_table(tmp_path: Path):
    (tmp_path / "train.py").write_text(SCRIPT, encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "memlab", "run", "-f", "step", "-o", "out.json", "--gather", "train.py"]
    result = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out.json", "out.rank0.json", "out.rank1.json"]
    for rank in (0, 1):
        frame = read_json(tmp_path / f"out.rank{rank}.json").loc["step"]
        assert frame["active_bytes.all.peak"].tolist() == [0, (rank + 1) * MiB, (rank + 1) * MiB + 512]
    merged = json.loads((tmp_path / "out.json").read_text())
    assert merged["status"] == "2 of 2 ranks reported (0, 1)"
    assert [values["active_bytes.all.peak"] for _, _, _, values in merged["lines"]] == [
        [0, 0],
        [MiB, 2 * MiB],
        [MiB + 512, 2 * MiB + 512],
    ]
    assert "memlab: active_bytes.all.peak across ranks: 2 of 2 ranks reported (0, 1)" in result.stdout
