"""The replay of a trace: ``peak_by_category`` (what ``by_category(at="peak")`` reads from a
history's columns) against ``memory_series`` of the snapshot (what ``plot_memory`` draws)."""

from __future__ import annotations

from typing import Any

import torch

import memlab
from memlab.history.series import memory_series, peak_by_category
from memlab.sources.allocator.snapshot import allocator_snapshot

MiB = 1024 * 1024


def at_peak(snapshot: dict[str, Any]) -> dict[str, int]:
    series = memory_series(snapshot)
    return {name: values[series.peak] for name, values in series.by_category.items() if values[series.peak]}


def columns(trace: list[dict[str, Any]]) -> list[tuple[str, int, int, str]]:
    return [(e["action"], e.get("addr", 0), e["size"], e.get("category", "unknown")) for e in trace]


def test_the_peak_by_category_of_a_trace_is_the_series_value_at_its_peak():
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB},
        {"action": "alloc", "addr": 0, "size": 40_000, "category": "parameter"},
        {"action": "alloc", "addr": 40_448, "size": 400, "category": "activation"},
        {"action": "free_requested", "addr": 0, "size": 40_000},
        {"action": "free_completed", "addr": 0, "size": 40_000},
        {"action": "alloc", "addr": 0, "size": 30_000, "category": "gradient"},
    ]
    # 40_448 + 512 before the free is the peak; 30_208 + 512 after it is lower
    assert peak_by_category(columns(trace)) == {"parameter": 40_448, "activation": 512}
    assert at_peak({"device_traces": [trace]}) == {"parameter": 40_448, "activation": 512}


def test_the_first_of_equal_peaks_counts_and_a_trace_without_allocations_has_none():
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB},
        {"action": "alloc", "addr": 0, "size": 512, "category": "activation"},
        {"action": "free_completed", "addr": 0, "size": 512},
        {"action": "alloc", "addr": 0, "size": 512, "category": "gradient"},
    ]
    assert peak_by_category(columns(trace)) == {"activation": 512}
    assert peak_by_category(columns(trace[:1])) == {}


def test_a_training_steps_peak_from_the_history_equals_the_peak_of_its_snapshot():
    with memlab.TensorTracker(history=True) as tracker:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.add_model(model)
        tracker.add_optimizer(optimizer)
        for _ in range(2):
            model(torch.randn(300, 64)).relu().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        big = torch.empty(6 * MiB)  # a large segment of its own, then given back
        del big
        tracker.empty_cache()
    tracker._categorise_known()
    (allocator,) = tracker._allocators.values()
    snapshot = allocator_snapshot(allocator)
    entries = [(a, addr, size, name) for a, addr, size, _, _, name in allocator.history.entries()]
    assert {a for a, *_ in entries} >= {"alloc", "free_completed", "segment_alloc", "segment_free"}
    expected = at_peak(snapshot)
    assert {name: n for name, n in peak_by_category(entries).items() if n} == expected
    # the 6 Mi floats freed without a category, and the parameters' 512-byte blocks
    assert (expected["temporary"], expected["parameter"]) == (24 * MiB, 65_536 + 1_024 + 10_240 + 512)
    assert sum(expected.values()) == tracker.max_memory_allocated()
    assert {**dict.fromkeys(memlab.history.categories.CATEGORIES, 0), **expected} == tracker.by_category(
        at="peak"
    )
