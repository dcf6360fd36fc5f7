"""Plots: a run's memory over its allocator events (``memlab.plot_memory``) and a profiler's
per-line bars (``LineProfiler.plot``), checked through the data the figures hold."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
from memlab.history.plot import binary_size
from memlab.history.series import memory_series

TRACES = Path(__file__).resolve().parents[1] / "data" / "gpu-traces" / "traces.json"
KiB, MiB = 1024, 1024 * 1024
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
U8 = torch.uint8


def replayed_stats(trace: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Allocated and reserved bytes after each malloc/free of ``trace``, replayed through a fresh
    allocator model (not through the plot's own arithmetic)."""
    model = memlab.CachingAllocatorModel(config="", history=True)
    handles: dict[int, int] = {}
    allocated, reserved = [], []
    for entry in trace:
        if entry["action"] == "alloc":
            handles[entry["addr"]] = model.malloc(entry["size"])
        elif entry["action"] == "free_completed":
            model.free(handles.pop(entry["addr"]))
        else:
            continue
        stats = model.memory_stats()
        allocated.append(stats["allocated_bytes.all.current"])
        reserved.append(stats["reserved_bytes.all.current"])
    return allocated, reserved


def lines(figure: Any) -> dict[str, list[int]]:
    (ax,) = figure.axes
    return {line.get_label(): [int(v) for v in line.get_ydata()] for line in ax.get_lines()}


def training_run() -> tuple[memlab.TensorTracker, int]:
    """A small training step under a tracker with history; the line number of the largest tensor."""
    with memlab.TensorTracker(history=True) as tracker:
        model = torch.nn.Linear(1000, 1000)
        loss = model(torch.randn(64, 1000)).relu().sum()
        loss.backward()
        scratch = torch.empty(3_000_000)  # 12 MB: the rest of a 20 MiB segment, not split
        del scratch
        line = sys._getframe().f_lineno + 1
        big = torch.empty(12_000_000)  # 48 MB: a segment of its own
    del model, loss, big
    return tracker, line


def test_plot_memory_writes_a_png(tmp_path):
    tracker, _line = training_run()
    path = tmp_path / "memory.png"
    figure = memlab.plot_memory(tracker, path)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > len(PNG_SIGNATURE)
    assert figure.axes[0].get_title() == (
        "Memory over the run: allocated (stacked by category) and reserved\n"
        "includes 2 modelled cuBLAS workspaces of the H100: 64.00M"  # the step's matmuls, 32 MiB each
    )
    # a snapshot does not name the GPU its tracker modelled
    assert (
        memlab.plot_memory(tracker.snapshot())
        .axes[0]
        .get_title()
        .endswith("\nincludes 2 modelled cuBLAS workspaces: 64.00M")
    )


def test_plotted_lines_are_the_trackers_allocated_and_reserved_bytes_after_each_event():
    tracker, _line = training_run()
    trace = tracker.snapshot()["device_traces"][0]
    allocated, reserved = replayed_stats(trace)
    plotted = lines(memlab.plot_memory(tracker))
    assert plotted == {"allocated": allocated, "reserved": reserved}
    assert len(allocated) == 26  # 24, and the cuBLAS workspaces of forward's and backward's threads
    stats = tracker.memory_stats()
    assert (allocated[-1], reserved[-1]) == (
        stats["allocated_bytes.all.current"],
        stats["reserved_bytes.all.current"],
    )


def test_plotted_lines_of_a_real_gpu_trace_replay_equal_the_models_stats_after_each_event():
    model = memlab.CachingAllocatorModel(config="", history=True)
    live: dict[int, int] = {}
    allocated, reserved = [], []
    for event in json.loads(TRACES.read_text())["eor_nn"]["events"]:
        if event[0] == "a":
            live[event[1]] = model.malloc(event[2])
        else:
            model.free(live.pop(event[1]))
        stats = model.memory_stats()
        allocated.append(stats["allocated_bytes.all.current"])
        reserved.append(stats["reserved_bytes.all.current"])
    plotted = lines(memlab.plot_memory(model.history_snapshot()))
    assert plotted == {"allocated": allocated, "reserved": reserved}
    assert reserved[-1] == 128 * MiB


def test_a_segment_released_by_empty_cache_is_an_event_of_its_own():
    model = memlab.CachingAllocatorModel(config="", history=True)
    model.free(model.malloc(1000))
    model.empty_cache()
    plotted = lines(memlab.plot_memory(model.history_snapshot()))
    assert plotted == {"allocated": [1024, 0, 0], "reserved": [2 * MiB, 2 * MiB, 0]}


def test_a_pickled_snapshot_plots_the_same_lines(tmp_path):
    tracker, _line = training_run()
    memlab.dump_snapshot(tmp_path / "run.pickle", tracker)
    snapshot = pickle.loads((tmp_path / "run.pickle").read_bytes())
    assert lines(memlab.plot_memory(snapshot)) == lines(memlab.plot_memory(tracker))


