"""``memlab viz``: a snapshot pickle rendered through ``torch.cuda._memory_viz``, errors in one line."""

from __future__ import annotations

import base64
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
from memlab.cli import main


@pytest.fixture
def snapshot(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """``snapshot.pickle`` of a Linear layer, and its dict."""
    with memlab.TensorTracker(history=True) as tracker:
        layer = torch.nn.Linear(100, 100)
    memlab.dump_snapshot(tmp_path / "snapshot.pickle", tracker)
    assert layer.weight.nbytes == 40_000
    return tmp_path / "snapshot.pickle", tracker.snapshot()


def _embedded(html: str) -> dict[str, Any]:
    (embedded,) = json.loads(re.search(r"const local_files = (.*)\n", html).group(1))
    return pickle.loads(base64.b64decode(embedded["base64"]))


def test_viz_writes_the_active_memory_timeline(snapshot: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, data = snapshot
    assert main(["viz", str(path), "-o", str(tmp_path / "out.html")]) == 0
    html = (tmp_path / "out.html").read_text()
    assert _embedded(html) == data
    assert "add_local_files(local_files, 'Active Memory Timeline')" in html


def test_viz_segments_defaults_to_the_snapshots_name(snapshot: tuple[Path, dict[str, Any]]) -> None:
    path, data = snapshot
    assert main(["viz", str(path), "--segments"]) == 0
    html = path.with_suffix(".html").read_text()
    assert _embedded(html) == data
    assert "add_local_files(local_files, 'Allocator State History')" in html


def test_viz_help_says_the_page_loads_pytorchs_viewer_from_the_web(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    assert "loads PyTorch's viewer script from the web" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (None, ["missing.pickle"], "no such snapshot: '{tmp}/missing.pickle'"),
        (b"not a pickle", ["bad.pickle"], "'{tmp}/bad.pickle' is not a memory snapshot pickle"),
        (
            pickle.dumps({"segments": []}),
            ["bad.pickle"],
            "'{tmp}/bad.pickle' is not a memory snapshot pickle",
        ),
        (None, ["x.pickle", "-o", "x.png"], "-o {tmp}/x.png: write to a file ending in .html, .htm"),
    ],
)
def test_viz_errors_are_one_line(
    tmp_path: Path, capsys: Any, make: bytes | None, args: list[str], message: str
) -> None:
    if make is not None:
        (tmp_path / args[0]).write_bytes(make)
    assert main(["viz", *(str(tmp_path / a) if a.endswith((".pickle", ".png")) else a for a in args)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    expected = "memlab viz: error: " + message.format(tmp=tmp_path)
    assert line == expected or line.startswith(expected + " (write one with memlab run --snapshot FILE")
