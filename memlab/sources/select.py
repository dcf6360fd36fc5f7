"""Which memory source measures a target, and the one line that says where the numbers come from.

The rule, the same for the line profiler, the magics, the command line and the reporter:

- a CUDA device that exists here is measured by :class:`~memlab.sources.cuda.CudaSource`
  (``torch.cuda.memory_stats``);
- anything else is modelled by a :class:`~memlab.sources.tracker.TensorTracker` replaying the
  tensors of the measured device through the CUDA caching allocator model: the tracker the user
  entered, or one memlab enters, which adopts the tensors that exist already (:meth:`adopt`);
- an ``int`` target (``target_gpu=0``, pytorch_memlab's default) on a machine without any CUDA
  GPU measures torch's default device, and the line says so; a CUDA device named explicitly that
  does not exist is a ``ValueError``, never a silent substitution.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from memlab._devices import cuda_device_exists, parse_device, require_usable, with_index
from memlab._units import format_size
from memlab.sources.base import MemorySource

__all__ = [
    "SOURCE_FORMS",
    "Selection",
    "SourceSelector",
    "check_target",
    "describe_source",
    "open_source",
]

Target = torch.device | str | int
SOURCE_FORMS = "None or 'auto', 'cuda', 'tracker', or an object with memory_stats() and sampler()"


def check_target(target: Target, *, name: str = "target_gpu") -> torch.device | int:
    """A target device checked early: an ``int`` stays an ``int`` (it may mean "the default device"
    on a machine without a GPU, decided when profiling starts), anything else becomes a
    ``torch.device`` this machine can use. Raises ``TypeError``/``ValueError`` naming the valid
    forms, or saying that the GPU asked for does not exist here."""
    if isinstance(target, str) and target.strip().isdigit():
        target = int(target)
    device = parse_device(target, name=name)
    if isinstance(target, int):
        if torch.cuda.is_available():
            require_usable(device, name=name)
        return target
    return require_usable(device, name=name)


def _measured(target: torch.device | int) -> tuple[torch.device, bool]:
    """(device measured, whether an int target fell back to the default device: no GPU here)."""
    if isinstance(target, int):
        if not torch.cuda.is_available():
            return with_index(torch.get_default_device()), True
        target = torch.device("cuda", target)
    return with_index(require_usable(target, name="target_gpu")), False


def describe_source(source: Any, device: torch.device | None, fallback: bool = False) -> str:
    """The line that says where numbers come from, e.g. ``measured on cuda:0
    (torch.cuda.memory_stats)`` or ``modelled: CUDA caching allocator replayed from cpu tensors
    (memlab.TensorTracker); 2 tensor storages (40.50K) existed before profiling``."""
    from memlab.sources.cuda import CudaSource
    from memlab.sources.tracker import TensorTracker

    where = "the default device" if device is None else str(device)
    if isinstance(source, CudaSource):
        return f"measured on {where} (torch.cuda.memory_stats)"
    if not isinstance(source, TensorTracker):
        return f"read from {type(source).__name__} for {where}"
    kind = where if device is None else f"{device.type} tensors"
    modelled = "modelled (no CUDA GPU here)" if fallback else "modelled"
    estimated = getattr(source, "estimated", None)  # memlab.estimate's tracker says how it ran
    if estimated is not None:
        modelled = f"estimated ({estimated}; memlab.estimate)"
    if source.allocator == "cuda":
        text = f"{modelled}: CUDA caching allocator replayed from {kind} (memlab.TensorTracker)"
    else:
        text = f"{modelled}: exact bytes of {kind} (memlab.TensorTracker(allocator=None))"
    if source.adoptions:
        (storages, nbytes), later = source.adoptions[0], sum(n for n, _ in source.adoptions[1:])
        if storages:
            text += f"; {_storages(storages)} ({format_size(nbytes)}) existed before profiling"
        else:
            text += "; no tensors existed before profiling"
        if later:
            text += f", {later} more {'was' if later == 1 else 'were'} adopted at later calls"
    elif source.counted_from is not None:
        text += f"; counted from {source.counted_from}"
    elif not source.adopt_on_enter:
        text += "; tensors made before the tracker was entered are not counted"
    names = list(source.threads_not_counted.values())
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        text += f"; ops of threads already running when counting began are not counted ({shown})"
    return text


def _storages(count: int) -> str:
    return f"{count} tensor storage{'s' * (count != 1)}"


class Selection:
    """An open memory source: ``source`` to sample, ``device`` to sample it for,
    :meth:`enter_thread` for each thread that profiles, :meth:`describe` for the line that says
    where the numbers come from, and ``on_call`` (or ``None``): what to do at each outermost
    profiled call with its frame (an adopting tracker adopts the tensors its arguments hold)."""

    def __init__(self, source: Any, device: torch.device | None, fallback: bool) -> None:
        from memlab.sources.tracker import TensorTracker

        self.source, self.device, self.fallback = source, device, fallback
        self._tracker = source if isinstance(source, TensorTracker) else None
        adopting = self._tracker is not None and source.adopt_on_enter
        self.on_call: Callable[[FrameType], None] | None = source.adopt_arguments if adopting else None

    def enter_thread(self) -> Callable[[], None]:
        """Make the source see the calling thread, and return what undoes that, to be called in
        the same thread: a tracker is entered here unless it counts this thread already (a dispatch
        mode belongs to the thread that entered it; the first entry adopts, for an adopting
        tracker). Other sources see every thread."""
        tracker = self._tracker
        if tracker is None or tracker.counts_this_thread():
            return _nothing
        tracker.__enter__()
        return lambda: tracker.__exit__(None, None, None)

    def describe(self) -> str:
        """See :func:`describe_source` (read when asked: adoption counts grow between sessions)."""
        return describe_source(self.source, self.device, self.fallback)


def _nothing() -> None:
    return None


def open_source(device: torch.device) -> Any:
    """The source already measuring ``device``, starting nothing: a
    :class:`~memlab.sources.cuda.CudaSource` for a CUDA device that exists, else the active
    :class:`~memlab.sources.tracker.TensorTracker`, else ``None`` (nothing measures it)."""
    from memlab.sources.cuda import CudaSource
    from memlab.sources.tracker import active_tracker

    if cuda_device_exists(device):
        return CudaSource(device)
    return active_tracker()


class SourceSelector:
    """Opens the memory source for a target each time profiling starts.

    ``source`` is ``None``/``"auto"`` (the rule in the module docstring), ``"cuda"``, ``"tracker"``
    or a ``MemorySource`` used as it is (a ``TensorTracker`` is entered in each thread that
    profiles where it does not count already: :meth:`Selection.enter_thread`). A tracker memlab
    creates is kept between sessions (memory a profiled call keeps is still counted at the next
    call); it adopts the tensors ``gc`` can reach at its first session and, at every profiled
    call, those the call's arguments hold. A tracker the user entered is used as it is.
    """

    def __init__(self, source: str | MemorySource | None = None) -> None:
        if not (source is None or source in ("auto", "cuda", "tracker") or isinstance(source, MemorySource)):
            raise ValueError(f"source must be {SOURCE_FORMS}; got {source!r}")
        self.source = source
        self._tracker: Any = None

    def open(self, target: torch.device | int) -> Selection:
        """Open the source measuring ``target`` (checked by :func:`check_target`)."""
        from memlab.sources.cuda import CudaSource

        device, fallback = _measured(target)
        exists = cuda_device_exists(device)
        source = self.source
        if source == "cuda" or (source in (None, "auto") and exists):
            if not exists:
                have = "has no CUDA GPU" if not torch.cuda.is_available() else "does not have it"
                raise ValueError(
                    f"source='cuda' reads a CUDA GPU's own statistics, but the target is {device} "
                    f"and this machine {have}; use source=None or 'tracker' to model the GPU's numbers"
                )
            return Selection(CudaSource(device), device, False)
        from memlab.sources.tracker import TensorTracker, active_tracker

        # A tracker is entered by each thread that profiles (Selection.enter_thread), not here.
        if source not in (None, "auto", "tracker"):
            return Selection(source, device, fallback)
        tracker = active_tracker()
        if tracker is not None:
            return Selection(tracker, device, fallback)
        if self._tracker is None:
            self._tracker = TensorTracker(adopt=True)
        return Selection(self._tracker, device, fallback)