def test_the_path_of_a_snapshot_pickle_plots_the_same_lines(tmp_path):
    tracker, _line = training_run()
    memlab.dump_snapshot(tmp_path / "run.pickle", tracker)
    expected = lines(memlab.plot_memory(tracker))
    assert lines(memlab.plot_memory(tmp_path / "run.pickle")) == expected
    assert lines(memlab.plot_memory(str(tmp_path / "run.pickle"), tmp_path / "run.png")) == expected
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (None, FileNotFoundError, "no such snapshot: '{path}'"),
        (b"a,b\n1,2\n", ValueError, "source '{path}' is not a memory snapshot pickle (write one with memlab"),
        (pickle.dumps([1, 2]), ValueError, "source '{path}' is not a memory snapshot pickle (write one with"),
    ],
)
def test_a_path_that_holds_no_snapshot_is_named(tmp_path, make, error, message):
    path = tmp_path / "run.pickle"
    if make is not None:
        path.write_bytes(make)
    with pytest.raises(error) as raised:
        memlab.plot_memory(path)
    assert str(raised.value).startswith(message.format(path=path))


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("gone/run.png", ValueError, "path {tmp}/gone/run.png: no such folder '{tmp}/gone'"),
        ("", ValueError, "path {tmp}: is a folder; name a file to write in it"),
        (5, TypeError, "path must be a file path (a str or os.PathLike), got int 5"),
    ],
)
def test_where_a_plot_goes_is_checked_before_it_is_drawn(tmp_path, monkeypatch, path, error, message):
    tracker, _line = training_run()
    drawn = []
    monkeypatch.setattr("memlab.history.plot.memory_series", lambda *a: drawn.append(a))
    target = path if isinstance(path, int) else str(tmp_path / path) if path else str(tmp_path)
    with pytest.raises(error) as raised:
        memlab.plot_memory(tracker, target)
    assert str(raised.value) == message.format(tmp=tmp_path)
    lp = memlab.LineProfiler(allocate_two)
    with memlab.TensorTracker(allocator=None), lp:
        allocate_two(10)
    with pytest.raises(error) as raised:
        lp.plot(path=target)
    assert str(raised.value) == message.format(tmp=tmp_path)
    assert drawn == []


def test_the_peak_is_marked_with_the_file_and_line_that_allocated_it():
    tracker, line = training_run()
    (ax,) = memlab.plot_memory(tracker).axes
    (annotation,) = ax.texts
    peak = max(lines(ax.figure)["allocated"])
    assert peak == 56_243_712 + 2 * 32 * MiB  # and the two 32 MiB cuBLAS workspaces of an H100
    assert annotation.get_text() == f"peak 117.64 MiB at test_plot.py:{line}"
    assert annotation.xy == (19, peak)


def test_the_cublas_workspaces_are_a_category_of_their_own():
    tracker, _line = training_run()
    (ax,) = memlab.plot_memory(tracker).axes
    _handles, labels = ax.get_legend_handles_labels()
    stacked = ["allocated: workspace", "allocated: temporary", "allocated: activation"]
    assert labels == [*stacked, "reserved", "allocated"]


def test_allocated_bytes_are_stacked_by_each_entrys_category():
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB},
        {"action": "alloc", "addr": 0, "size": 40_000, "category": "parameter", "frames": []},
        {"action": "alloc", "addr": 40_448, "size": 400, "category": "activation", "frames": []},
        {"action": "free_requested", "addr": 0, "size": 40_000},
        {"action": "free_completed", "addr": 0, "size": 40_000},
    ]
    series = memory_series({"segments": [], "device_traces": [trace]})
    assert series.by_category == {"parameter": [40_448, 40_448, 0], "activation": [0, 512, 512]}
    assert series.allocated == [40_448, 40_960, 512]
    assert series.reserved == [2 * MiB] * 3
    (ax,) = memlab.plot_memory({"segments": [], "device_traces": [trace]}).axes
    _handles, labels = ax.get_legend_handles_labels()
    assert labels == ["allocated: parameter", "allocated: activation", "reserved", "allocated"]


def test_a_large_block_takes_the_whole_free_range_when_the_rest_is_one_mib_or_less():
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB},
        {"action": "alloc", "addr": 0, "size": 19 * MiB, "frames": []},
        {"action": "alloc", "addr": 0x10000000, "size": 100, "frames": []},
    ]
    series = memory_series({"device_traces": [trace]})
    assert series.allocated == [20 * MiB, 20 * MiB + 100]
    assert series.by_category == {"unknown": [20 * MiB, 20 * MiB + 100]}
    assert series.peak_frame is None
    (ax,) = memlab.plot_memory({"device_traces": [trace]}).axes
    assert ax.texts[0].get_text() == "peak 20.00 MiB (no Python frame recorded)"


