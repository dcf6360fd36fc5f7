"""TensorTracker: GPU memory statistics from a run on any device, through PyTorch's dispatcher.

The tracker is a ``TorchDispatchMode``. It sees the outputs of every aten op (forward, backward,
optimizer steps), counts each storage once, when it first appears as a new storage, and learns of
its release through a weak reference on the ``UntypedStorage`` (PyTorch keeps that Python object
alive exactly as long as the C++ storage). Each allocation and release is replayed into a model of
the device's allocator (by default the CUDA caching allocator), so a CPU or ``meta`` run reports the
numbers a GPU would show.

This module holds entering and exiting (threads, torch's mode stack) and the dispatch. The class's
other halves are mixins, one concept each: which of an op's storages are new (:mod:`.storages`),
the modelled device memory (:mod:`.device_memory`), adoption of what existed before
(:mod:`.adoption`), categories and snapshots (:mod:`.categorising`) and the ``torch.cuda``-style
readers (:mod:`.statistics`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections import deque
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from memlab._autocast import DisabledCudaRegions, unwatch, watch
from memlab._gpus import GPU, GpuLike, resolve_gpu
from memlab._offload import interrupts_held
from memlab._units import parse_size
from memlab.history.recorder import make_history
from memlab.sources.adoption import TrackerAdoption
from memlab.sources.categorising import TrackerCategories
from memlab.sources.composites import composite_kernel, run_composite
from memlab.sources.constructors import follow_new_storages
from memlab.sources.device_memory import ALLOCATORS, OOM_OBSERVERS, TrackerDeviceMemory
from memlab.sources.holds import deciding, held, holding, settle
from memlab.sources.modules import ModuleRecorder
from memlab.sources.resizes import follow_resizes, sizes_before
from memlab.sources.statistics import TrackerStatistics
from memlab.sources.storages import OpCounting, OpKind, StorageRef, collect_storages, unpack
from memlab.sources.threads import follow_new_threads, unreachable_threads
from memlab.sources.untraced import pause_for_op, resume
from memlab.sources.workspaces import CublasWorkspaces

__all__ = ["OOM_OBSERVERS", "TensorTracker", "active_tracker", "is_active"]

_active: list[TensorTracker] = []  # one item per entry, in any thread, innermost last
_active_lock = threading.Lock()


def is_active(tracker: TensorTracker) -> bool:
    """Whether ``tracker`` is entered (in any thread)."""
    return any(entered is tracker for entered in _active)


def active_tracker() -> TensorTracker | None:
    """The innermost :class:`TensorTracker` currently entered, or ``None``."""
    return _active[-1] if _active else None


class _Warmup(TorchDispatchMode):
    """A pass-through mode: the first op under any dispatch mode imports ``torch._dynamo``
    (seconds), which must not land in the first profiled line."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _exit_left_behind() -> None:
    """Take off torch's mode stack the trackers exited out of order that are now on its top."""
    stack = _get_current_dispatch_mode_stack()
    while stack and isinstance(stack[-1], TensorTracker) and stack[-1]._left_behind:
        mode = stack.pop()
        mode._left_behind = False
        TorchDispatchMode.__exit__(mode, None, None, None)


@functools.cache
def _warm_up() -> None:
    """Import what the first op under a dispatch mode imports (``torch._dynamo``: hundreds of
    modules, seconds) with Ctrl-C held back until it is done (:func:`memlab._offload.interrupts_held`,
    main thread only): a ``KeyboardInterrupt`` half-way would leave submodules in ``sys.modules``
    whose package is gone. The interrupt is raised after the import, before the tracker is entered."""
    with interrupts_held(), _Warmup():
        torch.empty(0, device="meta")


