"""The pytest plugin (entry point ``pytest11``: ``memlab``): tensor memory budgets for tests,
checked with GPU numbers on any machine.

- ``@pytest.mark.limit_tensor_memory("64 MiB", metric="allocated", device=None)`` fails a test
  whose tensors' peak exceeds the limit; ``metric="reserved"`` checks the allocator's reserved bytes.
- ``@pytest.mark.limit_tensor_leaks("1 MiB")`` fails a test whose tensors still alive at its end
  exceed the limit.
- ``--memlab-limit SIZE`` (or ``memlab_limit = SIZE`` in the ini file) limits every test's
  allocated peak; a ``limit_tensor_memory`` mark overrides it for its test.
- ``--memlab`` prints, at the end, the tests with the highest peaks (``--memlab-top N``). Under
  pytest-xdist each worker sends its tests' peaks to the controller (``workeroutput``, read in
  ``pytest_testnodedown``), which prints one table of all of them and names any worker whose
  peaks did not come back (one that crashed).

A test takes one mark of each kind: two on the test itself are a usage error that names both; a
mark on the test overrides its class's or module's (pytest's closest mark). A failing test's
traceback shows no frame of the plugin nor of the tracker that measures it (the frames a failing
op gets under a dispatch mode are cut where the test's code called it).

What is measured is the test function's call: setup and teardown (fixtures) are not, and tensors
that existed before the call are not counted (:func:`memlab.pytest_plugin.measure.measured`).
The plugin is inert unless a mark or an option asks for it: loading it imports neither torch nor
pandas, and unmarked tests run untouched.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

from memlab._units import format_size, parse_size
from memlab.pytest_plugin import marks

__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
]

_LIMITS = pytest.StashKey[tuple[marks.MemoryLimit | None, marks.LeakLimit | None]]()
_MEASURING = "memlab-measuring"
_MEMLAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # memlab's folder
_WORKER_PEAKS = "memlab_peaks"  # the key of a pytest-xdist worker's peaks in its workeroutput


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memlab", "memlab: tensor memory limits, with GPU numbers also on CPU")
    group.addoption(
        "--memlab",
        action="store_true",
        default=False,
        help="measure every test's tensors and print the tests with the highest peaks at the end",
    )
    group.addoption(
        "--memlab-top",
        type=int,
        default=5,
        metavar="N",
        help="how many tests the --memlab table shows (default 5)",
    )
    group.addoption(
        "--memlab-limit",
        metavar="SIZE",
        default=None,
        help="fail every test whose tensors' allocated peak exceeds SIZE (e.g. '2 GiB'); "
        "a limit_tensor_memory mark overrides it",
    )
    parser.addini(
        "memlab_limit",
        "fail every test whose tensors' allocated peak exceeds this size (e.g. 2 GiB); "
        "--memlab-limit and limit_tensor_memory marks override it",
        default=None,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{marks.MEMORY_MARK}(limit, metric='allocated', device=None): fail the test when its "
        "tensors' peak of allocated (or reserved) bytes exceeds limit, e.g. '64 MiB' (memlab)",
    )
    config.addinivalue_line(
        "markers",
        f"{marks.LEAKS_MARK}(limit): fail the test when its tensors still alive at its end "
        "exceed limit, e.g. '1 MiB' (memlab)",
    )
    option = config.getoption("memlab_limit")
    text = option if option is not None else config.getini("memlab_limit")
    name = "--memlab-limit" if option is not None else "memlab_limit (ini)"
    default = None
    if text:
        try:
            default = marks.MemoryLimit(parse_size(text, name=name))
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
    top = config.getoption("memlab_top")
    if top < 1:
        raise pytest.UsageError(f"--memlab-top must be 1 or more, got {top}")
    table = config.getoption("memlab")
    if table or default is not None:
        config.pluginmanager.register(
            MeasuringPlugin(default, table, top, getattr(config, "workeroutput", None)), _MEASURING
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Read every limit mark once (a bad one is a usage error that names the test and what is
    valid), and start measuring only when some test has one."""
    marked = False
    for item in items:
        memory = _read(item, marks.MEMORY_MARK, marks.memory_limit)
        leaks = _read(item, marks.LEAKS_MARK, marks.leaks_limit)
        if memory is not None or leaks is not None:
            item.stash[_LIMITS] = (memory, leaks)
            marked = True
    if marked and not config.pluginmanager.has_plugin(_MEASURING):
        config.pluginmanager.register(MeasuringPlugin(None, False, 0), _MEASURING)


def _read(item: pytest.Item, name: str, read: Any) -> Any:
    own = [mark for mark in item.own_markers if mark.name == name]
    if len(own) > 1:
        shown = " and ".join(f"@pytest.mark.{name}({_arguments(mark)})" for mark in own)
        raise pytest.UsageError(f"{item.nodeid}: {len(own)} {name} marks on one test: {shown}; keep one")
    mark = item.get_closest_marker(name)  # the test's own, else its class's or module's
    if mark is None:
        return None
    try:
        return read(mark.args, mark.kwargs)
    except (TypeError, ValueError) as error:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{name}({_arguments(mark)}): {error}") from None


def _arguments(mark: pytest.Mark) -> str:
    return ", ".join([*map(repr, mark.args), *(f"{k}={v!r}" for k, v in mark.kwargs.items())])


