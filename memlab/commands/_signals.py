"""How a program run by ``memlab run`` may end without returning, turned into an end it reports.

Clusters stop jobs with signals: SLURM sends SIGTERM at a time limit, Kubernetes at preemption, and
a closed terminal or ``scontrol requeue`` sends SIGHUP. Python's default for both is to die at
once, with no table. While the program runs, :func:`signals_raised` turns them into
:class:`Terminated` raised in the main thread, as Ctrl-C raises ``KeyboardInterrupt``: the
program's ``finally`` blocks run, the table is printed, and the exit status is ``128 + signum``
(143, 129), what a shell reports for a process a signal ended. A script that ends with
``os._exit(n)`` (gloo workers are told to) skips all of that: :func:`os_exit_reported` has
``os._exit`` write the report first, then exit with the same code.
"""

from __future__ import annotations

import contextlib
import operator
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

from memlab._user_code import is_library_file
from memlab.line_profiler.tracer import end_frames

__all__ = ["TERMINATING_SIGNALS", "Terminated", "os_exit_reported", "signals_raised"]

#: The signals a cluster or a terminal sends to stop a job, which ``memlab run`` reports on.
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """The program received ``signum`` (SIGTERM or SIGHUP) while ``memlab run`` ran it. A
    ``BaseException``, as ``KeyboardInterrupt``: ``except Exception`` in the program does not
    swallow it."""

    def __init__(self, signum: int, where: str = "") -> None:
        self.signum = signum
        #: The program's line it arrived at (``at file:line (in function)``), or "".
        self.where = where
        super().__init__(f"{signal.Signals(signum).name} received")

    @property
    def status(self) -> int:
        """The exit status a shell reports for a process ended by the signal: ``128 + signum``."""
        return 128 + self.signum


_MEMLAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEFER_S = 0.01  # when the signal came in memlab's own code: raised in the program's, a moment later


def _is_memlab(filename: str) -> bool:
    """Whether ``filename`` is memlab's code: its package, or code it generates (the tracer's)."""
    return filename.startswith((_MEMLAB, "<memlab"))


def _is_program(filename: str) -> bool:
    """Whether ``filename`` is the program's own code: a file (``memlab run`` runs files) that is
    no library's. Code generated at run time (``<string>``: ``exec``, dataclasses, memlab's
    samplers) belongs to whoever called it."""
    return not filename.startswith("<") and not _is_memlab(filename) and not is_library_file(filename)


def _in_memlab(frame: FrameType | None) -> bool:
    """Whether the innermost frame that is memlab's or the program's is memlab's (libraries and
    generated code skipped): memlab's bookkeeping (a tracker's dispatch, a weakref callback, the
    tracer) is never cut half-way."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_memlab(filename):
            return True
        if _is_program(filename):
            return False
        frame = frame.f_back
    return False


def _where(frame: FrameType | None) -> str:
    """``at file:line (in function)``: the innermost line of the program's own code in ``frame``'s
    stack, the one it was running."""
    while frame is not None:
        if _is_program(frame.f_code.co_filename):
            return f"at {frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name})"
        frame = frame.f_back
    return "outside the program's own code"


@contextlib.contextmanager
def signals_raised(signums: tuple[int, ...] = TERMINATING_SIGNALS) -> Iterator[None]:
    """Raise :class:`Terminated` in the main thread when one of ``signums`` arrives, inside the
    block; restore the handlers that were there before at its end.

    Only a signal left to its default (``SIG_DFL``) gets the handler: one ignored (``nohup``:
    SIGHUP is ``SIG_IGN``) stays ignored, and a Python handler already installed by whoever called
    ``memlab run`` stays theirs. A handler the program installs itself replaces this one and runs
    instead (its choice: exit, or set a flag and finish), until the block ends. A child the
    program forks (DataLoader workers, ``multiprocessing`` with fork) inherits the handler; there
    it restores the default and sends itself the signal again, so it dies as it would have. Outside
    the main thread (where Python cannot install handlers) the block runs as is.

    The exception is raised in the program's code, not in memlab's: a signal that arrives while
    memlab's own code runs (where Python would also drop it, in a weakref callback) is sent again
    10 ms later, until it lands in the program's code. Once raised it is not sent again: the
    program's ``finally`` blocks (a checkpoint being saved) run undisturbed, and a program that
    swallows it (``except BaseException``) goes on, as with Ctrl-C.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()
    lock = threading.Lock()
    done = [False]

    def send_again(signum: int, delay: float) -> None:
        def send() -> None:
            with lock:
                if not done[0]:
                    os.kill(pid, signum)

        timer = threading.Timer(delay, send)
        timer.daemon = True
        timer.start()

    def terminate(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _in_memlab(frame):
            send_again(signum, _DEFER_S)
            return
        raise Terminated(signum, _where(frame))

    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum, handler in previous.items():
        if handler == signal.SIG_DFL:
            signal.signal(signum, terminate)
    try:
        yield
    finally:
        with lock:
            done[0] = True
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def os_exit_reported(report: Callable[[int], None]) -> Iterator[None]:
    """Replace ``os._exit`` inside the block: ``os._exit(n)`` called by the program, in the main
    thread of this process, calls ``report(n)`` first (it writes what ``memlab run`` writes at the
    end), then the real ``os._exit(n)``. If the report fails, or ``os._exit`` is called in another
    thread (the main thread is still running the program: its trackers cannot be exited from
    here), one line on stderr says why there is no table. A forked child (``multiprocessing``
    ends its workers with ``os._exit``) exits at once, as before. A code that is not an integer
    raises the ``TypeError`` the real ``os._exit`` raises, before any report."""
    real = os._exit
    pid = os.getpid()

    def reported_exit(code: int) -> NoReturn:
        try:
            operator.index(code)
        except TypeError:
            real(code)  # raises Python's own TypeError in the program, which goes on: no report yet
        if os.getpid() == pid:
            if threading.current_thread() is not threading.main_thread():
                print(
                    f"memlab run: no table: os._exit({code}) was called in thread "
                    f"{threading.current_thread().name!r}, not the main thread that runs the program",
                    file=sys.stderr,
                )
            else:
                try:
                    end_frames(sys._getframe(1))  # the lines the program is in show what they hold
                    report(code)
                except BaseException as error:  # the process ends here whatever happened
                    print(
                        f"memlab run: no table: os._exit({code}) was called and writing the table failed: "
                        f"{type(error).__name__}: {error}",
                        file=sys.stderr,
                    )
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
        real(code)

    os._exit = reported_exit
    try:
        yield
    finally:
        os._exit = real
