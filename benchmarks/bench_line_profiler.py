"""Benchmarks of memlab's line profiler (issue 3), against a do-nothing tracer and pytorch_memlab.

Run: ``python benchmarks/bench_line_profiler.py`` (CPU only; ``pip install --no-deps pytorch_memlab``
adds the pytorch_memlab comparisons). It measures:

1. full speed outside profiled code: a plain loop plus call-heavy code, run while ``@memlab.profile``
   functions are registered (and have run), against the same code before memlab was used
   (target: ratio at most 1.05); pytorch_memlab's ratio, whose tracer stays on, for contrast;
2. cost per profiled line event with the tracker source, against a ``sys.settrace`` callback that
   does nothing (target: at most 8x) and against pytorch_memlab's per-event work fed the same
   statistics by the same tracker (target: at most 1/5);
3. growth of the profiler's own memory over 1,000,000 profiled line events (target: under 1 MiB);
4. cost per profiled call of adopting the tensors that exist: the first call walks ``gc`` (in
   proportion to the objects alive), later calls only what their arguments, globals and callers' locals
   hold (no target: recorded).

pytorch_memlab only traces when CUDA is available; here ``torch.cuda``'s statistics functions are
replaced by the tracker's inside this process so that it does its per-event work on CPU.
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch

import memlab

REPEATS = 7


def best_of(run: Callable[[], Any], repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` runs, in seconds."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


# -- workloads ------------------------------------------------------------------------------------
def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def outside_workload() -> int:
    total = 0
    for i in range(300_000):
        total += i % 7
    return total + fib(22)


def hot(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def takes_batch(batch: list[torch.Tensor]) -> int:
    return len(batch)


def profiled_entry() -> int:
    return 1


def count_line_events(run: Callable[[], Any], code: Any) -> int:
    """The line (and return) events of ``code``'s frames while ``run`` runs."""
    events = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        if event in ("line", "return"):
            events += 1
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        run()
    finally:
        sys.settrace(None)
    return events


def do_nothing_tracer(code: Any) -> Callable[..., Any]:
    """A ``sys.settrace`` callback that traces the lines of ``code`` and does nothing with them."""

    def local(frame: Any, event: str, arg: Any) -> Any:
        return local

    def trace(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    return trace


def traced(trace: Callable[..., Any], run: Callable[[], Any]) -> Callable[[], Any]:
    def go() -> None:
        sys.settrace(trace)
        try:
            run()
        finally:
            sys.settrace(None)

    return go


# -- pytorch_memlab, fed the tracker's statistics -------------------------------------------------
@contextlib.contextmanager
def pytorch_memlab_on_tracker(tracker: memlab.TensorTracker):
    """Make ``torch.cuda`` report the tracker's statistics so pytorch_memlab traces on CPU."""
    cuda = torch.cuda
    saved = {
        name: getattr(cuda, name)
        for name in (
            "is_available",
            "memory_stats",
            "reset_peak_memory_stats",
            "reset_accumulated_memory_stats",
            "empty_cache",
            "device",
        )
    }
    cuda.is_available = lambda: True
    cuda.memory_stats = lambda device=None: tracker.memory_stats()
    cuda.reset_peak_memory_stats = lambda device=None: tracker.reset_peak_memory_stats()
    cuda.reset_accumulated_memory_stats = lambda device=None: tracker.reset_accumulated_memory_stats()
    cuda.empty_cache = lambda: None
    cuda.device = lambda device: contextlib.nullcontext()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cuda, name, value)


def pytorch_memlab_profiler() -> Any:
    try:
        with contextlib.redirect_stdout(None):
            from pytorch_memlab.line_profiler.line_profiler import LineProfiler
    except ImportError:
        return None
    return LineProfiler


# -- benchmarks -----------------------------------------------------------------------------------
def outside_time(mode: str) -> float:
    """Best time of :func:`outside_workload` in this process after setting up ``mode``: ``plain``
    (memlab imported, never used), ``memlab`` (``@memlab.profile`` functions registered and run
    once) or ``pytorch_memlab`` (its ``@profile`` registered: its tracer stays installed)."""
    outside_workload()
    if mode == "memlab":
        memlab.profile(hot)
        memlab.profile(profiled_entry)()  # a profiled function has run: a session started and ended
        memlab.line_profiler.global_line_profiler().at_exit.clear()  # no exit report here
    elif mode == "pytorch_memlab":
        legacy = pytorch_memlab_profiler()
        tracker = memlab.TensorTracker().__enter__()
        with pytorch_memlab_on_tracker(tracker):
            lp = legacy()
            lp.enable()
            lp.add_function(profiled_entry)
            return best_of(outside_workload)
    return best_of(outside_workload)


def run_outside(mode: str) -> float:
    result = subprocess.run(
        [sys.executable, __file__, "--outside", mode], capture_output=True, text=True, check=True
    )
    return float(result.stdout.split()[-1])


