"""Which memory source measures a target, and the one line that says where the numbers come from.

The rule, the same for the line profiler, the magics, the command line and the reporter:

- a CUDA device that exists here is measured by :class:`~memlab.sources.cuda.CudaSource`
  (``torch.cuda.memory_stats``);
- anything else is modelled by a :class:`~memlab.sources.tracker.TensorTracker` replaying the
  tensors of the measured device through the CUDA caching allocator model: the tracker the user
  entered, or one memlab enters, which adopts the tensors that exist already (:meth:`adopt`);
- an ``int`` target is a GPU index: ``0`` (``target_gpu=0``, pytorch_memlab's default) on a
  machine without any CUDA GPU measures torch's default device, and the line says so; any GPU that
  does not exist here (``7``, ``"cuda:7"``) is a ``ValueError``, never a silent substitution.

:func:`measured_device` is that rule; every entry point that takes a target (``LineProfiler``,
``set_target_gpu``, ``memlab run -g``, ``%mlrun -g``) checks it through :func:`check_target`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from memlab._devices import cuda_device_exists, default_device, parse_device, require_usable, with_index
from memlab._units import format_size
from memlab.sources.base import MemorySource
from memlab.sources.workspace_note import tracker_workspaces, with_note

__all__ = [
    "SOURCE_FORMS",
    "Selection",
    "SourceSelector",
    "check_target",
    "describe_source",
    "measured_device",
    "open_source",
]

Target = torch.device | str | int
SOURCE_FORMS = "None or 'auto', 'cuda', 'tracker', or an object with memory_stats() and sampler()"


def check_target(target: Target, *, name: str = "target_gpu") -> torch.device | int:
    """A target device checked early: an ``int`` stays an ``int`` (``0`` may mean "the default
    device" on a machine without a GPU, decided when profiling starts), anything else becomes a
    ``torch.device`` this machine can use. Raises ``TypeError``/``ValueError`` naming the valid
    forms, or saying that the GPU asked for does not exist here (see :func:`measured_device`)."""
    if isinstance(target, str) and target.strip().isdigit():
        target = int(target)
    device = parse_device(target, name=name)
    if isinstance(target, int):
        measured_device(target, name=name)
        return target
    return require_usable(device, name=name)


def measured_device(target: torch.device | int, *, name: str = "target_gpu") -> tuple[torch.device, bool]:
    """The device a target measures, and whether it is the default device standing in for GPU 0.

    An ``int`` is a CUDA GPU index: ``0`` on a machine without any CUDA GPU is torch's default
    device (``torch.get_default_device()``, read now), ``(device, True)``; a GPU that does not
    exist here is a ``ValueError`` naming ``name``. Anything else is the device itself, with an
    index (``cuda`` is ``cuda:0``), when this machine can use it."""
    if isinstance(target, int):
        if target == 0 and not torch.cuda.is_available():
            return with_index(default_device()), True
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name} {target}: no such GPU (this machine has no CUDA GPU; only index 0, the default, "
                "stands for the default device without one); use 0, 'cpu' or 'meta' to model one"
            )
        target = torch.device("cuda", target)
    return with_index(require_usable(target, name=name)), False


def describe_source(source: Any, device: torch.device | None, fallback: bool = False) -> str:
    """The line that says where numbers come from, e.g. ``measured on cuda:0
    (torch.cuda.memory_stats)`` or ``modelled: CUDA caching allocator replayed from cpu tensors
    (memlab.TensorTracker); 2 tensor storages (40.50K) existed before profiling``. When a tracker
    counted tensors, but none on ``device`` (``target_gpu="meta"`` on a program that works on the
    CPU), it says so and names the devices it did count tensors on. Where the tracker modelled
    cuBLAS workspaces on ``device``, it says how many, of which GPU, and their bytes (``includes 2
    modelled cuBLAS workspaces of the H100: 64.00M``,
    :func:`memlab.sources.workspace_note.workspaces_note`); ``CUBLAS_WORKSPACE_CONFIG=:0:0`` in the
    environment turns them off."""
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
    elsewhere = [] if device is None else _only_elsewhere(source, device)
    if elsewhere:
        text += (
            f"; no tensor was made on {device}, so every byte column is 0: the tensors were on "
            f"{', '.join(map(str, elsewhere))} (measure {elsewhere[0]} to see them)"
        )
    text = with_note(text, tracker_workspaces(source, device))  # CUBLAS_WORKSPACE_CONFIG=:0:0: none
    autocast = source.disabled_cuda_autocast.describe()
    if autocast:
        text += f"; {autocast}"
    names = list(source.threads_not_counted.values())
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        text += f"; ops of threads already running when counting began are not counted ({shown})"
    return text


def _only_elsewhere(tracker: Any, device: torch.device) -> list[torch.device]:
    """The devices ``tracker`` counted tensors on, when it counted none on ``device`` (else [])."""
    counted = [d for d in tracker.devices if tracker.memory_stats(d)["allocated_bytes.all.allocated"]]
    return [] if device in counted else counted


def _storages(count: int) -> str:
    return f"{count} tensor storage{'s' * (count != 1)}"


class Selection:
    """An open memory source: ``source`` to sample, ``device`` to sample it for,
    :meth:`enter_thread` for each thread that profiles, :meth:`describe` for the line that says
    where the numbers come from, and ``on_call`` (or ``None``): what to do at each outermost
    profiled call with its frame (an adopting tracker adopts the tensors its arguments, its
    function's globals and its callers' locals hold)."""

    def __init__(self, source: Any, device: torch.device | None, fallback: bool) -> None:
        from memlab.sources.tracker import TensorTracker

        self.source, self.device, self.fallback = source, device, fallback
        self._tracker = source if isinstance(source, TensorTracker) else None
        adopting = self._tracker is not None and source.adopt_on_enter
        self.on_call: Callable[[FrameType], None] | None = source.adopt_from_call if adopting else None

    def enter_thread(self) -> Callable[[], None]:
        """Make the source see the calling thread, and return what undoes that, to be called in
        the same thread: a tracker is entered here unless it counts this thread already (a dispatch
        mode belongs to the thread that entered it; the first entry adopts, for an adopting
        tracker). Other sources see every thread."""
        tracker = self._tracker
        if tracker is None or (tracker.counts_this_thread() and not tracker.inherited_on_top()):
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
    call, those the call's arguments, its function's globals and its callers' local variables
    hold (:meth:`TensorTracker.adopt_from_call`). A tracker the user entered is used as it is.
    """

    def __init__(self, source: str | MemorySource | None = None) -> None:
        if not (source is None or source in ("auto", "cuda", "tracker") or isinstance(source, MemorySource)):
            raise ValueError(f"source must be {SOURCE_FORMS}; got {source!r}")
        self.source = source
        self._tracker: Any = None

    def open(self, target: torch.device | int) -> Selection:
        """Open the source measuring ``target`` (checked by :func:`check_target`)."""
        from memlab.sources.cuda import CudaSource

        device, fallback = measured_device(target)
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
