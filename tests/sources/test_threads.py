"""A tracker across threads: threads started while it is active count, to the byte; nothing stays."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memlab import TensorTracker
from memlab.sources.select import describe_source
from memlab.sources.threads import follow_new_threads
from memlab.sources.tracker import is_active

U8 = torch.uint8


def run_in_thread(target: Callable[[], object], daemon: bool = False) -> None:
    thread = threading.Thread(target=target, daemon=daemon)
    thread.start()
    thread.join()


def test_a_thread_started_while_tracking_counts_to_the_byte():
    held: list[torch.Tensor] = []
    with TensorTracker(allocator=None) as tracker:
        run_in_thread(lambda: held.append(torch.empty(1000, dtype=U8)))
        run_in_thread(lambda: held.append(torch.empty(24, dtype=U8)))
        assert tracker.memory_allocated("cpu") == 1024
        held.pop()
        assert (tracker.memory_allocated("cpu"), tracker.max_memory_allocated("cpu")) == (1000, 1024)
    assert threading.getprofile() is None and _get_current_dispatch_mode_stack() == []


def test_a_thread_that_outlives_the_tracker_counts_only_while_it_is_active():
    jobs: queue.Queue[int | None] = queue.Queue()
    made: queue.Queue[torch.Tensor] = queue.Queue()

    def worker() -> None:
        while (size := jobs.get()) is not None:
            made.put(torch.empty(size, dtype=U8))

    def allocated(tracker: TensorTracker) -> int:
        return tracker.memory_stats("cpu")["allocated_bytes.all.allocated"]

    tracker = TensorTracker(allocator=None)
    with tracker:
        thread = threading.Thread(target=worker)
        thread.start()
        jobs.put(100)
        kept = [made.get()]
        assert allocated(tracker) == 100
    jobs.put(200)
    kept.append(made.get())
    assert allocated(tracker) == 100  # passed through: the tracker was not active
    with tracker:
        jobs.put(300)
        kept.append(made.get())
        assert allocated(tracker) == 400
    jobs.put(None)
    thread.join()
    assert [t.numel() for t in kept] == [100, 200, 300] and threading.getprofile() is None


def test_threads_allocating_at_once_add_up_exactly():
    sizes = [[1 + thread * 1000 + i for i in range(150)] for thread in range(6)]
    kept: list[list[torch.Tensor]] = [[] for _ in sizes]
    start = threading.Barrier(len(sizes))

    def work(index: int) -> None:
        start.wait()
        for size in sizes[index]:
            kept[index].append(torch.empty(size, dtype=U8))
            torch.empty(size, dtype=U8)  # freed at once

    with TensorTracker(allocator=None) as tracker:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sizes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = tracker.memory_stats("cpu")
    total = sum(map(sum, sizes))
    assert stats["allocated_bytes.all.allocated"] == 2 * total
    assert (stats["allocated_bytes.all.freed"], stats["allocated_bytes.all.current"]) == (total, total)
    assert stats["allocation.all.allocated"] == 2 * 150 * len(sizes)


def test_nested_trackers_are_both_entered_in_a_new_thread():
    held: list[torch.Tensor] = []
    with TensorTracker(allocator=None) as outer, TensorTracker(allocator=None) as inner:
        run_in_thread(lambda: held.append(torch.empty(512, dtype=U8)))
    assert (outer.memory_allocated("cpu"), inner.memory_allocated("cpu")) == (512, 512)


def test_a_tracker_exits_only_in_a_thread_that_entered_it():
    tracker = TensorTracker(allocator=None)
    errors: list[str] = []

    def exit_here() -> None:
        try:
            tracker.__exit__(None, None, None)
        except RuntimeError as error:
            errors.append(str(error))

    with tracker:
        run_in_thread(exit_here)
        assert is_active(tracker) and _get_current_dispatch_mode_stack() == [tracker]
    assert errors == [
        "TensorTracker.__exit__ in a thread that did not enter it: a dispatch mode belongs to the "
        "thread that entered it, so each thread exits its own entries"
    ]
    assert not is_active(tracker) and _get_current_dispatch_mode_stack() == []


def test_entered_in_two_threads_each_exits_its_own_entry():
    tracker = TensorTracker(allocator=None)
    inside, leave = threading.Event(), threading.Event()
    held: list[torch.Tensor] = []

    def other() -> None:
        with tracker:
            held.append(torch.empty(300, dtype=U8))
            inside.set()
            leave.wait()
        held.append(torch.empty(5, dtype=U8))  # exited in this thread: not counted

    thread = threading.Thread(target=other)  # started before the tracker is active
    thread.start()
    inside.wait()
    with tracker:
        held.append(torch.empty(700, dtype=U8))
    assert is_active(tracker)  # still entered in the other thread
    leave.set()
    thread.join()
    assert not is_active(tracker) and tracker.memory_allocated("cpu") == 1000
    assert threading.getprofile() is None and _get_current_dispatch_mode_stack() == []


def test_running_threads_it_cannot_count_are_named_in_the_source_line():
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="pool-worker-0")
    service = threading.Thread(target=stop.wait, name="heartbeat", daemon=True)
    helper.start()
    service.start()
    try:
        with TensorTracker(allocator=None) as tracker:
            pass
    finally:
        stop.set()
        helper.join()
        service.join()
    assert list(tracker.threads_not_counted.values()) == ["pool-worker-0"]
    assert describe_source(tracker, torch.device("cpu")) == (
        "modelled: exact bytes of cpu tensors (memlab.TensorTracker(allocator=None)); tensors made "
        "before the tracker was entered are not counted; ops of threads already running when "
        "counting began are not counted (pool-worker-0)"
    )


def test_following_new_threads_is_installed_only_while_asked_and_keeps_other_hooks():
    seen: list[str] = []

    def tool(frame: object, event: str, arg: object) -> None:
        seen.append("tool")

    threading.setprofile(tool)
    try:
        stop = follow_new_threads(lambda: seen.append("entered"))
        run_in_thread(lambda: None)
        stop()
        assert seen[:2] == ["entered", "tool"]  # the thread then has the tool's profile function
        assert threading.getprofile() is tool
        seen.clear()
        run_in_thread(lambda: None)
        assert "entered" not in seen
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]


def test_a_callback_that_fails_does_not_stop_the_thread():
    ran: list[int] = []

    def broken() -> None:
        raise RuntimeError("no")

    stop = follow_new_threads(broken)
    try:
        run_in_thread(lambda: ran.append(1))
    finally:
        stop()
    assert ran == [1] and threading.getprofile() is None


@pytest.mark.parametrize("daemon", [False, True])
def test_daemon_threads_started_while_tracking_count_too(daemon: bool):
    held: list[torch.Tensor] = []
    with TensorTracker(allocator=None) as tracker:
        run_in_thread(lambda: held.append(torch.empty(64, dtype=U8)), daemon=daemon)
    assert tracker.memory_allocated("cpu") == 64