def test_a_trace_cut_short_by_a_ring_buffer_starts_from_zero_and_ignores_unknown_frees():
    model = memlab.CachingAllocatorModel(config="", history=3)
    first = model.malloc(1000)
    model.malloc(2000)
    model.free(first)
    actions = [e["action"] for e in model.history_snapshot()["device_traces"][0]]
    assert actions == ["alloc", "free_requested", "free_completed"]
    plotted = lines(memlab.plot_memory(model.history_snapshot()))
    assert plotted == {"allocated": [2000, 2000], "reserved": [0, 0]}


def test_binary_sizes_use_the_largest_unit_reached():
    assert [binary_size(n) for n in (0, 512, 40_448, 2 * MiB, 3 * 1024 * MiB)] == [
        "0.00 B",
        "512.00 B",
        "39.50 KiB",
        "2.00 MiB",
        "3.00 GiB",
    ]


def test_the_y_axis_is_labelled_in_binary_units():
    model = memlab.CachingAllocatorModel(config="", history=True)
    model.malloc(5 * MiB)
    (ax,) = memlab.plot_memory(model.history_snapshot()).axes
    ax.figure.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if 0 <= t.get_position()[1] <= 20 * MiB]
    assert labels == ["0 MiB", "4 MiB", "8 MiB", "12 MiB", "16 MiB", "20 MiB"]


def test_a_missing_matplotlib_names_the_extra_to_install(monkeypatch):
    model = memlab.CachingAllocatorModel(config="", history=True)
    model.malloc(1000)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"^plotting needs matplotlib, .*: pip install 'memlab\[plot\]'$"):
        memlab.plot_memory(model.history_snapshot())


def test_a_tracker_without_history_is_a_value_error_that_says_how_to_record():
    with memlab.TensorTracker() as tracker:
        x = torch.ones(10)
    with pytest.raises(ValueError, match=r"no trace entries for device 0: .*TensorTracker\(history=True\)"):
        memlab.plot_memory(tracker)
    del x


def test_other_sources_are_a_type_error():
    with pytest.raises(TypeError) as raised:
        memlab.plot_memory([])
    assert str(raised.value) == (
        "source must be a memlab.TensorTracker (entered with history=True), a memory snapshot dict "
        "(tracker.snapshot(), a loaded snapshot pickle) or the path of a snapshot pickle; got list []"
    )


def test_a_snapshot_with_several_traces_needs_a_device():
    entry = {"action": "alloc", "addr": 0, "size": 512}
    snapshot = {"device_traces": [[entry], [entry]]}
    with pytest.raises(ValueError, match=r"traces for devices \[0, 1\]: pass device="):
        memlab.plot_memory(snapshot)
    assert lines(memlab.plot_memory(snapshot, device=1)) == {"allocated": [512], "reserved": [0]}


def allocate_two(n):
    small = torch.empty(n, dtype=U8)
    large = torch.empty(4 * n, dtype=U8)
    return small.numel() + large.numel()


def test_profiler_bars_are_the_recorded_column_per_line(tmp_path):
    lp = memlab.LineProfiler(allocate_two)
    with memlab.TensorTracker(allocator=None), lp:
        allocate_two(1000)
    path = tmp_path / "lines.png"
    figure = lp.plot(path=path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    (ax,) = figure.axes
    heights = [int(bar.get_width()) for bar in ax.patches]
    expected = lp.to_dataframe(columns=["active_bytes.all.peak"])["active_bytes.all.peak"].tolist()
    assert heights == expected == [0, 1000, 5000, 5000]
    assert [t.get_text() for t in ax.texts] == ["0.00 B", "1000.00 B", "4.88 KiB", "4.88 KiB"]
    first = allocate_two.__code__.co_firstlineno
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"allocate_two:{first}: def allocate_two(n):",
        f"allocate_two:{first + 1}: small = torch.empty(n, dtype=U8)",
        f"allocate_two:{first + 2}: large = torch.empty(4 * n, dtype=U8)",
        f"allocate_two:{first + 3}: return small.numel() + large.numel()",
    ]
    assert ax.get_xlabel() == "active_bytes.all.peak (bytes, binary units)"


def test_profiler_plot_of_delta_and_long_code_is_cut():
    lp = memlab.LineProfiler(allocate_two, columns=["allocated_bytes.all.current"])
    with memlab.TensorTracker(allocator=None), lp:
        allocate_two(1000)
    (ax,) = lp.plot(column="delta").axes
    assert [int(bar.get_width()) for bar in ax.patches] == [0, 1000, 4000, 0]
    assert ax.get_yticklabels()[2].get_text().endswith(": large = torch.empty(4 * n, dtype=U8)")


def test_profiler_plot_takes_only_a_statistic_in_bytes():
    lp = memlab.LineProfiler(allocate_two)
    with pytest.raises(ValueError, match=r"'hits' is not a statistic in bytes; valid: 'delta' or a \*_bytes"):
        lp.plot(column="hits")
    with pytest.raises(TypeError, match="column must be one statistic name"):
        lp.plot(column=["active_bytes.all.peak"])
