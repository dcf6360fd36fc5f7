"""PyTorch memory snapshots from memlab: the dict of ``torch.cuda.memory._snapshot()`` and its pickle."""

from __future__ import annotations

import json
import pickle
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.cuda import _memory_viz

import memlab
from memlab import TensorTracker
from memlab.history.export import read_snapshot
from memlab.sources.allocator import CachingAllocatorModel

TRACES = Path(__file__).resolve().parents[1] / "data" / "gpu-traces" / "traces.json"
MiB = 1024 * 1024
SEGMENT_KEYS = {
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "segment_pool_id",
    "is_expandable",
    "frames",
    "blocks",
}


def test_a_linear_layer_is_one_small_segment_with_two_blocks_allocated_on_the_tests_line():
    with TensorTracker(history=True) as tracker:
        line = sys._getframe().f_lineno + 1
        layer = torch.nn.Linear(100, 100)
    (segment,) = tracker.snapshot()["segments"]
    assert layer.weight.nbytes == 40_000
    assert set(segment) == SEGMENT_KEYS
    assert (segment["total_size"], segment["segment_type"], segment["stream"], segment["device"]) == (
        2 * MiB,
        "small",
        0,
        0,
    )
    weight, bias, rest = segment["blocks"]
    assert [(b["size"], b["requested_size"], b["state"]) for b in (weight, bias, rest)] == [
        (40_448, 40_000, "active_allocated"),
        (512, 400, "active_allocated"),
        (2 * MiB - 40_960, 0, "inactive"),
    ]
    name = "test_a_linear_layer_is_one_small_segment_with_two_blocks_allocated_on_the_tests_line"
    for block in (weight, bias):
        assert block["frames"][0] == {"filename": __file__, "line": line, "name": name}
        assert block["category"] == "unknown"
    assert (segment["allocated_size"], segment["active_size"], segment["requested_size"]) == (
        40_960,
        40_960,
        40_400,
    )
    assert rest["frames"] == []


def test_a_snapshot_without_history_has_segments_and_an_empty_trace():
    with TensorTracker() as tracker:
        x = torch.ones(100)
    snapshot = tracker.snapshot()
    assert snapshot["device_traces"] == [[]]
    assert next((b["size"], b["frames"]) for s in snapshot["segments"] for b in s["blocks"]) == (512, [])
    del x


def test_trace_entries_have_pytorchs_keys_and_alloc_entries_a_category():
    m = CachingAllocatorModel(config="", history=True)
    m.free(m.malloc(1000))
    trace = m.history_snapshot()["device_traces"][0]
    assert [sorted(e) for e in trace] == [
        ["action", "addr", "frames", "size", "stream", "time_us"],
        ["action", "addr", "category", "frames", "size", "stream", "time_us"],
        ["action", "addr", "frames", "size", "stream", "time_us"],
        ["action", "addr", "frames", "size", "stream", "time_us"],
    ]
    assert trace[1]["category"] == "unknown"


def test_a_snapshot_of_device_index_two_puts_its_trace_third():
    m = CachingAllocatorModel(config="", history=True)
    m.malloc(1000)
    snapshot = m.history_snapshot(device=2)
    assert [len(t) for t in snapshot["device_traces"]] == [0, 0, 2]
    assert snapshot["segments"][0]["device"] == 2


def test_model_snapshot_still_lists_only_the_segments():
    m = CachingAllocatorModel(config="", history=True)
    m.malloc(1000)
    (segment,) = m.snapshot()
    assert "device" not in segment and segment["blocks"][0]["allocated"] is True


@pytest.fixture(scope="module")
def eor_nn_snapshot() -> tuple[dict, CachingAllocatorModel]:
    model = CachingAllocatorModel(config="", history=True)
    live: dict[int, int] = {}
    for event in json.loads(TRACES.read_text())["eor_nn"]["events"]:
        if event[0] == "a":
            live[event[1]] = model.malloc(event[2])
        else:
            model.free(live.pop(event[1]))
    return model.history_snapshot(), model


