"""The tracker's dispatch runs with a line profiler's trace function off, and with anyone else's on."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab
from memlab.sources.untraced import mark_pausable, pause_for_op, resume, untraced

# Python 3.12+ keeps tracing on (switching it is dearer than the tracing it saves there).
PAUSES = sys.version_info < (3, 12)


class Recording(TorchDispatchMode):
    """A mode that records the thread's trace function inside each dispatch."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.seen: list[Any] = []
        self.fail = fail

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        trace = sys.gettrace()  # as the tracker does
        paused = trace is not None and pause_for_op(trace, func, types)
        try:
            self.seen.append(sys.gettrace())
            if self.fail:
                raise RuntimeError("failed in dispatch")
            return func(*args, **(kwargs or {}))
        finally:
            if paused:
                resume(trace)


def _trace(frame: Any, event: str, arg: Any) -> None:
    return None


def _pausable() -> Any:
    def trace(frame: Any, event: str, arg: Any) -> None:
        return None

    mark_pausable(trace, True)
    return trace


def _run(trace: Any, mode: TorchDispatchMode, work: Any) -> Any:
    sys.settrace(trace)
    try:
        with mode:
            work()
        return sys.gettrace()
    finally:
        sys.settrace(None)


def test_a_pausable_trace_is_off_inside_dispatch_and_back_after() -> None:
    trace, mode = _pausable(), Recording()
    after = _run(trace, mode, lambda: torch.ones(2) + 1)
    assert mode.seen == ([None, None] if PAUSES else [trace, trace])
    assert after is trace


def test_a_trace_function_not_marked_stays_on() -> None:
    mode = Recording()
    after = _run(_trace, mode, lambda: torch.ones(2) + 1)
    assert mode.seen == [_trace, _trace]
    assert after is _trace


def test_a_trace_function_marked_not_pausable_stays_on() -> None:
    mark_pausable(trace := _pausable(), False)
    mode = Recording()
    _run(trace, mode, lambda: torch.ones(2) + 1)
    assert mode.seen == [trace, trace]


def test_the_trace_is_back_after_an_exception_in_dispatch() -> None:
    trace, mode = _pausable(), Recording(fail=True)
    sys.settrace(trace)
    try:
        with pytest.raises(RuntimeError, match="failed in dispatch"), mode:
            torch.ones(2)
        assert sys.gettrace() is trace
    finally:
        sys.settrace(None)
    assert mode.seen == ([None] if PAUSES else [trace])


def test_a_tensor_subclass_argument_keeps_the_trace_on() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    trace, mode = _pausable(), Recording()
    pair = TwoTensor(torch.ones(2), torch.ones(2))
    _run(trace, mode, lambda: pair + 1)
    assert mode.seen == [trace]


def test_a_mode_below_keeps_the_trace_on() -> None:
    trace, inner = _pausable(), Recording()
    below = Recording()
    sys.settrace(trace)
    try:
        with below, inner:
            torch.ones(2)
    finally:
        sys.settrace(None)
    assert inner.seen == [trace]
    assert below.seen == ([None] if PAUSES else [trace])  # nothing below it


@torch.library.custom_op("memlab_test_untraced::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_an_operator_outside_aten_keeps_the_trace_on() -> None:
    trace, mode, x = _pausable(), Recording(), torch.ones(2)
    _run(trace, mode, lambda: torch.ops.memlab_test_untraced.twice(x))
    assert mode.seen == [trace]  # the ops its kernel runs do not reach the mode, which is off meanwhile


def twice_body(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    return y


@torch.library.custom_op("memlab_test_untraced::profiled_twice", mutates_args=())
def _profiled_twice(x: torch.Tensor) -> torch.Tensor:
    return twice_body(x)


def calls_custom_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.ops.memlab_test_untraced.profiled_twice(x)
    return y


def test_a_profiled_function_inside_a_custom_op_is_still_traced() -> None:
    lp = memlab.LineProfiler(calls_custom_op, twice_body, source="tracker")
    lp.runcall(calls_custom_op, torch.ones(2))
    table = lp.to_dataframe(twice_body)
    assert table["hits"].tolist() == [1, 1, 1]  # the def line (one call), then each line once


def test_a_trace_function_installed_before_profiling_sees_the_trackers_frames() -> None:
    seen: set[str] = set()

    def tool(frame: Any, event: str, arg: Any) -> None:
        seen.add(frame.f_code.co_name)
        return None

    def work() -> None:
        torch.ones(2) + 1

    lp = memlab.LineProfiler(work, source="tracker")
    sys.settrace(tool)
    try:
        lp.runcall(work)
    finally:
        sys.settrace(None)
    assert "__torch_dispatch__" in seen
    assert "_count_op" in seen


def test_under_memlabs_profiler_alone_the_trackers_dispatch_is_untraced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inside: list[Any] = []
    count_op = memlab.TensorTracker._count_op

    def spying_count_op(self: Any, *args: Any) -> Any:
        inside.append(sys.gettrace())
        return count_op(self, *args)

    monkeypatch.setattr(memlab.TensorTracker, "_count_op", spying_count_op)
    seen: list[Any] = []

    def work() -> None:
        seen.append(sys.gettrace())
        torch.ones(2) + 1

    lp = memlab.LineProfiler(work, source="tracker")
    lp.runcall(work)
    memlabs = seen[0]
    assert getattr(memlabs, "memlab_owner", None) is not None  # memlab's trace function ran work
    assert inside == ([None, None] if PAUSES else [memlabs, memlabs])
    assert lp.to_dataframe(work)["hits"].tolist() == [1, 1, 1]


def test_a_hook_runs_untraced_under_a_pausable_trace_and_restores_it() -> None:
    seen: list[Any] = []

    @untraced
    def hook(value: int, fail: bool = False) -> int:
        seen.append(sys.gettrace())
        if fail:
            raise ValueError("hook failed")
        return value + 1

    trace = _pausable()
    sys.settrace(trace)
    try:
        assert hook(1) == 2
        with pytest.raises(ValueError, match="hook failed"):
            hook(1, fail=True)
        after = sys.gettrace()
    finally:
        sys.settrace(None)
    sys.settrace(_trace)
    try:
        hook(1)
    finally:
        sys.settrace(None)
    assert after is trace
    assert seen == ([None, None] if PAUSES else [trace, trace]) + [_trace]


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu())


def test_the_module_hooks_run_untraced_under_memlabs_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.sources.modules import ModuleRecorder

    inside: list[Any] = []
    sample = ModuleRecorder._sample

    def spying_sample(self: Any) -> Any:
        inside.append(sys.gettrace())
        return sample(self)

    monkeypatch.setattr(ModuleRecorder, "_sample", spying_sample)
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(2, 8)

    def step() -> None:
        model(x).sum().backward()

    lp = memlab.LineProfiler(step)
    with memlab.TensorTracker(model=model) as tracker:
        lp.runcall(step)
    assert len(inside) > 1  # the recorder's start, then its hooks
    assert all(seen is None for seen in inside) or not PAUSES
    assert sorted(tracker.by_module().index) == ["", "first", "second"]
