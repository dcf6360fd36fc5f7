"""Line events where nothing moved skip the sample (local_tracer.py): same numbers, fewer samples."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import memlab
from memlab.sources.allocator import CachingAllocatorModel, ExactAllocator
from memlab.sources.allocator.stats import WINDOW_PEAK

U8 = torch.uint8
RECORDED = ("allocated_bytes.all.peak", "allocated_bytes.all.allocated", "allocated_bytes.all.freed")
EXACT = ("hits", *RECORDED, "delta")


class CountingSampler:
    """A sampler that counts its calls and passes on what the tracker's says about its changes."""

    def __init__(self, sample: Callable[[], tuple[int, ...]], keys: Any, keep_counting: bool) -> None:
        self.sample, self.keys, self.calls = sample, tuple(keys), 0
        if keep_counting:
            self.memlab_changes = sample.memlab_changes  # type: ignore[attr-defined]
            self.memlab_pending = sample.memlab_pending  # type: ignore[attr-defined]
            self.memlab_flush = sample.memlab_flush  # type: ignore[attr-defined]

    def __call__(self) -> tuple[int, ...]:
        self.calls += 1
        return self.sample()


class CountedTracker:
    """``tracker.sampler`` wrapped: each sampler made counts its calls (``made``, in order); without
    ``keep_counting`` they do not say when nothing moved (as CUDA's): sampled at every event."""

    def __init__(self, tracker: memlab.TensorTracker, keep_counting: bool) -> None:
        self.made: list[CountingSampler] = []
        original = tracker.sampler

        def sampler(keys: Any, device: Any = None) -> CountingSampler:
            made = CountingSampler(original(keys, device), keys, keep_counting)
            self.made.append(made)
            return made

        tracker.sampler = sampler  # type: ignore[method-assign]


def allocate_then_loop(n):
    kept = torch.empty(1000, dtype=U8)
    total = 0
    for i in range(n):
        total += i
    del kept
    return total


@pytest.mark.parametrize("keep_counting", [True, False])
def test_pure_python_lines_read_as_sampled_without_a_sample(exact, rows, keep_counting):
    sampled = CountedTracker(exact, keep_counting)
    lp = memlab.LineProfiler(allocate_then_loop, columns=RECORDED)
    with lp:
        assert allocate_then_loop(3) == 3
    assert rows(lp, allocate_then_loop, EXACT) == [
        ("def allocate_then_loop(n):", 1, 0, 0, 0, 0),
        ("kept = torch.empty(1000, dtype=U8)", 1, 1000, 1000, 0, 1000),
        ("total = 0", 1, 1000, 0, 0, 0),
        ("for i in range(n):", 4, 1000, 0, 0, 0),
        ("total += i", 3, 1000, 0, 0, 0),
        ("del kept", 1, 1000, 0, 1000, -1000),  # the release is queued by a weak reference
        ("return total", 1, 0, 0, 0, 0),
    ]
    (line_sampler,) = [made for made in sampled.made if "allocated_bytes.all.allocated" in made.keys]
    (entry_sampler,) = [made for made in sampled.made if made is not line_sampler]
    # 11 line events and a return, and the sample at the call. Counted, only: the call; the event
    # that ends "kept = ..." (an allocation); "return total" (the release queued at "del kept").
    # The entry sampler reads the current values behind the peaks at the call, for the def row.
    assert (line_sampler.calls, entry_sampler.calls) == ((3, 1) if keep_counting else (13, 1))


def posts_nothing():
    return 7


def holds_while_calling():
    kept = torch.empty(3000, dtype=U8)
    value = posts_nothing()
    temporary = torch.empty(500, dtype=U8)
    value += posts_nothing()
    del temporary, kept
    return value


def test_a_profiled_callee_that_allocates_nothing_still_shows_what_its_caller_holds(exact, rows):
    lp = memlab.LineProfiler(holds_while_calling, posts_nothing, columns=RECORDED)
    with lp:
        assert holds_while_calling() == 14
    assert rows(lp, holds_while_calling, EXACT) == [
        ("def holds_while_calling():", 1, 0, 0, 0, 0),
        ("kept = torch.empty(3000, dtype=U8)", 1, 3000, 3000, 0, 3000),
        ("value = posts_nothing()", 1, 3000, 0, 0, 0),
        ("temporary = torch.empty(500, dtype=U8)", 1, 3500, 500, 0, 500),
        ("value += posts_nothing()", 1, 3500, 0, 0, 0),
        ("del temporary, kept", 1, 3500, 0, 3500, -3500),
        ("return value", 1, 0, 0, 0, 0),
    ]
    assert rows(lp, posts_nothing, EXACT) == [
        ("def posts_nothing():", 2, 3500, 0, 0, 0),  # the peak at entry: what was held then
        ("return 7", 2, 3500, 0, 0, 0),
    ]