def test_the_eor_nn_replay_snapshot_has_the_recorded_ten_segments_of_128_mib(eor_nn_snapshot):
    snapshot, model = eor_nn_snapshot
    sizes = Counter(s["total_size"] for s in snapshot["segments"])
    assert sizes == {20 * MiB: 6, 2 * MiB: 4}
    total = sum(s["total_size"] for s in snapshot["segments"])
    assert total == 128 * MiB == model.memory_stats()["reserved_bytes.all.current"]


def test_memory_viz_segsum_reads_the_eor_nn_snapshot(eor_nn_snapshot):
    snapshot, _model = eor_nn_snapshot
    text = _memory_viz.segsum(snapshot)
    assert "segments: 10\n" in text
    assert "total_reserved: 128.0MiB\n" in text
    allocated = sum(b["requested_size"] for s in snapshot["segments"] for b in s["blocks"])
    assert f"total_allocated: {_memory_viz.Bytes(allocated)}\n" in text


def test_memory_viz_trace_reads_every_eor_nn_event(eor_nn_snapshot):
    snapshot, model = eor_nn_snapshot
    events = json.loads(TRACES.read_text())["eor_nn"]["events"]
    trace = snapshot["device_traces"][0]
    counts = Counter(e["action"] for e in trace)
    frees = sum(1 for e in events if e[0] != "a")
    assert counts == {
        "alloc": len(events) - frees,
        "free_requested": frees,
        "free_completed": frees,
        "segment_alloc": model.memory_stats()["num_device_alloc"],
    }
    text = _memory_viz.trace(snapshot)
    assert text.startswith(f"Device 0 ----------------\n{len(trace)} entries\n")


def test_dump_snapshot_writes_a_protocol_4_pickle_of_the_active_tracker(tmp_path):
    path = tmp_path / "snapshot.pickle"
    with TensorTracker(history=True) as tracker:
        x = torch.ones(100)
        memlab.dump_snapshot(path)
    data = path.read_bytes()
    assert data[:2] == b"\x80\x04"
    assert pickle.loads(data) == tracker.snapshot()
    del x


def test_dump_snapshot_without_an_active_tracker_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no TensorTracker is active"):
        memlab.dump_snapshot(tmp_path / "x.pickle")


def test_read_snapshot_reads_what_dump_snapshot_writes(tmp_path, eor_nn_snapshot):
    with TensorTracker(history=True) as tracker:
        layer = torch.nn.Linear(100, 100)
        layer(torch.randn(4, 100)).sum().backward()
    memlab.dump_snapshot(tmp_path / "tracker.pickle", tracker)
    memlab.dump_snapshot(tmp_path / "model.pickle", eor_nn_snapshot[1])
    for name in ("tracker.pickle", "model.pickle"):
        assert read_snapshot(tmp_path / name) == pickle.loads((tmp_path / name).read_bytes())
    assert read_snapshot(tmp_path / "tracker.pickle") == tracker.snapshot()


def test_read_snapshot_reads_what_pytorchs_own_dump_snapshot_writes(tmp_path, monkeypatch):
    # PyTorch's writer (pickle's default protocol) of the values a GPU snapshot holds: dicts, lists,
    # str, int (addresses above 2**63 too), bool, None, float and the segment_pool_id tuples.
    with TensorTracker(history=True) as tracker:
        torch.empty(1000)
    snapshot = tracker.snapshot()
    snapshot["segments"][0]["segment_pool_id"] = (0, 0)
    snapshot["segments"][0]["address"] = 2**64 - 4096
    snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": None, "expandable_segments": False}
    snapshot["external_annotations"] = [{"device": 0, "stage": "START", "name": "step", "time_us": 1.5}]
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snapshot)
    torch.cuda.memory._dump_snapshot(str(tmp_path / "torch.pickle"))
    assert read_snapshot(tmp_path / "torch.pickle") == snapshot
