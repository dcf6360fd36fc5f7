"""How memlab traces: only registered code, alongside other tools, in threads, through exceptions."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import memlab

U8 = torch.uint8
COLUMNS = ("allocated_bytes.all.peak",)


def level3():
    raise ValueError("three frames deep")


def level2():
    level3()


def level1():
    level2()


def test_an_exception_three_frames_deep_reaches_the_caller_unchanged():
    before = sys.gettrace()
    lp = memlab.LineProfiler(level1, level2, level3)
    with pytest.raises(ValueError, match="three frames deep") as info:
        with lp:
            level1()
    assert [entry.name for entry in info.traceback][-3:] == ["level1", "level2", "level3"]
    assert sys.gettrace() is before
    assert not lp.enabled


def interrupted():
    raise KeyboardInterrupt


def test_keyboard_interrupt_passes_through_the_decorator_and_leaves_no_tracer():
    before = sys.gettrace()
    lp = memlab.LineProfiler()
    wrapped = lp(interrupted)
    with pytest.raises(KeyboardInterrupt):
        wrapped()
    assert sys.gettrace() is before
    assert threading.gettrace() is None
    assert lp._records.functions[interrupted.__code__].calls == 1


def unprofiled_helper():
    value = 1
    return value + 1


def profiled_caller():
    value = unprofiled_helper()
    return value * 2


class RecordingTracer:
    """A stand-in for a debugger or coverage: a global trace function recording every event."""

    def __init__(self):
        self.events = []

    def __call__(self, frame, event, arg):
        self.events.append((frame.f_code.co_name, event))
        return self.local

    def local(self, frame, event, arg):
        self.events.append((frame.f_code.co_name, event))
        return self.local

    def seen(self, name):
        return [event for code, event in self.events if code == name]


def run_under(tool, lp):
    """Install ``tool`` as a debugger would, profile ``profiled_caller``, and report which trace
    function was installed right after profiling (before ``tool`` is removed again)."""
    previous = sys.gettrace()
    sys.settrace(tool)
    try:
        with lp:
            profiled_caller()
        after = sys.gettrace()
    finally:
        sys.settrace(previous)
    return after


def test_a_preinstalled_trace_function_keeps_its_events_in_frames_memlab_traces(exact, rows):
    tool = RecordingTracer()
    lp = memlab.LineProfiler(profiled_caller, columns=COLUMNS)
    run_under(tool, lp)
    assert tool.seen("profiled_caller") == ["call", "line", "line", "return"]
    assert rows(lp, profiled_caller, ("hits",)) == [
        ("def profiled_caller():", 1),
        ("value = unprofiled_helper()", 1),
        ("return value * 2", 1),
    ]


def test_a_preinstalled_trace_function_keeps_its_events_in_frames_memlab_does_not_trace(exact):
    tool = RecordingTracer()
    run_under(tool, memlab.LineProfiler(profiled_caller, columns=COLUMNS))
    assert tool.seen("unprofiled_helper") == ["call", "line", "line", "return"]


def test_a_preinstalled_trace_function_is_back_in_place_after_profiling(exact):
    tool = RecordingTracer()
    assert run_under(tool, memlab.LineProfiler(profiled_caller, columns=COLUMNS)) is tool


def test_only_registered_code_gets_line_events():
    seen = []
    lp = memlab.LineProfiler(profiled_caller, columns=COLUMNS)
    with lp:
        tracer = sys.gettrace()

        def spy(frame, event, arg):
            local = tracer(frame, event, arg)
            seen.append((frame.f_code.co_name, local is not None))
            return local

        sys.settrace(spy)
        profiled_caller()
        sys.settrace(tracer)
    assert ("profiled_caller", True) in seen
    assert ("unprofiled_helper", False) in seen


def test_profilers_enabled_one_inside_the_other_both_record_and_restore_in_order(exact, rows):
    before = sys.gettrace()
    outer = memlab.LineProfiler(profiled_caller, columns=COLUMNS)
    inner = memlab.LineProfiler(unprofiled_helper, columns=COLUMNS)
    with outer:
        with inner:
            profiled_caller()
        assert sys.gettrace() is not before
    assert sys.gettrace() is before
    assert rows(outer, profiled_caller, ("hits",))[1] == ("value = unprofiled_helper()", 1)
    assert rows(inner, unprofiled_helper, ("hits",))[1:] == [("value = 1", 1), ("return value + 1", 1)]


def test_disabling_out_of_order_switches_no_other_profiler_off(exact, rows):
    before = sys.gettrace()
    first = memlab.LineProfiler(profiled_caller, columns=COLUMNS)
    second = memlab.LineProfiler(unprofiled_helper, columns=COLUMNS)
    first.enable()
    second.enable()
    first.disable()
    profiled_caller()
    second.disable()
    assert sys.gettrace() is before and threading.gettrace() is None
    assert rows(second, unprofiled_helper, ("hits",))[1:] == [("value = 1", 1), ("return value + 1", 1)]
    assert first._records.functions[profiled_caller.__code__].calls == 0


def allocate_in_thread(n):
    block = torch.empty(n, dtype=U8)
    return block.numel()


def test_threads_started_while_enabled_are_traced(rows):
    lp = memlab.LineProfiler(allocate_in_thread, columns=COLUMNS)
    results = []
    with lp:
        thread = threading.Thread(target=lambda: results.append(allocate_in_thread(100)))
        thread.start()
        thread.join()
    assert results == [100]
    assert rows(lp, allocate_in_thread, ("hits",)) == [
        ("def allocate_in_thread(n):", 1),
        ("block = torch.empty(n, dtype=U8)", 1),
        ("return block.numel()", 1),
    ]
    assert threading.gettrace() is None


def test_threads_started_after_disabling_are_not_traced(rows):
    lp = memlab.LineProfiler(allocate_in_thread, columns=COLUMNS)
    with lp:
        pass
    thread = threading.Thread(target=allocate_in_thread, args=(100,))
    thread.start()
    thread.join()
    assert rows(lp, allocate_in_thread, ("hits",))[0] == ("def allocate_in_thread(n):", None)


def test_the_decorator_installs_the_tracer_only_while_the_function_runs():
    lp = memlab.LineProfiler()
    inside = []

    @lp
    def spy():
        inside.append(sys.gettrace())

    before = sys.gettrace()
    spy()
    assert inside[0] is not None and inside[0] is not before
    assert sys.gettrace() is before
    assert not lp.enabled


def test_profiled_code_returns_the_same_values_and_gradients(exact):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.randn(3, 4)

    def step():
        model.zero_grad()
        loss = model(data).square().sum()
        loss.backward()
        return loss.detach(), model.weight.grad.clone()

    plain_loss, plain_grad = step()
    lp = memlab.LineProfiler(step, columns=COLUMNS)
    with lp:
        loss, grad = step()
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)


def blocks(n):
    for _ in range(n):
        yield torch.empty(1000, dtype=U8)


def consume_blocks():
    kept = list(blocks(3))
    return len(kept)


def test_a_profiled_generator_driven_by_a_profiled_caller_counts_inside_the_callers_line(exact, rows):
    lp = memlab.LineProfiler(blocks, consume_blocks, columns=COLUMNS)
    with lp:
        assert consume_blocks() == 3
    assert rows(lp, consume_blocks, ("hits", "allocated_bytes.all.peak")) == [
        ("def consume_blocks():", 1, 0),
        ("kept = list(blocks(3))", 1, 3000),
        ("return len(kept)", 1, 3000),
    ]


def test_the_decorator_traces_a_generator_only_while_it_runs(exact, rows):
    lp = memlab.LineProfiler(columns=COLUMNS)
    wrapped = lp(blocks)
    states = []
    for block in wrapped(2):
        states.append((lp.enabled, block.numel()))
    assert states == [(False, 1000), (False, 1000)]
    assert rows(lp, blocks, ("hits", "allocated_bytes.all.peak")) == [
        ("def blocks(n):", 1, 0),
        ("for _ in range(n):", 3, 1000),
        ("yield torch.empty(1000, dtype=U8)", 2, 2000),  # the consumer still holds the previous block
    ]


class Holder:
    def __init__(self):
        self.cache = []

    @property
    def grown(self):
        self.cache.append(torch.empty(256, dtype=U8))
        return len(self.cache)

    @classmethod
    def build(cls):
        return cls()


def test_the_decorator_wraps_properties_and_classmethods(exact, rows):
    lp = memlab.LineProfiler(columns=COLUMNS)
    Profiled = type("Profiled", (Holder,), {"grown": lp(Holder.grown), "build": lp(Holder.__dict__["build"])})
    holder = Profiled.build()
    assert (holder.grown, holder.grown) == (1, 2)
    assert rows(lp, Holder.grown, ("hits", "allocated_bytes.all.peak"))[1:] == [
        ("def grown(self):", 2, 256),
        ("self.cache.append(torch.empty(256, dtype=U8))", 2, 512),
        ("return len(self.cache)", 2, 512),
    ]
    assert rows(lp, Holder.build, ("hits",))[1:] == [("def build(cls):", 1), ("return cls()", 1)]


def keep(store):
    store.append(torch.empty(4096, dtype=U8))


def test_the_profilers_own_tracker_persists_between_calls_of_a_decorated_function(rows):
    lp = memlab.LineProfiler(columns=("allocated_bytes.all.peak", "allocated_bytes.all.current"))
    profiled_keep = lp(keep)
    store = []
    profiled_keep(store)
    profiled_keep(store)
    # The second call starts with the first call's block still alive, as a GPU would report it.
    assert rows(lp, keep, ("hits", "allocated_bytes.all.peak", "allocated_bytes.all.current")) == [
        ("def keep(store):", 2, 4096, 4096),
        ("store.append(torch.empty(4096, dtype=U8))", 2, 8192, 8192),
    ]


@pytest.mark.cuda
def test_on_a_gpu_the_published_example_reads_from_cuda_itself(rows):
    def build():
        linear = torch.nn.Linear(100, 100, device="cuda")
        return linear

    torch.cuda.empty_cache()
    base = torch.cuda.memory_stats()["active_bytes.all.current"]
    lp = memlab.LineProfiler(build, target_gpu=0)
    with lp:
        build()
    assert lp.source_line() == "measured on cuda:0 (torch.cuda.memory_stats)"
    assert rows(lp, build, ("hits", "active_bytes.all.peak"))[1] == (
        'linear = torch.nn.Linear(100, 100, device="cuda")',
        1,
        base + 40960,
    )
