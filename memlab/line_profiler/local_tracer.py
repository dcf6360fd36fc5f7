"""The local tracers: the code that runs at every line event of a profiled frame, generated per layout.

A local tracer closes the interval of the line a frame was on and opens the next one. It runs at
every line event, so it is generated for the column layout with the updates unrolled: one
sampler call, a few comparisons and list stores per event.

Where the source counts its changes (a ``TensorTracker``: its allocator model bumps a count after
every change to a statistic, :func:`counted`), an event where nothing moved since the frame's last
sample skips the sample: most line events of real programs are pure Python or tensor code that
allocates nothing. The numbers are the same by construction: what the sampler would have
returned is known (below). Sources that cannot say so (CUDA's own statistics) are sampled at
every event, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from memlab.line_profiler.records import DELTA, TIME, ColumnLayout

__all__ = ["Counting", "counted", "local_factory", "samplers"]

TraceFunction = Callable[..., Any]
Sampler = Callable[[], tuple[int, ...]]
#: ``(table, pending, flush)``: see :func:`counted`.
Counting = tuple[Any, Any, Callable[[], object]]

_HEAD = """
def make_local(rows, new_row, sample, row, start, parent_box, other, owner, box, clock, parent, outer,
               table, pending, flush, seen):
    {starts}, = [start[j] for j in {summed!r}]
    life = {life}"""
_TAIL = """
    local.memlab_owner = owner
    local.memlab_box = box
    local.memlab_rows = rows
    local.memlab_state = lambda: row
    local.memlab_parent = parent
    return local
"""


def counted(sample: Sampler) -> Counting | None:
    """``(table, pending, flush)`` where ``sample`` can say that nothing moved: a
    :class:`~memlab.sources.allocator.stats.StatTable`'s sampler (a ``TensorTracker``'s) carries
    ``memlab_changes``, an object whose ``changes`` the allocator model bumps after every change to
    a statistic, ``memlab_pending``, the releases queued until they are applied, and
    ``memlab_flush``, which applies them. ``None`` for any other sampler (CUDA's has to read its
    statistics to know): the tracer samples at every event."""
    table = getattr(sample, "memlab_changes", None)
    if table is None:
        return None
    return table, getattr(sample, "memlab_pending", ()), getattr(sample, "memlab_flush", None) or _nothing


def _nothing() -> None:
    return None


def samplers(
    make: Callable[[tuple[str, ...]], Sampler], layout: ColumnLayout
) -> tuple[Sampler, Sampler, Counting | None]:
    """``(sample, entry_sample, counting)`` for a session, ``make(keys)`` making a source's sampler.

    ``entry_sample`` reads the current values behind the peak columns (:attr:`ColumnLayout.entry_keys`),
    ``sample`` the layout's :attr:`ColumnLayout.sample_keys`; where the source counts its changes
    (``counting``, see :func:`counted`), ``sample`` reads the entry keys after them too: a line
    event where nothing moved reads its peaks as those current values (see :func:`local_source`).
    """
    entry_sample = make(layout.entry_keys)
    counting = counted(entry_sample)
    keys = layout.sample_keys if counting is None else (*layout.sample_keys, *layout.entry_keys)
    return make(keys), entry_sample, counting


def _indented(lines: list[str], depth: int = 1) -> list[str]:
    return ["    " * depth + line for line in lines]


class _Pieces:
    """The statements the variants of one layout are made of (see :func:`local_source`)."""

    def __init__(self, layout: ColumnLayout, nested: bool, recursive: bool, counted: bool) -> None:
        n_peaks, n_sums = len(layout.peaks), len(layout.sums)
        self.nested, self.recursive = nested, recursive
        self.peaks = range(n_peaks)
        self.n_values = n_values = len(layout.sample_keys)
        self.values = ", ".join(f"v{j}" for j in range(n_values)) + ("," if n_values == 1 else "")
        self.summed = [*range(n_peaks, n_peaks + n_sums), layout.delta_index]
        self.currents = range(n_peaks + n_sums, n_peaks + n_sums + len(layout.currents))
        self.starts = ", ".join(f"s{j}" for j in self.summed)
        self.now = ["t = now()"] if layout.timed else []
        self.timing = [f"row[{layout.row_index[TIME]}] += t - clock"] if layout.timed else []
        # close: fold the sample (v*) into the ending interval's row
        close = list(self.now)
        if n_peaks:
            close += ["if box[0] is not None:", "    b = box[0]", "    box[0] = None"]
            close += [f"    if b[{i}] > v{i}: v{i} = b[{i}]" for i in self.peaks]
            close += self.fold("v")
        close += [f"row[{1 + j}] = v{j}" for j in self.currents]
        # Most lines allocate nothing: a total that did not move skips the arithmetic and the store.
        sums = [f"if v{j} != s{j}: row[{1 + j}] += v{j} - s{j}" for j in self.summed[:-1]]
        d = self.summed[-1]
        sums += [f"if v{d} != s{d}: row[{layout.row_index[DELTA]}] += v{d} - s{d}"]
        self.close = close + self.outside(sums + self.timing)
        new_row = "_new_row" if counted else "new_row"
        self.open_row = [
            "try:",
            "    row = rows[frame.f_lineno]",
            "except KeyError:",
            f"    row = rows[frame.f_lineno] = {new_row}()",
            "row[0] += 1",
            *(["clock = t"] if layout.timed else []),
        ]
        # at return (also a yield): the highest peaks of the frame's life, to the caller's box
        zeros = f"[{', '.join('0' for _ in self.peaks)}]"
        self.posted: list[str] = []
        if nested and n_peaks:
            self.posted += ["pb = parent_box[0]", "if pb is None:", "    parent_box[0] = life", "else:"]
            self.posted += [f"    if life[{i}] > pb[{i}]: pb[{i}] = life[{i}]" for i in self.peaks]
            self.posted += ["parent_box[1] = None", f"life = {zeros}"]
        self.life = zeros if nested else "None"

    def fold(self, v: str) -> list[str]:
        """The interval's peaks (``v0, v1, ...`` or ``c0, c1, ...``) into the row (and the life)."""
        lines = [f"if {v}{i} > row[{1 + i}]: row[{1 + i}] = {v}{i}" for i in self.peaks]
        if self.nested:
            lines += [f"if {v}{i} > life[{i}]: life[{i}] = {v}{i}" for i in self.peaks]
        return lines

    def outside(self, lines: list[str]) -> list[str]:
        """``lines`` (sums) skipped on a row an enclosing frame of the same function is in."""
        if self.recursive and lines:
            return ["if id(row) not in outer:", *_indented(lines)]
        return lines

    def head(self) -> str:
        return _HEAD.format(starts=self.starts, summed=tuple(self.summed), life=self.life)


