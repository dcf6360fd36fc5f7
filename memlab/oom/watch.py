"""``explain_oom``: watch a block or a step for out-of-memory errors and explain each one.

While a watch is active, the moment a :class:`memlab.TensorTracker`'s modelled allocator (or, on a
GPU, PyTorch's allocator) runs out of memory, the state is captured (:mod:`memlab.oom.capture`).
When the watched block ends, each captured error is explained on stderr (:mod:`memlab.oom.report`)
with a snapshot pickle where a trace exists, and an error passing through is re-raised unchanged.
Nothing else happens on the way: entering and leaving a watch costs a list append and removal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import re
import sys
import tempfile
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO, TypeVar, overload

import torch

from memlab._outputs import check_stream
from memlab.oom.capture import Call, OOMCapture, capture_cuda_oom, capture_tracker_oom, now_us
from memlab.oom.report import OOMReport

__all__ = ["OOMWatch", "explain_oom", "last_report", "watching"]

F = TypeVar("F", bound=Callable[..., Any])

_entries: list[_Entry] = []  # active watches, innermost last
_pending: list[OOMCapture] = []  # captured, not yet reported
_reported: set[int] = set()  # ids of errors already explained (cleared when no watch is active)
_observing = {"tracker": False, "cuda": False}
_files = itertools.count(1)
_last: list[OOMReport] = []


def last_report() -> OOMReport | None:
    """The most recent report any watch wrote (``explain_oom``, a profiled function, a
    ``LineProfiler`` session), or ``None``."""
    return _last[-1] if _last else None


class _Entry:
    """One entry into a watch: the watch, the call it watches (if any), and the last capture
    number when it began."""

    __slots__ = ("call", "sequence", "watch")

    def __init__(self, watch: OOMWatch, call: Call | None) -> None:
        self.watch = watch
        self.call = call
        self.sequence = _pending[-1].sequence if _pending else 0


def _on_tracker_oom(tracker: Any, storage: torch.UntypedStorage, nbytes: int, error: Any) -> None:
    if not _entries:
        return
    call = next((e.call for e in reversed(_entries) if e.call is not None), None)
    try:
        capture = capture_tracker_oom(tracker, storage, nbytes, error, call)
    except Exception as failure:  # never replace the user's error with memlab's
        capture = _failed_capture(error, failure, call)
    _pending.append(capture)


def _on_cuda_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    if not _entries:
        return
    call = next((e.call for e in reversed(_entries) if e.call is not None), None)
    try:
        capture = capture_cuda_oom(device, alloc, device_allocated, device_free, call)
    except Exception as failure:
        capture = _failed_capture(None, failure, call)
    _pending.append(capture)


def _failed_capture(error: Any, failure: Exception, call: Call | None) -> OOMCapture:
    return OOMCapture(
        error_id=id(error),
        message=str(error) if error is not None else "",
        device="?",
        source="tracker",
        stack=(),
        requested=0,
        block_size=0,
        segment_size=0,
        capacity=0,
        stats={},
        largest_free_block=0,
        call=call,
        note=f"memlab could not capture the allocator state: {type(failure).__name__}: {failure}",
    )


def _observe() -> None:
    """Register the observers once: the tracker's at the first watch, PyTorch's out-of-memory
    observer once CUDA is initialized (a watch entered before that misses GPU errors' state)."""
    if not _observing["tracker"]:
        from memlab.sources.tracker import OOM_OBSERVERS

        OOM_OBSERVERS.append(_on_tracker_oom)
        _observing["tracker"] = True
    if not _observing["cuda"] and torch.cuda.is_initialized():
        torch._C._cuda_attach_out_of_memory_observer(_on_cuda_oom)
        _observing["cuda"] = True


def _snapshot_path(directory: str | os.PathLike[str] | None) -> str:
    folder = os.fspath(directory) if directory is not None else os.environ.get("MEMLAB_OOM_DIR")
    folder = folder or tempfile.gettempdir()
    rank = ""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        rank = f"-rank{distributed.get_rank()}"
    return os.path.join(folder, f"memlab-oom{rank}-{os.getpid()}-{next(_files)}.pickle")


class OOMWatch:
    """A context manager and decorator that explains ``torch.OutOfMemoryError`` (see
    :func:`explain_oom`). ``reports`` lists the reports it wrote, ``report`` the last one."""

    def __init__(
        self,
        batch_dim: int | None = None,
        stream: TextIO | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        remedies: bool = True,
    ) -> None:
        if batch_dim is not None and (isinstance(batch_dim, bool) or not isinstance(batch_dim, int)):
            raise TypeError(
                f"batch_dim must be an int dimension >= 0 or None, got {type(batch_dim).__name__} "
                f"{batch_dim!r:.80}"
            )
        if batch_dim is not None and batch_dim < 0:
            raise ValueError(
                f"batch_dim must be an int dimension >= 0 or None (0), got {batch_dim}: the batch "
                "dimension is counted from the front, as the same tensors may have different ranks"
            )
        check_stream(stream)
        if snapshot_dir is not None and (
            isinstance(snapshot_dir, bytes) or not isinstance(snapshot_dir, (str, os.PathLike))
        ):
            raise TypeError(
                "snapshot_dir must be None ($MEMLAB_OOM_DIR, else the temporary directory) or a folder "
                f"path (a str or os.PathLike), got {type(snapshot_dir).__name__} {snapshot_dir!r:.80}"
            )
        if not isinstance(remedies, bool):
            raise TypeError(f"remedies must be True or False, got {type(remedies).__name__} {remedies!r:.80}")
        self.batch_dim = batch_dim
        self.stream = stream
        self.snapshot_dir = snapshot_dir
        self.remedies = remedies
        self.reports: list[OOMReport] = []
        self._entered: list[_Entry] = []

    @property
    def report(self) -> OOMReport | None:
        """The last report this watch wrote, or ``None``."""
        return self.reports[-1] if self.reports else None

    def __enter__(self) -> OOMWatch:
        self._entered.append(self._enter(None))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exit(self._entered.pop(), exc)

    def _enter(self, call: Call | None) -> _Entry:
        _observe()
        entry = _Entry(self, call)
        _entries.append(entry)
        return entry

    def _exit(self, entry: _Entry, exc: BaseException | None) -> None:
        _entries.remove(entry)
        if exc is None and not _pending and not _reported:
            return  # the path without an error: nothing to explain, nothing to forget
        try:
            if isinstance(exc, torch.OutOfMemoryError) and id(exc) not in _reported:
                self._explain(_take(exc, entry) or _cuda_after(exc, entry.call), exc, caught=False)
                _reported.add(id(exc))
            for capture in [c for c in _pending if c.sequence > entry.sequence]:
                _pending.remove(capture)
                self._explain(capture, None, caught=True)
        except Exception as failure:  # the user's error matters more than the explanation
            _say(
                self.stream,
                f"memlab: could not explain the out-of-memory error: {type(failure).__name__}: {failure}\n",
            )
        finally:
            if not _entries:
                _pending.clear()
                _reported.clear()

    def _explain(self, capture: OOMCapture | None, error: BaseException | None, caught: bool) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        from memlab.oom.postmortem import build_report

        path = unwritten = None
        if (
            capture is not None
            and capture.snapshot is not None
            and capture.snapshot.get("segments") is not None
        ):
            from memlab.history.export import write_snapshot

            try:
                path = _snapshot_path(self.snapshot_dir)
                folder = os.path.dirname(path)
                if not os.path.isdir(folder):
                    where = "snapshot_dir" if self.snapshot_dir is not None else "$MEMLAB_OOM_DIR"
                    raise FileNotFoundError(f"no such folder {folder!r} ({where})")
                write_snapshot(capture.snapshot, path)
            except (OSError, ValueError) as failure:  # the report matters more than its snapshot
                unwritten, path = str(failure), None
        trace = sys.gettrace()
        sys.settrace(None)  # nor traced by a line profiler that is on around the watch
        try:
            with _disable_current_modes():  # replays and estimates must not be counted by the user's tracker
                report = build_report(
                    capture, error, caught=caught, snapshot_path=path, remedies=self.remedies
                )
        finally:
            sys.settrace(trace)
        if unwritten is not None:
            report = dataclasses.replace(report, snapshot_error=unwritten)
        self.reports.append(report)
        _last[:] = [report]
        _say(self.stream, report.text() + "\n")

    def __call__(self, func: F) -> F:
        """Watch every call of ``func``; its arguments are the step the remedies estimate."""
        return self.wrap(func)  # type: ignore[return-value]

    def wrap(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` watched call by call; a generator or coroutine function is a ``TypeError`` (watch
        the code that runs it with ``with explain_oom():``)."""
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
            raise TypeError(
                f"explain_oom watches plain functions; for {func.__qualname__} (a generator or coroutine "
                "function) use `with memlab.explain_oom():` around the code that runs it"
            )

        @functools.wraps(func)
        def watched(*args: Any, **kwargs: Any) -> Any:
            entry = self._enter(Call(func, args, kwargs, now_us(), self.batch_dim))
            try:
                result = func(*args, **kwargs)
            except BaseException as error:
                self._exit(entry, error)
                raise
            self._exit(entry, None)
            return result

        return watched


def _say(stream: TextIO | None, text: str) -> None:
    """Write ``text`` to ``stream`` (default ``sys.stderr``), or to ``sys.stderr`` when ``stream``
    fails (closed, full): nothing memlab writes may replace the user's error."""
    try:
        target = stream if stream is not None else sys.stderr
        target.write(text)
        target.flush()
    except Exception as failure:
        if stream is None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.write(f"memlab: could not write to stream ({type(failure).__name__}: {failure}):\n")
            sys.stderr.write(text)


def _take(error: BaseException, entry: _Entry) -> OOMCapture | None:
    """The pending capture of ``error``: the one made for this very exception object, else the
    newest made inside ``entry`` with the same message (an error re-raised as a copy)."""
    for capture in reversed(_pending):
        if capture.error_id == id(error):
            _pending.remove(capture)
            return capture
    message = str(error)
    for capture in reversed(_pending):
        if capture.sequence > entry.sequence and (capture.message == message or not capture.message):
            _pending.remove(capture)
            return capture
    return None


def _cuda_after(error: BaseException, call: Call | None) -> OOMCapture | None:
    """A capture of a GPU error the observer missed (CUDA was initialized after the watch began),
    read as the error leaves the block: ``None`` unless it names a CUDA device this process uses."""
    message = str(error)
    if not message.startswith("CUDA out of memory") or not torch.cuda.is_initialized():
        return None
    match = re.search(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB)\. GPU (\d+)", message)
    if match is None:
        return None
    size = int(float(match.group(1)) * _CUDA_UNITS[match.group(2)])
    device = int(match.group(3))
    free, _total = torch.cuda.mem_get_info(device)
    capture = capture_cuda_oom(device, size, torch.cuda.memory_allocated(device), free, call)
    capture.note = "state read as the error left the watched block (CUDA was initialized inside it)"
    return capture


_CUDA_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def watching(
    func: Any = None, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> _CallWatch:
    """A watch of one call of ``func`` with ``args``/``kwargs`` (``func=None``: of a block), for
    memlab's own wrappers: ``with watching(func, args, kwargs): func(*args, **kwargs)``."""
    return _CallWatch(None if func is None else Call(func, args, kwargs or {}, now_us()))


class _CallWatch:
    __slots__ = ("_call", "_entry")
    _watch: OOMWatch | None = None

    def __init__(self, call: Call | None) -> None:
        self._call = call

    def __enter__(self) -> None:
        if _CallWatch._watch is None:
            _CallWatch._watch = OOMWatch()
        self._entry = _CallWatch._watch._enter(self._call)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        assert _CallWatch._watch is not None
        _CallWatch._watch._exit(self._entry, exc)


@overload
def explain_oom(
    func: F,
    /,
    *,
    batch_dim: int | None = ...,
    stream: TextIO | None = ...,
    snapshot_dir: str | os.PathLike[str] | None = ...,
    remedies: bool = ...,
) -> F: ...
@overload
def explain_oom(
    func: None = None,
    /,
    *,
    batch_dim: int | None = ...,
    stream: TextIO | None = ...,
    snapshot_dir: str | os.PathLike[str] | None = ...,
    remedies: bool = ...,
) -> OOMWatch: ...
def explain_oom(
    func: Any = None,
    /,
    *,
    batch_dim: int | None = None,
    stream: TextIO | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    remedies: bool = True,
) -> Any:
    """Explain every ``torch.OutOfMemoryError`` raised inside a block or a function, then let it go.

    ``with memlab.explain_oom():`` watches a block; ``memlab.explain_oom(step)`` (or
    ``@memlab.explain_oom``) watches each call of ``step``, whose arguments the step remedies use
    (the batch: tensors sharing the size of dimension ``batch_dim``, default 0, at the front).
    Watches are also active inside ``@memlab.profile`` functions, ``LineProfiler`` sessions
    (``with lp:``), ``%mlrun`` and ``memlab run``.

    When the error comes from a :class:`memlab.TensorTracker` with ``capacity`` (or, once CUDA is
    initialized, from the GPU: PyTorch's out-of-memory observer), the state at that moment is
    captured, and when the block ends a report is written to ``stream`` (default ``sys.stderr``):
    the failing ``file:line`` and code, the bytes requested, capacity / reserved / allocated /
    free, the verdict (fragmentation or shortage), the largest live tensors with their
    ``MemReporter`` names, categories, sizes and, with ``history`` on, allocation lines, and
    remedies each with its predicted peak reserved bytes (see :mod:`memlab.oom.postmortem`): a
    remedy marked "fits" runs two training steps within the capacity when applied right after the
    failure, estimated from the allocator state of that moment, which the history rebuilds;
    without one, remedies start from an empty allocator and show a margin instead. With
    a trace (``history`` on, or PyTorch's memory history on a GPU) the memory snapshot is written
    to ``snapshot_dir`` (default ``$MEMLAB_OOM_DIR``, else the temporary directory) as
    ``memlab-oom[-rank<r>]-<pid>-<n>.pickle``, and the report prints its path (or, when it cannot
    be written, e.g. the folder does not exist, why: the rest of the report is written). The error itself
    is re-raised unchanged; an error a ``try`` inside the block swallowed is still explained when
    the block ends. ``remedies=False`` skips the remedies (replays and estimates cost time).

    Arguments are checked here (``TypeError``/``ValueError`` naming them), never at the error:
    nothing memlab does while explaining replaces the user's exception (a failure of its own is
    one line on ``stream``, or on ``sys.stderr`` when ``stream`` itself fails).

    Returns an :class:`OOMWatch` (``func`` omitted) or the watched function. Nothing is printed and
    no statistic is read while no error happens. What it cannot see: errors raised where no
    watch is active, the allocator state of a GPU error raised before CUDA was initialized when
    the watch began (only its traceback and message are then reported), and what the tracker
    cannot see (cuDNN workspaces, the CUDA context, memory allocated outside PyTorch). A GPU's own
    trace does not mark its cuBLAS workspaces, so step remedies estimated from a GPU's state count
    them again (conservative, by their size).
    """
    watch = OOMWatch(batch_dim=batch_dim, stream=stream, snapshot_dir=snapshot_dir, remedies=remedies)
    if func is None:
        return watch
    if not callable(func):
        raise TypeError(
            "explain_oom takes a function to watch (or nothing, as a context manager), "
            f"got {type(func).__name__}"
        )
    return watch.wrap(func)
