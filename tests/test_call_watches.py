"""The watches a higher layer hands the line profiler: entered around each profiled call and block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import memlab
from memlab import _call_watches
from memlab._call_watches import CALL_WATCHES, WatchedCall


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Two watches that log their entries and exits, in place of the registered ones."""
    log: list[tuple[Any, ...]] = []

    def recorder(name: str) -> Any:
        @contextlib.contextmanager
        def watch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
            log.append((name, "enter", getattr(func, "__name__", func), args, kwargs))
            try:
                yield
            except BaseException as error:
                log.append((name, "exit", type(error).__name__))
                raise
            log.append((name, "exit", None))

        return watch

    monkeypatch.setattr(_call_watches, "CALL_WATCHES", [recorder("outer"), recorder("inner")])
    return log


def double(x: int, *, times: int = 2) -> int:
    return x * times


def test_import_memlab_registers_the_oom_watch():
    assert [watch.__name__ for watch in CALL_WATCHES] == ["_explain_oom_watch"]
    assert memlab._explain_oom_watch in CALL_WATCHES


def test_a_profiled_call_enters_every_watch_with_its_arguments_and_leaves_them_in_reverse(events):
    profiled = memlab.LineProfiler(target_gpu="cpu")(double)
    assert profiled(3, times=4) == 12
    assert events == [
        ("outer", "enter", "double", (3,), {"times": 4}),
        ("inner", "enter", "double", (3,), {"times": 4}),
        ("inner", "exit", None),
        ("outer", "exit", None),
    ]


def test_a_profiler_block_is_watched_as_a_call_of_none_and_its_error_reaches_the_watches(events):
    lp = memlab.LineProfiler(double, target_gpu="cpu")
    with pytest.raises(KeyError), lp:
        raise KeyError("inside")
    assert events == [
        ("outer", "enter", None, (), {}),
        ("inner", "enter", None, (), {}),
        ("inner", "exit", "KeyError"),
        ("outer", "exit", "KeyError"),
    ]
    assert not lp.enabled


def test_a_watch_that_fails_to_enter_leaves_the_ones_already_entered_with_its_error(events):
    def broken(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise RuntimeError("cannot watch")

    _call_watches.CALL_WATCHES.insert(1, broken)
    with pytest.raises(RuntimeError, match="cannot watch"), WatchedCall(double, (1,)):
        pytest.fail("the call must not run when a watch cannot be entered")
    assert events == [("outer", "enter", "double", (1,), {}), ("outer", "exit", "RuntimeError")]