def _sampling_source(p: _Pieces, chained: bool) -> str:
    """One function that samples at every event."""
    chain = ["if other is not None:", "    other = other(frame, event, arg)"] if chained else []
    state = ["row", *(["other"] if chained else []), "life", "clock", p.starts]
    on_line = [f"{p.values} = sample()", *p.close, *(f"s{j} = v{j}" for j in p.summed), *p.open_row]
    on_return = [f"{p.values} = sample()", *p.close, *p.posted]
    body = ['if event == "line":', *_indented(on_line), 'elif event == "return":', *_indented(on_return)]
    lines = [
        "",
        "    def local(frame, event, arg):",
        f"        nonlocal {', '.join(state)}",
        *_indented([*body, *chain, "return local"], 2),
    ]
    return p.head() + "\n".join(lines) + "\n" + _TAIL


def _counting_source(p: _Pieces, chained: bool) -> str:
    """``local`` for the common event, ``handle`` for the others (see :func:`local_source`)."""
    n_peaks = len(p.peaks)
    cs = "".join(f", c{i}" for i in p.peaks)
    # Nothing moved since the last sample: its values, each peak read as its current value then.
    still = list(p.now)
    if n_peaks:
        still += ["if box[0] is None:", *_indented(p.fold("c"))]
        still += ["else:", "    b = box[0]", "    box[0] = None"]
        still += [f"    v{i} = b[{i}] if b[{i}] > c{i} else c{i}" for i in p.peaks]
        still += _indented(p.fold("v"))
    still += [f"row[{1 + j}] = k{j}" for j in p.currents]
    still += [*p.outside(p.timing), "box[1] = seen"]
    sampled = ["if pending:", "    flush()", "seen = table.changes"]
    sampled += [f"{p.values.rstrip(',')}{cs}, = sample()"]
    sampled += [f"k{j} = v{j}" for j in p.currents]
    sampled += [*p.close, "box[1] = seen"]  # close emptied the box

    def split(moved: list[str]) -> list[str]:
        return ["if table.changes == seen and not pending:", *_indented(still), "else:", *_indented(moved)]

    on_line = split([*sampled, *(f"s{j} = v{j}" for j in p.summed)])
    handle = ['if event == "line":', *_indented(on_line + p.open_row)]
    handle += ['elif event == "return":', *_indented(split(sampled) + p.posted)]
    fast = [*p.now, *p.fold("c"), *(f"row[{1 + j}] = k{j}" for j in p.currents), *p.outside(p.timing)]
    local = [
        'if event == "line" and box[1] == table.changes and not pending:',
        *_indented(fast + p.open_row),
        "else:",
        "    handle(frame, event)",
        *(["if other is not None:", "    other = other(frame, event, arg)"] if chained else []),
        "return local",
    ]
    state = ["row", "life", "clock", p.starts, "seen", *(f"c{i}" for i in p.peaks)]
    state += [f"k{j}" for j in p.currents]
    prologue = []
    if n_peaks:  # the current values behind the peaks, sampled after the layout's keys
        prologue += [f"{cs[2:]}, = start[{p.n_values}:]"]
    if len(p.currents):
        ks = ", ".join(f"k{j}" for j in p.currents)
        prologue += [f"{ks}, = [start[j] for j in {tuple(p.currents)!r}]"]
    prologue += ["box[1] = seen if box[0] is None else None"]
    fast_state = ["row", *(["clock"] if p.now else []), *(["other"] if chained else [])]
    lines = [
        *_indented(prologue),
        "",
        "    def handle(frame, event):",
        f"        nonlocal {', '.join(state)}",
        *_indented(handle, 2),
        "",
        "    def local(frame, event, arg):",
        f"        nonlocal {', '.join(fast_state)}",
        *_indented(local, 2),
    ]
    return p.head() + "\n" + "\n".join(lines) + "\n" + _TAIL


