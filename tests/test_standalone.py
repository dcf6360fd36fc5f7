"""The repository stands alone: a clone with nothing beside it has everything its tests and
benchmarks read (``.ci/run`` runs the README's test command in exactly such a clone)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A path into ../shared written in code: "../shared/...", or "shared" as a path part ("..", "shared").
SHARED_PATH = re.compile(r"""["']\.\./shared|["']shared["']""")


def tracked_files() -> list[str]:
    result = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout.split()


def test_no_code_reads_data_from_beside_the_repository():
    readers = [
        path
        for path in tracked_files()
        if (path.endswith((".py", ".sh")) or path.startswith(".ci/")) and path != "tests/test_standalone.py"
        if SHARED_PATH.search((ROOT / path).read_text(encoding="utf-8"))
    ]
    assert readers == []


def test_the_recorded_gpu_traces_are_in_the_repository():
    assert "tests/data/gpu-traces/traces.json" in tracked_files()


def test_ci_runs_the_readme_test_command_in_a_fresh_clone():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'git clone --quiet "$PWD" "$workdir/memlab"' in ci
    assert ci.index("git clone") < ci.index('bash -euo pipefail -c "$test_command"')
