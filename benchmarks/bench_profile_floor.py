"""What ``@memlab.profile`` costs over the code it profiles (issue 27, rows 3 and 5).

Run: ``PYTHONPATH=. python benchmarks/bench_profile_floor.py [3] [3b] [3c] [5]`` from the checkout's root
(CPU only; the header names the memlab imported). Every number is a ratio of CPU times
(``time.process_time``) measured in this process with one torch thread, the median of
:data:`REPEATS` runs; each measure runs twice, its variants interleaved run by run so that load
drift hits both sides. The load average is printed: on a shared machine only the ratios count.

Row 3: a loop of 10,000 tiny tensor ops (``a + b`` on 4-element tensors, each result freed at
once) under ``@memlab.profile`` ÷ the same loop unprofiled (goal <= 5). Beside it, to say where
the time goes: a pass-through ``TorchDispatchMode`` (the floor of any Python mode), the tracker
alone (the ``TensorTracker`` the profiler would enter, entered without tracing), and the tracker
under a global ``sys.settrace`` callback that returns ``None`` for every frame (the floor of any
``sys.settrace`` profiler: one Python call per frame), also marked as memlab's own trace functions
are (the tracker switches it off inside its dispatch: :mod:`memlab.sources.untraced`).

The least any design on these mechanisms costs: a dispatch mode that only counts new storages and
their release (:class:`LeastCounting`: no allocator model, no history), alone and under the least
line tracer Python 3.11's ``sys.settrace`` allows (:func:`least_line_tracer`: a global callback at
every frame's call, a counter at each line of the profiled function). Row 3's goal is under what
that pair costs (README, "How close to the floor").

Row 3b: the same with a small ``nn.Module`` (2 layers, hidden 64) run forward and backward
(no goal: recorded). Row 3c: row 3b inside a tracker that records history and memory per module
(as ``memlab run --by-module`` enters), where memlab's module hooks and saved-tensor hook run
besides the dispatch (no goal: recorded).

Row 5: one profiled line event of a pure-Python loop with the tracker as source ÷ one line event
of a ``sys.settrace`` callback that does nothing (goal <= 4). The tracker's allocator model counts
its changes, so a line event where nothing moved skips the sample
(:mod:`memlab.line_profiler.local_tracer`); "sampling every event" is the same profile with that
switched off, as for a source that cannot say (CUDA's): the cost of those events before, and in
rows 3 and 3b what the count costs on lines that do allocate.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_line_profiler import (  # this folder is on sys.path as a script
    count_line_events,
    do_nothing_tracer,
    traced,
)
from bench_tracker import LeastCounting
from torch.utils._python_dispatch import TorchDispatchMode

import memlab
from memlab.line_profiler import global_line_profiler

try:
    from memlab.sources.untraced import mark_pausable
except ImportError:  # memlab before issue 27 (the "before" numbers): that variant is left out
    mark_pausable = None
try:
    from memlab.line_profiler import local_tracer as _local_tracer
    from memlab.line_profiler.local_tracer import counted as _counted
except ImportError:  # memlab that samples at every line event: that variant is left out
    _counted = None

REPEATS = 7
OPS = 10_000
EVENTS_LOOP = 200_000


# -- workloads ------------------------------------------------------------------------------------
def tiny_ops(a: torch.Tensor, b: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a + b


def module_steps(model: torch.nn.Module, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        model(x).sum().backward()


def hot(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


class PassThrough(TorchDispatchMode):
    """A dispatch mode that only calls the op: the floor of any Python dispatch mode."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def least_line_tracer(code: Any) -> Callable[..., Any]:
    """The least a ``sys.settrace`` line profiler does on Python 3.11: a global callback at every
    frame's call (the only way to reach the profiled frame), and one that counts the line events of
    ``code``'s frames. Each op's Python frames (the mode's handler, ``OpOverload.__call__``, the
    ``torch._disable_dynamo`` wrapper) get the call event too."""
    lines = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        lines[0] += 1
        return local

    def trace(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    return trace


def _none(frame: Any, event: str, arg: Any) -> None:
    return None


def _none_pausable(frame: Any, event: str, arg: Any) -> None:
    return None


if mark_pausable is not None:
    mark_pausable(_none_pausable, True)  # as memlab's own trace function is, when it chains nothing


def sampling_every_event(run: Callable[[], Any]) -> Callable[[], Any]:
    """``run`` with memlab's tracer sampling at every line event, as it does for a source that
    cannot say when nothing moved (CUDA's): the line events where nothing moved cost this before."""

    def go() -> None:
        _local_tracer.counted = lambda sample: None
        try:
            run()
        finally:
            _local_tracer.counted = _counted

    return go


def under(mode_factory: Callable[[], Any], run: Callable[[], Any]) -> Callable[[], Any]:
    def go() -> None:
        with mode_factory():
            run()

    return go


# -- measuring ------------------------------------------------------------------------------------
def medians(variants: dict[str, Callable[[], Any]], repeats: int = REPEATS) -> dict[str, float]:
    """Median CPU seconds of each variant, the variants interleaved run by run."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            gc.collect()
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def load() -> str:
    return "loadavg " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def profiled(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` under ``@memlab.profile``, without the exit report, run once (the first session
    adopts what ``gc`` reaches, which is not what is measured)."""
    wrapper = memlab.profile(func)
    global_line_profiler().at_exit.clear()
    return wrapper


def tracker_like_profile() -> memlab.TensorTracker:
    """The tracker ``@memlab.profile`` enters on a machine without a GPU, already adopted."""
    tracker = memlab.TensorTracker(adopt=True)
    with tracker:
        pass
    return tracker


def bench_ops(
    report: Callable[[str], None],
    label: str,
    func: Callable[..., Any],
    args: tuple,
    tracker: memlab.TensorTracker | None = None,
) -> None:
    """Row 3's measures of ``func(*args)``; with ``tracker``, the profile runs inside it (as under
    ``memlab run``, whose tracker the profiler uses), else in the tracker the profiler enters."""
    wrapper = profiled(func)
    plain = lambda: func(*args)  # noqa: E731
    if tracker is None:
        wrapper(*args)
        tracker = tracker_like_profile()
        profile = lambda: wrapper(*args)  # noqa: E731
    else:
        with tracker:
            wrapper(*args)
        profile = under(lambda: tracker, lambda: wrapper(*args))
    variants = {
        "unprofiled": plain,
        "pass-through mode": under(PassThrough, plain),
        "least counting mode": under(LeastCounting, plain),
        "least counting mode + least line tracer": under(
            LeastCounting, traced(least_line_tracer(func.__code__), plain)
        ),
        "tracker": under(lambda: tracker, plain),
        "tracker + settrace(None-returning)": under(lambda: tracker, traced(_none, plain)),
        "tracker + pausable settrace(None-returning)": under(lambda: tracker, traced(_none_pausable, plain)),
        "@memlab.profile": profile,
    }
    if mark_pausable is None:
        del variants["tracker + pausable settrace(None-returning)"]
    if _counted is not None:
        variants["@memlab.profile sampling every event"] = sampling_every_event(profile)
    for round_ in (1, 2):
        times = medians(variants)
        base = times["unprofiled"]
        ratios = ", ".join(f"{name} {times[name] / base:.2f}" for name in list(variants)[1:])
        report(
            f"{label} round {round_}: unprofiled {base * 1e3:.1f} ms; ÷ unprofiled: {ratios}; "
            f"@memlab.profile ÷ tracker {times['@memlab.profile'] / times['tracker']:.2f}; {load()}"
        )


def bench_row3(report: Callable[[str], None]) -> None:
    a, b = torch.ones(4), torch.ones(4)
    bench_ops(report, f"row 3 ({OPS} tiny ops)", tiny_ops, (a, b, OPS))


def bench_row3b(report: Callable[[str], None]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(4, 64)
    bench_ops(report, "row 3b (200 forward+backward of a 2-layer MLP)", module_steps, (model, x, 200))


def bench_row3c(report: Callable[[str], None]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(4, 64)
    tracker = memlab.TensorTracker(adopt=True, history=True, modules=True)  # memlab run --by-module
    label = "row 3c (row 3b in a tracker with history and modules, as memlab run --by-module)"
    bench_ops(report, label, module_steps, (model, x, 200), tracker)


def bench_row5(report: Callable[[str], None]) -> None:
    n = EVENTS_LOOP
    events = count_line_events(lambda: hot(n), hot.__code__)
    lp = memlab.LineProfiler(hot, source="tracker")
    lp.runcall(hot, 10)
    variants = {
        "plain": lambda: hot(n),
        "do-nothing tracer": traced(do_nothing_tracer(hot.__code__), lambda: hot(n)),
        "memlab": lambda: lp.runcall(hot, n),
    }
    if _counted is not None:
        variants["memlab sampling every event"] = sampling_every_event(lambda: lp.runcall(hot, n))
    for round_ in (1, 2):
        times = medians(variants)
        per_noop = (times["do-nothing tracer"] - times["plain"]) / events
        per_ours = (times["memlab"] - times["plain"]) / events
        every = ""
        if _counted is not None:
            per_every = (times["memlab sampling every event"] - times["plain"]) / events
            every = f" (sampling every event: {per_every * 1e9:.0f} ns, ratio {per_every / per_noop:.2f})"
        report(
            f"row 5 round {round_} ({events} line events): do-nothing tracer {per_noop * 1e9:.0f} ns, "
            f"memlab {per_ours * 1e9:.0f} ns per event, ratio {per_ours / per_noop:.2f}{every}; {load()}"
        )


def main() -> None:
    torch.set_num_threads(1)

    def report(line: str) -> None:
        print(line, flush=True)

    report(
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, memlab from {memlab.__file__}, {load()}"
    )
    only = sys.argv[1:]
    for name, bench in (("3", bench_row3), ("3b", bench_row3b), ("3c", bench_row3c), ("5", bench_row5)):
        if not only or name in only:
            bench(report)


if __name__ == "__main__":
    main()