def without_dispatch_frames(error: BaseException) -> None:
    """Cut from ``error``'s traceback the frames the measuring tracker added to a failing op: its
    ``__torch_dispatch__`` (twice where it paused a line profiler's trace:
    :func:`~memlab.sources.untraced.pause_for_op`), PyTorch's ``_disable_dynamo`` wrapper around it
    and the op called from there, so that the traceback ends where the test's own code called the
    op, as it does unmeasured. An error raised by memlab's own code is left as it is."""
    entries = []
    tb = error.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if not entries or _is_memlab(entries[-1].tb_frame.f_code.co_filename):
        return
    for index, entry in enumerate(entries):
        code = entry.tb_frame.f_code
        if code.co_name == "__torch_dispatch__" and _is_memlab(code.co_filename):
            start = index
            while start > 1 and _is_wrapper(entries[start - 1].tb_frame.f_code.co_filename):
                start -= 1  # the wrappers around the mode's __torch_dispatch__
            if start > 0:
                entries[start - 1].tb_next = None
            return


def _is_memlab(filename: str) -> bool:
    return filename.startswith(_MEMLAB)


def _is_wrapper(filename: str) -> bool:
    import torch

    return _is_memlab(filename) or filename.startswith(os.path.dirname(torch.__file__) + os.sep)


class MeasuringPlugin:
    """Measures the calls of the tests that ask for it (a mark, ``--memlab-limit``, ``--memlab``)
    and fails those over their limits; registered only when one of them is used."""

    def __init__(
        self,
        default: marks.MemoryLimit | None,
        table: bool,
        top: int,
        workeroutput: dict[str, Any] | None = None,
    ) -> None:
        self.default = default
        self.table = table
        self.top = top
        #: ``(nodeid, device, allocated peak, reserved peak, workspaces)`` of each measured test, in run
        #: order; ``workspaces`` is the sentence naming the modelled cuBLAS workspaces the peaks
        #: include (:func:`memlab.sources.workspace_note.workspaces_note`), ``""`` where none
        self.peaks: list[tuple[str, str, int, int, str]] = []
        #: ``"gw1: why"`` for each pytest-xdist worker whose peaks did not come back
        self.lost: list[str] = []
        if workeroutput is not None:  # a pytest-xdist worker: its peaks go to the controller's table
            workeroutput[_WORKER_PEAKS] = self.peaks  # sent when the worker's session finishes

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        __tracebackhide__ = True  # a failing test's traceback shows the test, not the plugin
        memory, leaks = item.stash.get(_LIMITS, (None, None))
        memory = memory if memory is not None else self.default
        if memory is None and leaks is None and not self.table:
            return (yield)
        from memlab.pytest_plugin.measure import Measurement, measured

        history = memory is not None or leaks is not None
        device = None if memory is None else memory.device
        measurement = Measurement()
        try:
            with measured(device, history=history, leaks=leaks is not None, into=measurement):
                try:
                    result = yield
                except BaseException as error:
                    without_dispatch_frames(error)
                    raise
        finally:
            if self.table:  # failed tests too: their peaks are real
                from memlab.sources.workspace_note import workspaces_note

                note = workspaces_note(measurement.workspaces) or ""
                peaks = measurement.allocated_peak, measurement.reserved_peak
                self.peaks.append((item.nodeid, measurement.device, *peaks, note))
        root = str(item.config.rootpath)
        failures = [
            message
            for message in (
                None if memory is None else marks.check_memory(memory, measurement, root),
                None if leaks is None else marks.check_leaks(leaks, measurement, root),
            )
            if message is not None
        ]
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)
        return result

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """pytest-xdist, in the controller: a worker ended; add the peaks of its tests (its
        ``workeroutput``, filled by this plugin in the worker) to the table, or note that they
        did not come back (a worker that crashed sends none)."""
        if not self.table:
            return
        worker = getattr(node, "workerinput", {}).get("workerid", "a worker")
        rows = getattr(node, "workeroutput", {}).get(_WORKER_PEAKS)
        if rows is None:
            self.lost.append(f"{worker}: {error}" if error else f"{worker}: it sent no measurements")
            return
        try:
            self.peaks += [
                (str(nodeid), str(device), int(allocated), int(reserved), str(note[0]) if note else "")
                for nodeid, device, allocated, reserved, *note in rows
            ]
        except (TypeError, ValueError):  # another memlab's format: say so rather than fail the run
            self.lost.append(
                f"{worker}: its measurements are not (test, device, allocated, reserved[, note]) rows"
            )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.table or _WORKER_PEAKS in getattr(terminalreporter.config, "workeroutput", {}):
            return
        terminalreporter.section("memlab: tests with the highest tensor peaks")
        shown = sorted(self.peaks, key=lambda row: (-row[2], -row[3], row[0]))[: self.top]
        terminalreporter.write_line(f"{'allocated':>10} {'reserved':>10}  {'device':<7} test")
        for nodeid, device, allocated, reserved, note in shown:
            terminalreporter.write_line(
                f"{format_size(allocated):>10} {format_size(reserved):>10}  {device:<7} {nodeid}"
                + (f"  ({note})" if note else "")
            )
        terminalreporter.write_line(
            "Peaks of each test call's own tensors (setup and teardown excluded); cuda: torch.cuda."
            "memory_stats, other devices: the CUDA caching allocator modelled by memlab.TensorTracker"
            " (with the cuBLAS workspaces of the GPU it models, named after the test where a matmul made "
            "them; CUBLAS_WORKSPACE_CONFIG=:0:0 turns them off)"
        )
        for lost in self.lost:
            terminalreporter.write_line(f"Not in this table: the tests of pytest-xdist worker {lost}")