# -- the same tables as sampling every event ----------------------------------------------------
COLUMNS = (
    "hits",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "inactive_split_bytes.all.peak",
    "allocated_bytes.all.allocated",
    "allocated_bytes.all.freed",
    "reserved_bytes.all.current",
    "segment.all.current",
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_ooms",
    "delta",
)


def blocks(sizes):
    for size in sizes:
        block = torch.empty(size, dtype=U8)
        yield block.numel()
        del block


def recurse(n):
    page = torch.empty(4096 * (n + 1), dtype=U8)
    label = str(n)
    if n:
        recurse(n - 1)
    return label + str(page.numel() * 0)


class Cycle:
    def __init__(self):
        self.me = self
        self.payload = torch.empty(700_000, dtype=U8)


def workload(tracker, model, x):
    kept = torch.empty(3 << 20, dtype=U8)
    names = [str(i) for i in range(20)]
    total = sum(blocks([100, 300_000, 5]))
    recurse(3)
    model(x).sum().backward()
    steps = 0
    for name in names:
        steps += len(name)
    Cycle()
    unreachable = gc.collect()
    kept = torch.empty(1 << 20, dtype=U8)
    tracker.empty_cache()
    try:
        torch.empty(200 << 20, dtype=U8)
    except torch.OutOfMemoryError:
        steps += 1
    tracker.reset_accumulated_memory_stats()
    del kept
    return total + steps + unreachable * 0


def _tables(rows: Any, keep_counting: bool) -> tuple[list[Any], int]:
    """The line tables of the workload's functions and the tracker's table by module, and how
    many times the line profiler sampled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 64)
    gc.collect()
    with memlab.TensorTracker(capacity="96 MiB", modules=True, model=model) as tracker:
        sampled = CountedTracker(tracker, keep_counting)
        functions = (workload, blocks, recurse)
        lp = memlab.LineProfiler(*functions, columns=COLUMNS[1:-1])
        with lp:
            workload(tracker, model, x)
        by_module = tracker.by_module()
    tables = [rows(lp, function, COLUMNS) for function in functions]
    tables.append([tuple(str(v) for v in row) for row in by_module.itertuples()])
    return tables, sum(made.calls for made in sampled.made if "num_ooms" in made.keys)


def test_the_tables_are_those_of_sampling_at_every_event(rows):
    counted, samples = _tables(rows, keep_counting=True)
    every, every_samples = _tables(rows, keep_counting=False)
    assert counted == every
    assert samples < every_samples / 2
    workload_rows = {row[0]: row[1:] for row in counted[0]}
    # 3 MiB is one block of a new 20 MiB segment; the 200 MiB request fails (num_ooms) after a
    # retry (num_alloc_retries); the loop's lines ran 21 and 20 times
    assert workload_rows["kept = torch.empty(3 << 20, dtype=U8)"][:3] == (1, 3 << 20, 20 << 20)
    assert workload_rows["torch.empty(200 << 20, dtype=U8)"][-3:-1] == (1, 1)
    assert workload_rows["for name in names:"][0] == 21
    assert workload_rows["steps += len(name)"][0] == 20


# -- the count behind it --------------------------------------------------------------------------
def _sampled_state(allocator: Any) -> tuple[Any, ...]:
    """Everything a sampler can read: current, allocated, freed and the window peak of every
    statistic, and the counters (``peak`` itself is never sampled: only its window is)."""
    table = allocator.table
    stats = tuple((s[0], s[2], s[3], s[WINDOW_PEAK]) for s in table.stats.values())
    return stats, tuple(table.counters.items())


ALLOCATORS = {
    "caching": lambda: CachingAllocatorModel(capacity=64 << 20, config=""),
    "expandable": lambda: CachingAllocatorModel(capacity=64 << 20, config="expandable_segments:True"),
    "exact": lambda: ExactAllocator(capacity=64 << 20),
}


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_every_change_a_sampler_can_read_moves_the_allocators_count(kind):
    allocator = ALLOCATORS[kind]()
    handles: list[int] = []

    def malloc(n):
        return lambda: handles.append(allocator.malloc(n))

    def oom():
        with pytest.raises(torch.OutOfMemoryError):
            allocator.malloc(100 << 20)

    steps = [
        malloc(1000),
        malloc(3 << 20),
        malloc(25 << 20),
        lambda: allocator.free(handles.pop(0)),
        malloc(512),
        lambda: allocator.free(handles.pop()),
        allocator.reset_peak_memory_stats,
        oom,
        lambda: allocator.free(handles.pop()),
        allocator.empty_cache,
        allocator.reset_accumulated_memory_stats,
        lambda: allocator.free(handles.pop()),
        allocator.empty_cache,
        allocator.memory_stats,
    ]
    moved = []
    for step in steps:
        state, count = _sampled_state(allocator), allocator.table.changes
        step()
        if _sampled_state(allocator) != state:
            assert allocator.table.changes > count, step
            moved.append(step)
    # everything but the peak reset and the reads changed what a sampler reads (the exact
    # allocator caches nothing: its empty_cache changes nothing)
    assert len(moved) == len(steps) - (4 if kind == "exact" else 2)
