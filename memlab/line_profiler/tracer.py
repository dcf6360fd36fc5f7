"""The trace functions: line events of registered code objects turned into per-line aggregates.

``sys.settrace`` gets a *global* trace function that is called once per new frame and returns a
*local* tracer only for registered code objects; every other frame gets no line events. A trace
function that was installed before (a debugger, coverage, another profiler) is chained: it is
called for every frame, memlab's or not, and for frames memlab traces its local tracer is called
after memlab's own work. State lives in the local tracer (one closure per frame), so recursion,
generators and coroutines are per frame. A line's sums (``*.allocated``, ``*.freed``, ``delta``,
``time``) count what happens once, however many frames of the function are inside that line at
once (a recursive call): an interval nested in an enclosing frame's interval on the same line
adds nothing there, since the enclosing one holds it whole.

The local tracers are generated per column layout (:mod:`memlab.line_profiler.local_tracer`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from memlab.line_profiler.local_tracer import Counting, local_factory
from memlab.line_profiler.records import ENTRY, ColumnLayout, FunctionRecord
from memlab.sources.untraced import PAUSABLE, mark_pausable

__all__ = ["Tracer", "end_frames"]

TraceFunction = Callable[[FrameType, str, Any], Any]
Sampler = Callable[[], tuple[int, ...]]


def _skip_retired(trace: TraceFunction | None) -> TraceFunction | None:
    """``trace``, or the first live function it chains to if ``trace`` is a memlab trace function
    whose profiler was disabled while another tool sat on top of it (it only forwards now)."""
    while getattr(trace, "memlab_live", (True,))[0] is False:
        trace = trace.memlab_previous  # type: ignore[union-attr]
    return trace


class Tracer:
    """Installs memlab's trace functions and turns line events into :class:`LineRecords` rows.

    ``functions`` maps each registered code object to its record and ``co_names`` holds their
    ``co_name``; the tracer reads both at every new frame, so functions registered while tracing
    are picked up at their next call.
    """

    def __init__(self, functions: dict[CodeType, FunctionRecord], co_names: set[str]) -> None:
        self.functions = functions
        self.co_names = co_names
        self.sample: Sampler | None = None
        self.entry_sample: Sampler | None = None
        self.on_call: Callable[[FrameType], object] | None = None
        self._layout: ColumnLayout | None = None
        # make_local per (nested, recursive, chained, counted), compiled at first use: see local_factory
        self._make_local: dict[tuple[bool, bool, bool, bool], Callable[..., TraceFunction]] = {}
        self._counting: Counting | None = None
        self._thread_hook: TraceFunction | None = None
        self._thread_hook_live: list[bool] = [False]
        self._previous_thread_hook: TraceFunction | None = None
        self._owner = object()  # marks this tracer's local tracers (several profilers may chain)

    # -- session ------------------------------------------------------------------------------
    def start(
        self,
        layout: ColumnLayout,
        sample: Sampler,
        entry_sample: Sampler,
        on_call: Callable[[FrameType], object] | None = None,
        counting: Counting | None = None,
    ) -> None:
        """Begin a session: read ``sample`` at line events and ``entry_sample`` (the current values
        behind the peak columns) at calls; call ``on_call(frame)`` at each call of a registered
        function that has no profiled caller, before its state at entry is read; trace threads
        started from now on. ``counting``: the source's change count, where it has one and
        ``sample`` reads the entry keys after the layout's (see :func:`local_tracer.samplers`)."""
        self.on_call = on_call
        if layout != self._layout:
            self._layout = layout
            self._make_local = {}
        self.sample, self.entry_sample = sample, entry_sample
        self._counting = counting
        self._previous_thread_hook = threading.gettrace()
        self._thread_hook_live = [True]
        self._thread_hook = self._global_trace(self._previous_thread_hook, self._thread_hook_live, True)
        threading.settrace(self._thread_hook)

    def stop(self) -> None:
        """End the session: threads started from now on are not traced, and threads still running
        with memlab's trace function hand it back to what they had at their start."""
        self._thread_hook_live[0] = False
        if threading.gettrace() is self._thread_hook:
            threading.settrace(_skip_retired(self._previous_thread_hook))  # type: ignore[arg-type]
        self._thread_hook = None
        self.sample = self.entry_sample = self.on_call = None  # a live sampler keeps its window open
        self._counting = None

    # -- one thread -----------------------------------------------------------------------------
    def install(self) -> tuple[TraceFunction, TraceFunction | None, list[bool]] | None:
        """Install the global trace function in the calling thread, chaining what was there.

        Returns a token for :meth:`uninstall`, or ``None`` if this tracer already traces the
        thread (a thread started while a session was running).
        """
        previous = sys.gettrace()
        if getattr(previous, "memlab_owner", None) is self._owner:
            return None
        live = [True]
        trace = self._global_trace(previous, live, False)
        sys.settrace(trace)
        return trace, previous, live

    def uninstall(self, token: tuple[TraceFunction, TraceFunction | None, list[bool]] | None) -> None:
        """Undo :meth:`install`: the previous trace function is back, unless another tool replaced
        memlab's meanwhile; then memlab's stays where it is and forwards everything to the tool it
        chained, so no other tool is switched off."""
        if token is None:
            return
        trace, previous, live = token
        live[0] = False
        current = sys.gettrace()
        if current is trace or current is None:
            sys.settrace(_skip_retired(previous))

    # -- trace functions ------------------------------------------------------------------------
    def _global_trace(
        self, previous: TraceFunction | None, live: list[bool], thread_hook: bool
    ) -> TraceFunction:
        functions, co_names = self.functions, self.co_names
        enter = self._enter

        def trace(frame: FrameType, event: str, arg: Any) -> Any:
            if live[0]:
                code = frame.f_code
                # Equal code objects have equal names; a name's hash is cached, a code object's is
                # recomputed from its bytecode and constants: most frames stop at the name.
                if code.co_name in co_names:
                    record = functions.get(code)
                    if record is not None:
                        other = previous(frame, event, arg) if previous is not None else None
                        return enter(frame, record, other)
            elif thread_hook and sys.gettrace() is trace:
                sys.settrace(_skip_retired(previous))
            return previous(frame, event, arg) if previous is not None else None

        trace.memlab_owner = self._owner  # type: ignore[attr-defined]
        trace.memlab_live = live  # type: ignore[attr-defined]
        trace.memlab_previous = previous  # type: ignore[attr-defined]
        # Alone (chaining no other tool's): the tracker switches it off inside its own dispatch.
        mark_pausable(trace, previous is None or getattr(previous, PAUSABLE, False))
        return trace

    def _parent(self, frame: FrameType) -> TraceFunction | None:
        """The local tracer of the nearest caller of ``frame`` that this tracer traces, if any."""
        owner = self._owner
        caller = frame.f_back
        while caller is not None:
            local = caller.f_trace
            if local is not None and getattr(local, "memlab_owner", None) is owner:
                return local  # type: ignore[no-any-return]
            caller = caller.f_back
        return None

    def _enter(self, frame: FrameType, record: FunctionRecord, other: TraceFunction | None) -> TraceFunction:
        """A call of (or a resumption into) a registered code object."""
        sample, layout, counting = self.sample, self._layout, self._counting
        assert sample is not None and layout is not None and self.entry_sample is not None
        parent = self._parent(frame)
        parent_box = None if parent is None else parent.memlab_box  # type: ignore[attr-defined]
        if parent_box is None and self.on_call is not None:
            self.on_call(frame)
        table, pending, flush = counting if counting is not None else (None, (), None)
        if pending:
            flush()  # as the sample would, before the count is read (local_tracer.local_source)
        seen = None if table is None else table.changes
        start = sample()
        if parent_box is not None and layout.peaks:
            # The time since the caller's last event, up to this call, is inside the caller's line.
            box = parent_box[0]
            if box is None:
                parent_box[0] = list(start[: len(layout.peaks)])
            else:
                for i, value in enumerate(start[: len(layout.peaks)]):
                    if value > box[i]:
                        box[i] = value
            parent_box[1] = None  # the caller's next event folds the box in (local_tracer)
        rows = record.rows
        # The rows enclosing frames of this function are in (they stay there while this one runs).
        outer: set[int] = set()
        above = parent
        while above is not None:
            if above.memlab_rows is rows:  # type: ignore[attr-defined]
                outer.add(id(above.memlab_state()))  # type: ignore[attr-defined]
            above = above.memlab_parent  # type: ignore[attr-defined]
        variant = (parent is not None, bool(outer), other is not None, table is not None)
        make_local = self._make_local.get(variant)
        if make_local is None:
            make_local = self._make_local[variant] = local_factory(layout, *variant)
        resumed = frame.f_trace
        if getattr(resumed, "memlab_owner", None) is self._owner and resumed.memlab_rows is rows:  # type: ignore[union-attr]
            # A generator or coroutine resumed: continue the line it stopped on, in a new local
            # tracer since the caller (and so the parent box) may have changed.
            row, box = resumed.memlab_state(), resumed.memlab_box  # type: ignore[union-attr]
        else:
            row, box = rows.get(ENTRY), [None, None]  # peaks posted by profiled callees; see make_local
            if row is None:
                row = rows[ENTRY] = layout.new_row()
            layout.entry_row_update(row, start, self.entry_sample())
            row = layout.new_row()  # the moment between the call and the first line belongs to no row
        clock = time.perf_counter_ns() if layout.timed else 0
        return make_local(
            rows,
            layout.new_row,
            sample,
            row,
            start,
            parent_box,
            other,
            self._owner,
            box,
            clock,
            parent,
            outer,
            table,
            pending,
            flush,
            seen,
        )


def end_frames(frame: FrameType | None) -> None:
    """Close the rows of the frames memlab traces, from ``frame`` outward, as if each returned now:
    for a program that ends without returning (``os._exit``), so that the lines it was in show
    what they held rather than nothing. Each frame's local tracer gets its ``return`` event once
    (and passes it on to a tracer it chains, as at a real return)."""
    while frame is not None:
        local = frame.f_trace
        if local is not None and hasattr(local, "memlab_owner"):
            frame.f_trace = None
            local(frame, "return", None)
        frame = frame.f_back
