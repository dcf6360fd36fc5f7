"""Profiling under threads: a profiled function called from several threads at once raises nothing,
leaves nothing installed, and counts every thread's tensors, also those of threads it starts."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memlab
from memlab.sources.tracker import active_tracker

U8 = torch.uint8
COLUMNS = ("allocated_bytes.all.allocated",)


def overlapping_calls(work: Callable[[int, Callable[[], object]], int], main_leaves_first: bool) -> list[Any]:
    """Call ``work`` in the main thread and in a thread started before, their calls overlapping:
    the main thread's call starts first; the one that leaves first is chosen. Returns what each
    call returned or raised, main thread first."""
    go, inside, release = threading.Event(), threading.Event(), threading.Event()
    outcome: list[Any] = [None, None]

    def other() -> None:
        go.wait()
        try:
            outcome[1] = work(3000, lambda: (inside.set(), release.wait()))
        except BaseException as error:  # what the user's thread would see
            outcome[1] = error

    def main_waits() -> None:
        go.set()
        inside.wait()
        if not main_leaves_first:
            release.set()
            thread.join()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        outcome[0] = work(1000, main_waits)
    except BaseException as error:
        outcome[0] = error
    release.set()
    thread.join()
    return outcome


def nothing_left_installed() -> None:
    assert _get_current_dispatch_mode_stack() == [] and active_tracker() is None
    assert sys.gettrace() is None and threading.gettrace() is None and threading.getprofile() is None


def work_body(n: int, wait: Callable[[], object]) -> int:
    block = torch.empty(n, dtype=U8)
    wait()
    return block.numel()


def test_two_threads_in_one_profiled_function_raise_nothing_and_leave_nothing(rows):
    for main_leaves_first in (True, False):
        lp = memlab.LineProfiler(columns=COLUMNS)
        work = lp(work_body)
        assert overlapping_calls(work, main_leaves_first) == [1000, 3000]
        nothing_left_installed()
        # Both threads counted, through the profiler's own tracker (CUDA model: 512 B blocks).
        # The threads share one sampling window: the other thread's block is also inside the
        # main thread's wait() line.
        assert rows(lp, work_body, ("hits", *COLUMNS)) == [
            ("def work_body(n: int, wait: Callable[[], object]) -> int:", 2, 0),
            ("block = torch.empty(n, dtype=U8)", 2, 1024 + 3072),
            ("wait()", 2, 3072),
            ("return block.numel()", 2, 0),
        ]


def test_the_profile_decorator_is_safe_in_two_threads_at_once(global_profiler):
    work = memlab.profile(work_body)
    assert overlapping_calls(work, main_leaves_first=True) == [1000, 3000]
    nothing_left_installed()
    frame = global_profiler.to_dataframe(work_body, ("hits", "active_bytes.all.peak"))
    assert frame["hits"].tolist() == [2, 2, 2, 2]
    assert frame["active_bytes.all.peak"].tolist()[2] == 1024 + 3072  # both blocks held at once


def release(go: threading.Event, thread: threading.Thread) -> None:
    go.set()
    thread.join()


def spawn_and_wait(n: int) -> int:
    held: list[torch.Tensor] = []
    go = threading.Event()
    thread = threading.Thread(target=lambda: (go.wait(), held.append(torch.empty(n, dtype=U8))))
    thread.start()
    release(go, thread)  # the thread allocates in here, never before
    return held[0].numel()


def test_tensors_of_a_thread_the_profiled_function_starts_are_counted(rows):
    lp = memlab.LineProfiler(spawn_and_wait, columns=COLUMNS)
    with lp:
        assert spawn_and_wait(2**20) == 2**20
    nothing_left_installed()
    assert rows(lp, spawn_and_wait, COLUMNS)[1:] == [
        ("held: list[torch.Tensor] = []", 0),
        ("go = threading.Event()", 0),
        ("thread = threading.Thread(target=lambda: (go.wait(), held.append(torch.empty(n, dtype=U8))))", 0),
        ("thread.start()", 0),
        ("release(go, thread)  # the thread allocates in here, never before", 2**20),
        ("return held[0].numel()", 0),
    ]


def test_threads_already_running_are_named_in_the_source_line():
    stop = threading.Event()
    pool = threading.Thread(target=stop.wait, name="ThreadPoolExecutor-0_0")
    pool.start()
    try:
        lp = memlab.LineProfiler(work_body, target_gpu="cpu")
        with lp:
            work_body(10, lambda: None)
    finally:
        stop.set()
        pool.join()
    assert lp.source_line() == (
        "modelled: CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); no tensors "
        "existed before profiling; ops of threads already running when counting began are not "
        "counted (ThreadPoolExecutor-0_0)"
    )


def staggered_calls(work: Callable[[int, Callable[[], object]], int], first_to_leave: str) -> dict[str, Any]:
    """Call ``work`` in two threads, A and B, B started while A's call runs (so B starts while the
    tracker is active), their calls overlapping: A starts, B starts, then ``first_to_leave`` ("A"
    or "B") returns first, then the other. Returns per thread what its call returned and, read in
    that thread once both calls returned, the length of its dispatch mode stack (C++ and Python)."""
    inside = {name: threading.Event() for name in "AB"}
    leave = {name: threading.Event() for name in "AB"}
    left = {name: threading.Event() for name in "AB"}
    both_left = threading.Barrier(2)
    seen: dict[str, Any] = {}

    def thread_body(name: str, size: int) -> None:
        seen[name] = work(size, lambda: (inside[name].set(), leave[name].wait()))
        left[name].set()
        both_left.wait()
        seen[f"{name} stack"] = (torch._C._len_torch_dispatch_stack(), _get_current_dispatch_mode_stack())

    threads = {
        name: threading.Thread(target=thread_body, args=(name, size))
        for name, size in (("A", 1000), ("B", 3000))
    }
    threads["A"].start()
    inside["A"].wait()
    threads["B"].start()
    inside["B"].wait()
    second = "B" if first_to_leave == "A" else "A"
    leave[first_to_leave].set()
    left[first_to_leave].wait()
    leave[second].set()
    for thread in threads.values():
        thread.join()
    return seen


def test_calls_that_overlap_in_threads_leave_no_mode_on_any_thread_in_either_order(rows):
    for first_to_leave in ("A", "B"):  # A starts, B starts, A ends, B ends; and B ends before A
        lp = memlab.LineProfiler(columns=COLUMNS)
        work = lp(work_body)
        assert staggered_calls(work, first_to_leave) == {
            "A": 1000,
            "B": 3000,
            "A stack": (0, []),
            "B stack": (0, []),
        }
        nothing_left_installed()
        assert rows(lp, work_body, ("hits", *COLUMNS)) == [  # both threads counted (512 B blocks)
            ("def work_body(n: int, wait: Callable[[], object]) -> int:", 2, 0),
            ("block = torch.empty(n, dtype=U8)", 2, 1024 + 3072),
            ("wait()", 2, 3072),  # B allocates during A's wait
            ("return block.numel()", 2, 0),
        ]
