"""``memlab viz``: a snapshot pickle drawn by memlab in one self-contained page (no network), or
with ``--viewer pytorch`` rendered through ``torch.cuda._memory_viz``; errors in one line."""

from __future__ import annotations

import base64
import inspect
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda import _memory_viz

import memlab
from memlab.cli import main
from tests.full_disk import FullDisk
from tests.page_check import Page, vertices


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


def test_viz_viewer_pytorch_writes_the_active_memory_timeline(
    snapshot: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, data = snapshot
    assert main(["viz", str(path), "-o", str(tmp_path / "out.html"), "--viewer", "pytorch"]) == 0
    html = (tmp_path / "out.html").read_text()
    assert _embedded(html) == data
    assert "add_local_files(local_files, 'Active Memory Timeline')" in html
    assert html == _memory_viz.trace_plot(data)


def test_viz_segments_defaults_to_the_snapshots_name(snapshot: tuple[Path, dict[str, Any]]) -> None:
    path, data = snapshot
    assert main(["viz", str(path), "--segments"]) == 0  # PyTorch's viewer: only it draws segments
    html = path.with_suffix(".html").read_text()
    assert _embedded(html) == data
    assert "add_local_files(local_files, 'Allocator State History')" in html


def test_viz_help_names_the_host_pytorchs_page_loads_its_viewer_from(capsys: Any) -> None:
    page = _memory_viz.trace_plot({"segments": [], "device_traces": [[]]})
    (host,) = set(re.findall(r'from "https://([^/"]+)/', page))
    assert host == "cdn.jsdelivr.net"  # torch 2.13: PyTorch's GitHub repository through jsDelivr
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"loads PyTorch's viewer script (MemoryViz.js) from the web, from {host}" in help_text
    assert "references nothing outside itself (it opens offline, on a cluster node)" in help_text
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


def _round(nbytes: int) -> int:
    """The bytes the CUDA caching allocator grants a request: a multiple of 512 B."""
    return -(-nbytes // 512) * 512


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """``run.pickle`` of a tracked run (three tensors alive at its peak, the largest freed after
    it), and what torch says of them: bytes of each tensor and the lines that allocated them."""
    with memlab.TensorTracker(history=True) as tracker:
        kept = torch.ones(1000)
        big = torch.ones(25_000)
        big_line = inspect.currentframe().f_lineno - 1
        small = torch.ones(500)
        facts = {"kept": kept.nbytes, "big": big.nbytes, "small": small.nbytes, "big_line": big_line}
        del big
        last = torch.ones(100)
        facts["last"] = last.nbytes
    memlab.dump_snapshot(tmp_path / "run.pickle", tracker)
    return tmp_path / "run.pickle", facts


def test_viz_page_references_nothing_outside_itself_and_parses(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    path, _ = run
    assert main(["viz", str(path), "-o", str(tmp_path / "page.html")]) == 0
    html = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "http" not in html.lower()
    assert "//" not in re.sub(r"<script>.*?</script>", "", html, flags=re.S)  # no protocol-relative URL
    page = Page(html)
    assert page.errors == []
    assert [tag for tag, attrs in page.elements if {"src", "href"} & attrs.keys()] == []
    assert [tag for tag, _ in page.elements if tag in ("link", "img", "iframe", "object", "embed")] == []
    assert "@import" not in html and "url(" not in html and "@font-face" not in html
    assert [attrs for tag, attrs in page.elements if tag == "script"] == [
        {"type": "application/json", "id": "memlab-points"},
        {},
    ]


def test_viz_page_draws_the_peak_of_a_tracked_run_at_its_event_and_bytes(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    path, facts = run
    assert main(["viz", str(path), "-o", str(tmp_path / "page.html")]) == 0
    page = Page((tmp_path / "page.html").read_text(encoding="utf-8"))
    svg = page.element("svg")
    plot = page.element("rect", **{"class": "plot"})
    left, top = float(plot["x"]), float(plot["y"])
    width, height = float(plot["width"]), float(plot["height"])
    events, axis_top = int(svg["data-events"]), int(svg["data-axis-top"])
    # events: alloc kept, alloc big, alloc small (the peak), free big, alloc last
    assert events == 5
    assert axis_top == 2 * 1024 * 1024  # one 2 MiB small segment reserved, the highest value drawn

    def point(event: int, nbytes: int) -> tuple[float, float]:
        return round(left + width * event / events, 1), round(top + height * (1 - nbytes / axis_top), 1)

    peak = _round(facts["kept"]) + _round(facts["big"]) + _round(facts["small"])
    assert peak == 106_496
    allocated = vertices(page.element("path", id="allocated")["d"])
    assert point(2, peak) in allocated
    assert allocated[-1] == (left + width, point(4, peak - _round(facts["big"]) + _round(facts["last"]))[1])
    assert max(allocated, key=lambda p: -p[1]) == point(2, peak)  # nothing drawn higher
    circle = page.element("circle", id="peak")
    assert (float(circle["cx"]), float(circle["cy"])) == point(2, peak)
    assert f"peak 104.00K at test_viz.py:{facts['big_line'] + 2}" in page.titles
    assert vertices(page.element("path", id="reserved")["d"]) == [point(0, axis_top), (left + width, top)]


def test_viz_page_lists_the_largest_allocations_alive_at_the_peak_exactly(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    path, facts = run
    assert main(["viz", str(path), "-o", str(tmp_path / "page.html"), "--top", "2"]) == 0
    page = Page((tmp_path / "page.html").read_text(encoding="utf-8"))
    header, first, second, rest = page.rows
    assert header == ["#", "granted", "requested", "category", "allocated at event", "stack"]
    assert first[:5] == ["1", f"98.00K\n{_round(facts['big']):,} B", f"{facts['big']:,} B", "temporary", "1"]
    assert second[:5] == ["2", f"4.00K\n{_round(facts['kept']):,} B", f"{facts['kept']:,} B", "unknown", "0"]
    assert first[5].split("\n")[0] == f"{__file__}:{facts['big_line']} in run"
    assert rest == ["", f"2.00K\n{_round(facts['small']):,} B", "the other 1 allocations alive at the peak"]


def test_viz_page_is_the_same_bytes_for_the_same_snapshot(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    path, _ = run
    for name in ("one.html", "two.html"):
        assert main(["viz", str(path), "-o", str(tmp_path / name), "--stack", "largest"]) == 0
    assert (tmp_path / "one.html").read_bytes() == (tmp_path / "two.html").read_bytes()


def test_viz_segments_with_viewer_memlab_is_one_line(
    snapshot: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    path, _ = snapshot
    assert main(["viz", str(path), "--segments", "--viewer", "memlab"]) == 2
    assert capsys.readouterr().err == (
        "memlab viz: error: --segments draws PyTorch's Allocator State History, which only --viewer pytorch "
        "draws (its page loads PyTorch's viewer from the web); memlab's page draws the timeline\n"
    )
    assert not path.with_suffix(".html").exists()
