"""memlab's own page of a memory snapshot: escaped, bounded, peaks kept, stacked as asked."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

import memlab
from memlab._units import format_size
from memlab.history.page import BANDS, memory_page
from memlab.history.series import memory_series
from memlab.history.timeline_svg import byte_ticks, event_ticks, sample_events
from tests.page_check import Page, vertices

MiB = 1024 * 1024


def _points(page: str) -> dict[str, list[int]]:
    return json.loads(
        re.search(r'<script type="application/json" id="memlab-points">(.*?)</script>', page).group(1)
    )


@pytest.fixture(scope="module")
def long_run() -> tuple[dict, int, int]:
    """A 100,000-event snapshot of a ``CachingAllocatorModel``: a rolling window of 32 blocks of
    512 B to 32 KiB, and one 64 MiB block allocated and freed at iteration 31,337; the event of
    that allocation and the model's own ``allocated_bytes.all.peak``."""
    model = memlab.CachingAllocatorModel(config="", history=True)
    live: list[int] = []
    for i in range(50_015):  # 50,016 allocations and 49,984 frees
        if i == 31_337:
            model.free(model.malloc(64 * MiB))
        live.append(model.malloc(512 * (1 + i % 64)))
        if len(live) > 32:
            model.free(live.pop(0))
    snapshot = model.history_snapshot()
    counted = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    (spike,) = [i for i, e in enumerate(counted) if e["action"] == "alloc" and e["size"] == 64 * MiB]
    return snapshot, spike, model.memory_stats()["allocated_bytes.all.peak"]


def _events(page: str) -> int:
    return int(re.search(r'data-events="(\d+)"', page).group(1))


def test_a_100k_event_page_draws_at_most_the_points_asked_and_keeps_the_spike(
    long_run: tuple[dict, int, int],
) -> None:
    snapshot, spike, peak = long_run
    page = memory_page(snapshot, points=2000)
    points = _points(page)
    assert _events(page) == 100_000
    assert len(points["events"]) <= 2000
    assert spike in points["events"]
    assert points["allocated"][points["events"].index(spike)] == peak
    assert len(page.encode()) < 300_000
    parsed = Page(page)
    assert parsed.errors == []
    assert f"peak {format_size(peak)} (no Python frame recorded)" in parsed.titles  # a model records no stack
    assert parsed.rows[1][5] == "(no stack recorded)"


def test_the_peak_table_is_capped_at_top_rows_and_sums_the_rest(long_run: tuple[dict, int, int]) -> None:
    snapshot, _, peak = long_run
    rows = Page(memory_page(snapshot, top=5)).rows
    assert len(rows) == 1 + 5 + 1
    assert rows[1][1] == f"64.00M\n{64 * MiB:,} B"
    assert rows[-1][2] == "the other 28 allocations alive at the peak"
    granted = sum(int(row[1].split("\n")[1].removesuffix(" B").replace(",", "")) for row in rows[1:])
    assert granted == peak


def test_sample_events_keeps_each_runs_extremes_and_the_given_peak() -> None:
    allocated = [10] * 1000
    allocated[123], allocated[777] = 99, 1
    reserved = [50] * 1000
    reserved[500] = 70
    events = sample_events(allocated, reserved, 31, keep=900)
    assert len(events) <= 31 and events == sorted(events)
    assert {0, 123, 500, 777, 900, 999} <= set(events)
    assert sample_events(allocated[:31], reserved[:31], 31, keep=3) == list(range(31))


@pytest.mark.parametrize(
    ("top", "ticks"),
    [(0, (1, 1)), (3000, (512, 3072)), (40 * 1024, (8192, 40 * 1024)), (2 * MiB, (512 * 1024, 2 * MiB))],
)
def test_byte_ticks_are_binary_steps_three_to_eight_of_them(top: int, ticks: tuple[int, int]) -> None:
    assert byte_ticks(top) == ticks


def test_event_ticks_are_one_two_five_steps() -> None:
    assert event_ticks(7) == list(range(8))
    assert event_ticks(3861) == list(range(0, 3501, 500))
    assert event_ticks(100_000) == list(range(0, 100_001, 10_000))


