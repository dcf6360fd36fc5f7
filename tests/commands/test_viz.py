"""``memlab viz``: a snapshot pickle rendered through ``torch.cuda._memory_viz``, errors in one line."""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
from memlab.cli import main
from tests.full_disk import FullDisk


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


def test_viz_help_names_the_host_pytorchs_page_loads_its_viewer_from(capsys: Any) -> None:
    from torch.cuda import _memory_viz

    page = _memory_viz.trace_plot({"segments": [], "device_traces": [[]]})
    (host,) = set(re.findall(r'from "https://([^/"]+)/', page))
    assert host == "cdn.jsdelivr.net"  # torch 2.13: PyTorch's GitHub repository through jsDelivr
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"loads PyTorch's viewer script (MemoryViz.js) from the web, from {host}" in help_text
    assert "pytorch.org" not in help_text


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (None, ["missing.pickle"], "no such snapshot: '{tmp}/missing.pickle'"),
        (b"not a pickle", ["bad.pickle"], "snapshot '{tmp}/bad.pickle' is not a memory snapshot pickle"),
        (
            pickle.dumps({"segments": []}),
            ["bad.pickle"],
            "snapshot '{tmp}/bad.pickle' is not a memory snapshot pickle",
        ),
        ("folder", ["dir.pickle"], "snapshot '{tmp}/dir.pickle' is a folder, not a snapshot pickle"),
        (None, ["x.pickle", "-o", "x.png"], "-o {tmp}/x.png: write to a file ending in .html, .htm"),
        (
            "folder",
            ["x.pickle", "-o", "dir.html"],
            "-o {tmp}/dir.html: is a folder; name a file to write in it",
        ),
        (None, ["x.pickle", "-o", "gone/x.html"], "-o {tmp}/gone/x.html: no such folder '{tmp}/gone'"),
    ],
)
def test_viz_errors_are_one_line(
    tmp_path: Path, capsys: Any, make: bytes | str | None, args: list[str], message: str
) -> None:
    made = args[-1] if make == "folder" else args[0]
    if make == "folder":
        (tmp_path / made).mkdir()
    elif make is not None:
        (tmp_path / made).write_bytes(make)
    paths = [str(tmp_path / a) if a.endswith((".pickle", ".png", ".html")) else a for a in args]
    assert main(["viz", *paths]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    expected = "memlab viz: error: " + message.format(tmp=tmp_path)
    assert line == expected or line.startswith(expected + " (write one with memlab run --snapshot FILE")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux): always full")
def test_viz_says_in_one_line_when_the_page_cannot_be_written(
    snapshot: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any
) -> None:
    path, _ = snapshot
    (tmp_path / "full.html").symlink_to("/dev/full")  # a disk that is full when the page is written
    assert main(["viz", str(path), "-o", str(tmp_path / "full.html")]) == 1
    assert capsys.readouterr().err == (
        f"memlab viz: could not write -o {tmp_path}/full.html: [Errno 28] No space left on device\n"
    )


@pytest.mark.parametrize("option", [["-o", "page.html"], []], ids=["-o", "default output"])
def test_viz_on_a_full_disk_leaves_the_previous_page(
    snapshot: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any, monkeypatch: Any, option: list[str]
) -> None:
    path, _ = snapshot
    page = tmp_path / (option[1] if option else "snapshot.html")
    page.write_text("<p>the previous page</p>\n", encoding="utf-8")
    disk = FullDisk(tmp_path, room=1000).install(monkeypatch)
    assert main(["viz", str(path), *(["-o", str(page)] if option else [])]) == 1
    monkeypatch.undo()
    name = "-o" if option else "default output"
    assert capsys.readouterr().err == (
        f"memlab viz: could not write {name} {page}: [Errno 28] No space left on device\n"
    )
    assert disk.failures[0][1] == 1000  # the page was half written when the disk filled up
    assert sorted(os.listdir(tmp_path)) == sorted(["snapshot.pickle", page.name])
    assert page.read_text(encoding="utf-8") == "<p>the previous page</p>\n"