def bench_outside(report: Callable[[str], None]) -> None:
    modes = ["plain", "memlab"] + (["pytorch_memlab"] if pytorch_memlab_profiler() else [])
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(3):  # alternate fresh processes, keep the best of each
        for mode in modes:
            best[mode] = min(best[mode], run_outside(mode))
    plain, ours = best["plain"], best["memlab"]
    report(
        f"1. outside profiled code: no memlab {plain * 1e3:.1f} ms, @memlab.profile registered "
        f"{ours * 1e3:.1f} ms, ratio {ours / plain:.3f} (target <= 1.05)"
    )
    if "pytorch_memlab" in best:
        theirs = best["pytorch_memlab"]
        report(
            f"   pytorch_memlab with @profile registered: {theirs * 1e3:.1f} ms, ratio {theirs / plain:.2f}"
        )


def bench_per_event(report: Callable[[str], None]) -> None:
    n = 200_000
    events = count_line_events(lambda: hot(n), hot.__code__)
    plain = best_of(lambda: hot(n))
    noop = best_of(traced(do_nothing_tracer(hot.__code__), lambda: hot(n)))
    lp = memlab.LineProfiler(hot, source="tracker")
    ours = best_of(lambda: lp.runcall(hot, n))
    with memlab.TensorTracker() as tracker:
        sample = tracker.sampler(lp._records.layout.sample_keys)
        sampler_only = best_of(lambda: [sample() for _ in range(events)])
    per_noop = (noop - plain) / events
    per_ours = (ours - plain) / events
    report(
        f"2. per profiled line event ({events} events): do-nothing tracer {per_noop * 1e9:.0f} ns, "
        f"memlab {per_ours * 1e9:.0f} ns, ratio {per_ours / per_noop:.1f}x (target <= 8x)"
    )
    report(
        f"   of which the tracker's sampler call alone: {sampler_only / events * 1e9:.0f} ns "
        f"({len(lp._records.layout.sample_keys)} keys)"
    )
    legacy = pytorch_memlab_profiler()
    if legacy is None:
        return
    small = 10_000
    small_events = count_line_events(lambda: hot(small), hot.__code__)
    small_plain = best_of(lambda: hot(small))
    with memlab.TensorTracker() as tracker, pytorch_memlab_on_tracker(tracker):

        def run_theirs() -> None:
            theirs_lp = legacy(hot)
            with theirs_lp:
                hot(small)

        theirs = best_of(run_theirs, 3)
    per_theirs = (theirs - small_plain) / small_events
    report(
        f"   pytorch_memlab fed the same statistics: {per_theirs * 1e9:.0f} ns per event; "
        f"memlab / pytorch_memlab = {per_ours / per_theirs:.3f} (target <= 0.2)"
    )


def bench_memory(report: Callable[[str], None]) -> None:
    lp = memlab.LineProfiler(hot, source="tracker")
    lp.runcall(hot, 10)  # rows for every line exist
    n = 500_000
    events = count_line_events(lambda: hot(n), hot.__code__)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    lp.runcall(hot, n)
    gc.collect()
    growth = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    report(
        f"3. memlab's own memory growth over {events} profiled line events: {growth} B "
        f"(target < 1 MiB = {1 << 20} B)"
    )
    legacy = pytorch_memlab_profiler()
    if legacy is None:
        return
    small = 5_000
    small_events = count_line_events(lambda: hot(small), hot.__code__)
    with memlab.TensorTracker() as tracker, pytorch_memlab_on_tracker(tracker):
        theirs_lp = legacy(hot)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        with theirs_lp:
            hot(small)
        growth = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    report(
        f"   pytorch_memlab: {growth} B over {small_events} events, i.e. "
        f"{growth / small_events * 1e6 / (1 << 20):.0f} MiB per 1,000,000 events"
    )


def bench_adoption(report: Callable[[str], None]) -> None:
    batch = [torch.empty(256) for _ in range(8)]
    objects = len(gc.get_objects())
    lp = memlab.LineProfiler(takes_batch, source="tracker")
    start = time.perf_counter()
    lp.runcall(takes_batch, batch)
    first = time.perf_counter() - start
    plain = best_of(lambda: takes_batch(batch))
    later = best_of(lambda: lp.runcall(takes_batch, batch))
    report(
        f"4. per profiled call with {objects} objects alive: the first adopts what gc reaches in "
        f"{first * 1e3:.1f} ms; later calls, which adopt what their arguments (8 tensors), globals and "
        f"callers' locals hold, cost {(later - plain) * 1e6:.0f} us each"
    )


def main() -> None:
    if sys.argv[1:2] == ["--outside"]:
        with contextlib.redirect_stdout(sys.stderr):
            seconds = outside_time(sys.argv[2])
        print(seconds)
        return

    def report(line: str) -> None:
        print(line, flush=True)

    report(f"Python {sys.version.split()[0]}, torch {torch.__version__}, memlab {memlab.__version__}")
    bench_outside(report)
    bench_per_event(report)
    bench_memory(report)
    bench_adoption(report)


if __name__ == "__main__":
    main()