def test_a_frame_with_markup_characters_is_escaped_everywhere(tmp_path: Path) -> None:
    weird = f"{tmp_path}/weird <b>&\"'.py"
    namespace = {"torch": torch}
    with memlab.TensorTracker(history=True) as tracker:
        exec(compile("kept = torch.ones(300)\n", weird, "exec"), namespace)
    for stack in ("category", "largest"):
        page = memory_page(tracker.snapshot(), stack=stack, title="<i>run</i> & 'x'")
        parsed = Page(page)
        assert parsed.errors == []
        assert "<b>" not in page and "<i>" not in page
        svg = ElementTree.fromstring(re.search(r"<svg .*?</svg>", page, re.S).group(0))  # well-formed XML too
        assert "peak 1.50K at weird <b>&\"'.py:1" in [title.text for title in svg.iter("title")]
        assert "weird &lt;b&gt;&amp;&quot;&#x27;.py:1" in page
        assert parsed.rows[1][5].split("\n")[0] == f"{weird}:1 in <module>"
        assert "peak 1.50K at weird <b>&\"'.py:1" in parsed.titles
        assert "<title>memlab: &lt;i&gt;run&lt;/i&gt; &amp; &#x27;x&#x27;</title>" in page


def test_stacked_by_the_largest_allocations_each_has_a_band_of_its_own() -> None:
    with memlab.TensorTracker(history=True) as tracker:
        tensors = [torch.ones(256 * (i + 1)) for i in range(BANDS + 2)]  # 1,024 B to 11,264 B
        line = inspect.currentframe().f_lineno - 1
    parsed = Page(memory_page(tracker.snapshot(), stack="largest"))
    bands = [a for t, a in parsed.elements if t == "path" and a.get("class") == "band"]
    titles = parsed.titles[: len(bands)]  # the bands come first in the picture
    sizes = [t.nbytes for t in tensors]
    # painted from the top of the stack down: the last allocation's band first, the rest last
    assert titles == [
        f"{format_size(n)} ({n:,} B, unknown) allocated at event {i}, test_page.py:{line}"
        for i, n in reversed(list(enumerate(sizes)))
        if i >= 2
    ] + ["allocated: every other block"]
    assert len(bands) == BANDS + 1
    plot = parsed.element("rect", **{"class": "plot"})
    axis_top = int(parsed.element("svg")["data-axis-top"])
    bottom, height = float(plot["y"]) + float(plot["height"]), float(plot["height"])
    assert vertices(bands[0]["d"])[-2][1] == round(bottom - height * sum(sizes) / axis_top, 1)
    assert vertices(bands[-1]["d"])[-2][1] == round(bottom - height * (sizes[0] + sizes[1]) / axis_top, 1)


def test_stacked_by_category_the_highest_band_is_the_allocated_line() -> None:
    model = torch.nn.Linear(64, 64)
    with memlab.TensorTracker(history=True) as tracker:
        tracker.add_model(model)
        model(torch.ones(8, 64)).sum().backward()
    snapshot = tracker.snapshot()
    parsed = Page(memory_page(snapshot))
    titles = [t for t in parsed.titles if t.startswith("allocated: ")]
    assert "allocated: gradient" in titles
    assert sorted(titles) == sorted(f"allocated: {name}" for name in memory_series(snapshot).by_category)
    bands = [vertices(a["d"]) for t, a in parsed.elements if t == "path" and a.get("class") == "band"]
    allocated = vertices(parsed.element("path", id="allocated")["d"])
    assert bands[0][1:-1] == allocated


def test_the_first_line_says_how_much_of_the_peak_is_cublas_workspaces() -> None:
    with memlab.TensorTracker(history=True) as tracker:
        a = torch.ones(8, 8)
        b = a @ a
        line = inspect.currentframe().f_lineno - 1
    snapshot = tracker.snapshot()
    workspaces = [
        block["size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["category"] == "workspace"
    ]
    assert len(workspaces) == 1
    peak = sum(_round(t.nbytes) for t in (a, b)) + workspaces[0]
    summary = re.search(r"<p>(Peak .*?)</p>", memory_page(snapshot)).group(1)
    assert summary.startswith(
        f"Peak allocated {format_size(peak)} ({peak:,} B) after event 2 of 3 (at test_page.py:{line}), "
        f"of which {format_size(workspaces[0])} ({workspaces[0]:,} B) in 1 cuBLAS workspace; peak reserved "
    )


def _round(nbytes: int) -> int:
    """The bytes the CUDA caching allocator grants a request: a multiple of 512 B."""
    return -(-nbytes // 512) * 512