class TensorTracker(
    TrackerAdoption, TrackerCategories, TrackerDeviceMemory, TrackerStatistics, OpCounting, TorchDispatchMode
):
    """Count tensor storages as they are created and freed, and model the memory they would take.

    Use it as a context manager around the code to measure. Inside, every storage created by an
    aten op on any device (``cpu``, ``meta``, ``cuda``) is counted once, on the device it lives on;
    views and in-place results of existing storages count zero times; storages that existed before
    the tracker was entered are "pre-existing" and never counted, not even when freed. Releases are
    seen through weak references, also after the ``with`` block ends. Resizes are allocations, as
    the CUDA allocator sees them: ``UntypedStorage.resize_`` (FSDP frees and re-gathers parameters
    with it; it bypasses the dispatcher, so the tracker wraps that method while it is active:
    :mod:`memlab.sources.resizes`) to 0 bytes frees the storage's block, to any other size
    allocates a new block before freeing the old one; ops that grow a storage (``resize_``,
    ``out=``) do the same. A pre-existing storage counts from the resize that gives it a new block.

    ``allocator="cuda"`` (default) replays the events through :class:`CachingAllocatorModel`, so
    statistics are those the CUDA caching allocator would report (512 B rounding, 2 MiB / 20 MiB
    segments, caching), on the GPU ``gpu`` names (:func:`memlab._gpus.resolve_gpu`: a name such as
    ``"A100"``, a compute capability ``"sm90"`` or ``(9, 0)``; default: the GPU in use on a machine
    with CUDA, else :data:`memlab._gpus.DEFAULT_GPU`, an H100), kept as :attr:`gpu`: for tensors
    that are not on a real GPU (a CPU or ``meta`` run, fake tensors), the first op that takes a
    cuBLAS handle on a (device, stream, thread) allocates that GPU's cuBLAS workspace in the model,
    as PyTorch does, and keeps it (category ``workspace``; :mod:`memlab.sources.workspaces`, whose
    :class:`~memlab.sources.workspaces.CublasWorkspaces` is :attr:`workspaces`). On a real GPU the
    GPU's allocator holds it, and the tracker allocates none. ``allocator=None`` counts exact bytes
    (reserved = allocated = requested) and models no GPU.
    ``capacity`` (bytes or a string such as ``"8 GiB"``) is every device's total memory: an op whose
    result would not fit raises ``torch.OutOfMemoryError`` where the modelled GPU would.
    ``adopt=True`` counts, at the first entry, the tensors that already exist and that ``gc`` can
    reach (:meth:`adopt`), as a GPU's own numbers would include them; memlab's profilers enter
    their trackers that way, and at each profiled call also adopt what its arguments, its
    function's globals and its callers' locals hold (the next batch, made between calls:
    :meth:`adopt_from_call`). With ``adopt=False`` (default) storages that existed before
    entry are never counted.

    ``history=True`` (or an int ``max_entries``, a ring buffer) records every allocation and
    release with its Python stack (:meth:`snapshot`) and the category of each block
    (:mod:`memlab.history.categories`): ``model`` and ``optimizer`` (or :meth:`add_model`,
    :meth:`add_optimizer`) name parameters, buffers, gradients and optimizer state; tensors saved
    for backward are activations, seen through a ``saved_tensors_hooks`` pack hook the tracker
    installs while active (only the innermost pair of hooks applies: a user's own hooks, or
    ``torch.utils.checkpoint``, inside the tracker hide activations from it; autograd then keeps
    leaves as they are and detached views of the rest, so values and gradients are unchanged). With
    ``history`` off none of this runs.

    Memory per module (:meth:`by_module`): while the tracker is active and knows a model, PyTorch's
    global module hooks and gradient hooks record each module's forward and backward peaks and
    the activations it saves (:mod:`memlab.sources.modules`; the pack hook above is installed for
    it, with or without history). ``modules=True`` also records the models the code calls that
    the tracker was not given (each module called while no known model runs forward);
    ``modules=False`` records none.

    Threads: a dispatch mode belongs to the thread that entered it. The tracker also counts the ops
    of every thread started through :mod:`threading` while it is active (it enters them before
    their first line, :mod:`memlab.sources.threads`); such a thread still running after the tracker
    exits keeps it on its stack, passing ops through uncounted (a few microseconds each) until it
    is entered again or the thread ends. It can be entered in several threads at once, each
    exiting its own entry. Threads that were already running when it was entered (a thread pool
    made before) are not counted: :attr:`threads_not_counted` names those that are not daemons.
    Activations of other threads are not categorised in the history.

    What a tracker cannot see: cuBLAS workspaces on a real GPU (the GPU's allocator holds them),
    cuDNN workspaces and temporaries allocated inside a single op, the CUDA context, NCCL buffers
    and what collectives allocate in C++ (gloo's reduce-scatter copies its input), memory allocated
    outside PyTorch's dispatcher and the storage constructor (``torch.from_numpy``, C extensions;
    storages made with ``torch.UntypedStorage(n)``, ``storage.clone()`` or ``copy.deepcopy`` do
    count: :mod:`memlab.sources.constructors`),
    storages resized while it is not active or by C++ code, ``torch.cuda.empty_cache()`` calls in
    the measured code, and backend choices that differ by device (e.g. attention kernels).
    It models one CUDA stream. It keeps no strong reference to any tensor or storage.

    Grad modes: under ``torch.inference_mode()`` composite ops (``linear``, ``layer_norm``) reach
    the tracker whole; it runs their decomposition, so it counts the ops, temporaries and cuBLAS
    workspace it counts with autograd on (:mod:`memlab.sources.composites`).

    Trackers nest (the innermost one is :func:`active_tracker`). A request an inner tracker with a
    ``capacity`` refuses is counted by none of the trackers outside it (:mod:`memlab.sources.holds`).
    One exited before a mode entered after it (out of order) counts nothing from then on; it stays
    on torch's mode stack, passing every op through, until the modes above it are exited.
    """

    def __init__(
        self,
        allocator: str | None = "cuda",
        capacity: int | str | None = None,
        adopt: bool = False,
        history: bool | int | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        gpu: GpuLike | None = None,
        modules: bool | None = None,
    ) -> None:
        super().__init__()
        if allocator not in ALLOCATORS:
            raise ValueError(
                f"allocator must be 'cuda' (the CUDA caching allocator model) or None (exact bytes); "
                f"got {allocator!r}"
            )
        if gpu is not None and allocator is None:
            raise ValueError(f"gpu={gpu!r} needs allocator='cuda': allocator=None models no GPU")
        self._gpu: GPU | None = None if gpu is None else resolve_gpu(gpu)  # a bad name fails here
        self._workspaces: CublasWorkspaces | None = None
        if not isinstance(adopt, bool):
            raise TypeError(f"adopt must be True or False, got {type(adopt).__name__} {adopt!r}")
        if modules is not None and not isinstance(modules, bool):
            raise TypeError(
                f"modules must be None (the known models), True (also those called) or False, got "
                f"{type(modules).__name__} {modules!r:.80}"
            )
        #: What :meth:`by_module` reads (``None`` with ``modules=False``).
        self.module_recorder = None if modules is False else ModuleRecorder(self, discover=modules is True)
        self.allocator = allocator
        self.adopt_on_enter = adopt
        #: ``(storages, bytes)`` adopted by each call of :meth:`adopt` that found any, in order.
        self.adoptions: list[tuple[int, int]] = []
        #: Where counting began, when the one who entered the tracker knows (``memlab run``: "the
        #: program's first line"); the line that says where numbers come from repeats it.
        self.counted_from: str | None = None
        if history is not None and not isinstance(history, (bool, int)):
            raise TypeError(
                f"history must be None, False, True or an int max_entries > 0, got {type(history).__name__} "
                f"{history!r}"
            )
        make_history(history)  # a bad max_entries fails here
        #: ``None``/``False`` (no history), ``True`` (unbounded) or ``max_entries`` per device.
        self.history = history
        self.capacity = None if capacity is None else parse_size(capacity, name="capacity")
        self._limited = self.capacity is not None  # can refuse a request (or a resumed allocator can)
        self._refused: Any = lambda: None  # a weak reference to the storage of the last request refused
        self._new_allocator()  # reads PYTORCH_CUDA_ALLOC_CONF now: a bad setting fails here, not in an op
        self._allocators: dict[torch.device, Any] = {}
        self._resumed: Any = None  # the allocator the first device starts from (see resume)
        self._resumed_workspaces = 0  # how many workspaces it holds
        self._seen: dict[torch.device, None] = {}  # devices of tracked storages, in order
        self._live: dict[int, StorageRef] = {}
        self._pending: deque[StorageRef] = deque()
        self._kinds: dict[int, OpKind] = {}
        self._models: list[weakref.ref[torch.nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._hooks: list[Any] = []  # removable handles of the hooks that categorise, while active
        self._categorising = False  # history on and the tracker active: the hooks above are in place
        self._entries = 0  # entries not yet exited, all threads together
        # entered: this thread's entries; saved: their saved_tensors_hooks; inherited: on its stack
        # since the thread started (threads die, their idents are reused: not a set of idents)
        self._here = threading.local()
        self._inherited: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._lock = threading.RLock()  # the counting state, shared by every thread that counts
        self._stop_following: Any = None
        self._stop_resizes: Any = None
        self._stop_constructors: Any = None
        #: Names of the threads (not daemons) that were running when the tracker became active and
        #: whose ops it does not count, by thread ident (see the class docstring).
        self.threads_not_counted: dict[int, str] = {}
        self._left_behind = False  # exited out of order, still on torch's mode stack
        #: The ``torch.autocast("cuda")`` regions that ran disabled here (PyTorch without CUDA).
        self.disabled_cuda_autocast = DisabledCudaRegions(self.counts_this_thread)
        if model is not None:
            self.add_model(model)
        if optimizer is not None:
            self.add_optimizer(optimizer)

    # -- context management ---------------------------------------------------------------
    def __enter__(self) -> TensorTracker:
        _warm_up()
        _exit_left_behind()
        if self._left_behind:
            raise RuntimeError(
                "this TensorTracker was exited before a dispatch mode entered after it, which is still "
                "active; exit that mode before entering the tracker again"
            )
        if self.inherited_on_top():
            self._leave_inherited()
        super().__enter__()
        here = self._here
        here.entered = getattr(here, "entered", 0) + 1
        with _active_lock:
            _active.append(self)
            first = self._entries == 0
            self._entries += 1
        if first:
            self.threads_not_counted.update(unreachable_threads(self._inherited))
            self._stop_following = follow_new_threads(self._enter_new_thread)
            self._stop_resizes = follow_resizes(self._storage_resized)
            self._stop_constructors = follow_new_storages(self._storage_made)
            watch(self.disabled_cuda_autocast)
        self.threads_not_counted.pop(threading.get_ident(), None)
        if self.adopt_on_enter and not self.adoptions:
            self.adopt()
        if first and self._records_modules():
            self.module_recorder.start()  # type: ignore[union-attr]
        if self.history or self._records_modules():
            saved = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)
            saved.__enter__()
            here.saved = [*getattr(here, "saved", ()), saved]
            if first:
                self._categorising = True
                for ref in self._models:
                    self._hook_model(ref())
                for ref in self._optimizers:
                    self._hook_optimizer(ref())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        here = self._here
        if not getattr(here, "entered", 0):
            raise RuntimeError(
                "TensorTracker.__exit__ in a thread that did not enter it: a dispatch mode belongs "
                "to the thread that entered it, so each thread exits its own entries"
            )
        here.entered -= 1
        if getattr(here, "saved", None):
            here.saved.pop().__exit__(*exc_info)
        with _active_lock:
            _active.remove(self)
            self._entries -= 1
            last = self._entries == 0
        if last:
            self._stop_following()
            self._stop_resizes()
            self._stop_constructors()
            self._stop_following = self._stop_resizes = self._stop_constructors = None
            unwatch(self.disabled_cuda_autocast)
            if self.module_recorder is not None:
                self.module_recorder.stop()
            self._categorising = False
            while self._hooks:
                self._hooks.pop().remove()
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is not self and any(mode is self for mode in stack):
            self._left_behind = True  # exited out of order: taken off when the modes above it are
            return
        super().__exit__(*exc_info)
        _exit_left_behind()

    def counts_this_thread(self) -> bool:
        """Whether the ops of the calling thread reach the tracker: it was entered in this thread
        (and not exited), or this thread started while it was active. They count while the
        tracker is active."""
        here = self._here
        return getattr(here, "entered", 0) > 0 or getattr(here, "inherited", False)

    def inherited_on_top(self) -> bool:
        """Whether the calling thread counts only because it started while the tracker was active
        (:meth:`_enter_new_thread`), with the tracker on top of its dispatch mode stack: entering
        it there replaces that push by an entry of its own."""
        here = self._here
        if getattr(here, "entered", 0) or not getattr(here, "inherited", False):
            return False
        stack = _get_current_dispatch_mode_stack()
        return bool(stack) and stack[-1] is self

    def _leave_inherited(self) -> None:
        """Take the push of :meth:`_enter_new_thread` off the calling thread's stack (it is on top).
        The thread enters the tracker then, and its exit takes the tracker off its stack: calls that
        overlap in several threads, in either order, leave no tracker on any thread's stack once
        they have all returned (only a thread can change its own stack, and a thread that exits
        its call while another thread's call goes on would otherwise keep the tracker for good).
        From then on the thread's ops count inside its own entries only."""
        _pop_mode()
        self._here.inherited = False
        self._inherited.discard(threading.current_thread())

    def _enter_new_thread(self) -> None:
        """In a thread started while the tracker is active, before its first line (see
        :mod:`memlab.sources.threads`): put the tracker on the thread's dispatch stack for the
        rest of the thread's life, without an entry of its own (the thread cannot be told to
        exit it), so that its ops count while the tracker is active and pass through otherwise."""
        _push_mode(self)
        self._here.inherited = True
        self._inherited.add(threading.current_thread())

    # -- dispatch ---------------------------------------------------------------------------
    #: What runs an op below the tracker: ``None``, the op itself (the modes below it dispatch it);
    #: a subclass may set ``below(func, types, args, kwargs)``, which calls the handler of the mode
    #: below directly (that mode is then off the stack): one Python mode fewer per op.
    _below: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        trace = _gettrace()
        if trace is not None:  # a line profiler's trace is off in here (sources/untraced.py)
            if pause_for_op(trace, func, types):
                try:
                    return _dispatch(self, func, types, args, kwargs)  # this method, untraced
                finally:
                    resume(trace)
        kind = self._kinds.get(id(func))  # by id: an OpOverload hashes in Python
        if kind is None or kind.func is not func:
            kind = self._kinds[id(func)] = OpKind(func)
        if kind.composite and self._entries and not self._left_behind:
            # Under inference mode: decomposed here, seen as with autograd on (sources/composites.py)
            kernel = composite_kernel(func, args, kwargs)
            if kernel is not None:
                return run_composite(self, kernel, args, kwargs)
        before = sizes_before(kind.grows, args, kwargs, collect_storages) if kind.grows else None
        if not self._limited:
            below = self._below
            out = func(*args, **(kwargs or {})) if below is None else below(func, types, args, kwargs)
            if not self._entries or self._left_behind:
                return out  # exited (out of order, or before a thread it was inherited by ends): never count
            if deciding():  # a tracker above with a capacity decides first (sources/holds.py)
                held(functools.partial(self._count_op, kind, func, args, kwargs, out, before))
            else:
                self._count_op(kind, func, args, kwargs, out, before, None)
            return out
        with holding() as frame:
            try:
                below = self._below
                out = func(*args, **(kwargs or {})) if below is None else below(func, types, args, kwargs)
            except BaseException:
                settle(frame)
                raise
        try:
            if self._entries and not self._left_behind:
                self._count_op(kind, func, args, kwargs, out, before, None)
        except torch.OutOfMemoryError:
            settle(frame, self._refused())
            raise
        settle(frame)
        return out

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was just resized (:mod:`memlab.sources.resizes`), in any thread: count it
        where this thread's ops reach the tracker (it is on the thread's dispatch mode stack, as
        in autograd's own threads, not only in those that entered it)."""
        if not self._entries or self._left_behind:
            return
        if any(mode is self for mode in _get_current_dispatch_mode_stack()):
            self._count_resize(storage)

    def _storage_made(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was just made from Python, outside the dispatcher (``copy.deepcopy``,
        ``UntypedStorage(n)``, ``storage.clone()``: :mod:`memlab.sources.constructors`), in any
        thread: count it once, where this thread's ops reach the tracker."""
        if not self._entries or self._left_behind:
            return
        if any(mode is self for mode in _get_current_dispatch_mode_stack()):
            with self._lock:
                if self._pending:
                    self._drain()
                if id(storage) not in self._live:
                    self._track(storage)


#: ``TensorTracker.__torch_dispatch__`` without the ``torch._disable_dynamo`` wrapper PyTorch puts on
#: it: what the method calls once it has paused a line profiler's trace.
_dispatch = inspect.unwrap(TensorTracker.__torch_dispatch__)
_gettrace = sys.gettrace