def local_source(layout: ColumnLayout, nested: bool, recursive: bool, chained: bool, counted: bool) -> str:
    """Python source of ``make_local(...)`` specialised for ``layout`` (see :func:`local_factory`).

    ``nested``: the frame has a profiled caller, to which it posts the highest peaks of its life.
    ``recursive``: a profiled caller up the stack runs the same function; the sums of an interval
    whose row is one an enclosing frame is in (``outer``: the ids of those rows) are already
    inside that frame's interval, so they are not added again. ``chained``: another tool's local
    tracer is called after memlab's work; without one (it cannot appear later: a chained tool that
    returns ``None`` is not called again) the tracer skips that test on every event.

    ``counted``: the source counts its changes (``table.changes``, see :func:`counted`). An event
    where the count is the one read before the frame's last sample (``seen``, read after applying
    the releases pending then), with no release pending now, skips the sample: the source would
    return what it returned then, except that each peak is the current value of its statistic at
    that sample (its window was reset to it, and nothing moved since: other samplers of the table
    reset it to the same value). The sample reads those current values too (``c*``, after the
    layout's keys: :func:`samplers`); sums did not move, and currents (``k*``) are those sampled.
    A line event of that kind with nothing posted to the box is the common case: ``local``
    handles it in a closure over the few names it reads (Python copies every name a closure uses
    into each call's frame: ~1.5 ns a name per event), and hands every other event to
    ``handle``. ``box[1]`` is the count at which that shortcut holds, ``None`` while a profiled
    callee's peaks wait in ``box[0]``.
    """
    pieces = _Pieces(layout, nested, recursive, counted)
    return _counting_source(pieces, chained) if counted else _sampling_source(pieces, chained)


def local_factory(
    layout: ColumnLayout, nested: bool, recursive: bool, chained: bool, counted: bool
) -> Callable[..., TraceFunction]:
    """Compile ``make_local(rows, new_row, sample, row, start, parent_box, other, owner, box, clock,
    parent, outer, table, pending, flush, seen)``.

    It returns the local tracer of one frame. On a ``line`` or ``return`` event the tracer samples
    the source once and closes the interval of the current line into ``row``: peaks (folded with
    those of profiled callees, posted to ``box[0]``) take the max, sums add the difference of
    running totals since the interval's start (``start`` for the first one), currents take the
    value at the end; a ``line`` event then opens the next line's interval and counts a hit. With
    ``nested``, at ``return`` (also a ``yield``) the frame posts the highest peaks of its life to
    ``parent_box``, the box of the nearest profiled caller, since everything this frame did
    happened inside the caller's line. ``other`` is a chained tool's local tracer for the same
    frame, called after memlab's work. With a ``time`` column, ``clock`` is the
    ``time.perf_counter_ns()`` at which the first interval started. ``parent`` is the local tracer
    of the nearest profiled caller (``None`` without one); with ``recursive``, ``outer`` holds the
    ids of the rows that enclosing frames of the same function are in, whose sums this frame's
    intervals on those rows leave alone (see :func:`local_source`). With ``counted``,
    ``table.changes`` counts the source's changes, ``pending`` holds its queued releases and
    ``flush`` applies them (see :func:`counted`); ``seen`` is the count read before ``start`` was
    sampled, and ``start`` ends with the current values behind the peak columns (:func:`samplers`).
    """
    namespace: dict[str, Any] = {"now": time.perf_counter_ns, "_new_row": layout.new_row}
    source = local_source(layout, nested, recursive, chained, counted)
    exec(compile(source, f"<memlab local tracer {layout.keys}>", "exec"), namespace)
    return namespace["make_local"]  # type: ignore[no-any-return]
