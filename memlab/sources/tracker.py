"""TensorTracker: GPU memory statistics from a run on any device, through PyTorch's dispatcher.

The tracker is a ``TorchDispatchMode``. It sees the outputs of every aten op (forward, backward,
optimizer steps), counts each storage once, when it first appears as a new storage, and learns of
its release through a weak reference on the ``UntypedStorage`` (PyTorch keeps that Python object
alive exactly as long as the C++ storage). Each allocation and release is replayed into a model of
the device's allocator (by default the CUDA caching allocator), so a CPU or ``meta`` run reports the
numbers a GPU would show.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _push_mode

from memlab._autocast import DisabledCudaRegions, unwatch, watch
from memlab._devices import resolve_device
from memlab._tensors import call_roots, check_optimizer, live_storages, storages_of
from memlab._units import parse_size
from memlab.history import categories
from memlab.history.export import allocator_snapshot
from memlab.history.recorder import Stack, capture_stack, is_own_code, make_history
from memlab.history.series import memory_series
from memlab.sources.allocator import CachingAllocatorModel, ExactAllocator
from memlab.sources.modules import ModuleRecorder
from memlab.sources.threads import follow_new_threads, unreachable_threads

if TYPE_CHECKING:
    import pandas as pd

    from memlab.sources.module_table import ModuleTable

__all__ = ["OOM_OBSERVERS", "TensorTracker", "active_tracker", "is_active"]

_ALLOCATORS: dict[str | None, Callable[..., Any]] = {
    "cuda": CachingAllocatorModel,
    None: ExactAllocator,
}
# Ops whose output aliases an input in their schema, yet hand back a storage created just before
# the op outside the dispatcher (``torch.tensor([...])`` builds its data, then calls lift_fresh).
_FRESH_ALIASES = {torch.ops.aten.lift_fresh.default}

_active: list[TensorTracker] = []  # one item per entry, in any thread, innermost last
_active_lock = threading.Lock()
#: Called as ``observer(tracker, storage, nbytes, error)`` when a tracker's modelled allocator raises
#: ``torch.OutOfMemoryError`` for ``storage`` (``nbytes`` bytes; a new storage, or one grown by
#: ``resize_``), before the error leaves the op (:mod:`memlab.oom` captures the state of that
#: moment). Nothing runs otherwise.
OOM_OBSERVERS: list[Callable[[TensorTracker, torch.UntypedStorage, int, torch.OutOfMemoryError], None]] = []
_AT = ("now", "peak")  # the moments by_category can report


def is_active(tracker: TensorTracker) -> bool:
    """Whether ``tracker`` is entered (in any thread)."""
    return any(entered is tracker for entered in _active)


def active_tracker() -> TensorTracker | None:
    """The innermost :class:`TensorTracker` currently entered, or ``None``."""
    return _active[-1] if _active else None


class _StorageRef(weakref.ref):
    """A weak reference to a counted storage that remembers how to release it."""

    __slots__ = ("allocator", "handle", "key", "nbytes")


class _OpKind:
    """What an op's schema says about its outputs, computed once per op."""

    __slots__ = ("aliases", "fresh", "resize", "writes")

    def __init__(self, func: Any) -> None:
        infos = [ret.alias_info for ret in func._schema.returns]
        self.aliases = any(info is not None for info in infos)
        self.writes = any(info is not None and info.is_write for info in infos)
        self.fresh = func in _FRESH_ALIASES
        self.resize = func is torch.ops.aten.resize_.default


def _collect_storages(obj: Any, into: list[torch.UntypedStorage]) -> None:
    """Append the storages of every tensor in ``obj`` (a tensor or nested lists/tuples of them)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor and obj.layout is torch.strided:  # the common case, inline
            into.append(obj.untyped_storage())
        else:
            into.extend(storages_of(obj))
    elif type(obj) is list or type(obj) is tuple:
        for item in obj:
            _collect_storages(item, into)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


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
    with _Warmup():
        torch.empty(0, device="meta")


class TensorTracker(TorchDispatchMode):
    """Count tensor storages as they are created and freed, and model the memory they would take.

    Use it as a context manager around the code to measure. Inside, every storage created by an
    aten op on any device (``cpu``, ``meta``, ``cuda``) is counted once, on the device it lives on;
    views and in-place results of existing storages count zero times; storages that existed before
    the tracker was entered are "pre-existing" and never counted, not even when freed. Releases are
    seen through weak references, also after the ``with`` block ends.

    ``allocator="cuda"`` (default) replays the events through :class:`CachingAllocatorModel`, so
    statistics are those the CUDA caching allocator would report (512 B rounding, 2 MiB / 20 MiB
    segments, caching); ``allocator=None`` counts exact bytes (reserved = allocated = requested).
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
    ``torch.utils.checkpoint``, inside the tracker hide activations from it; autograd then saves
    detached views of the same storages, so values and gradients are unchanged). With
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

    What a tracker cannot see: kernel workspaces (cuBLAS, cuDNN) and temporaries allocated inside a
    single op, the CUDA context, NCCL buffers, memory allocated outside PyTorch's dispatcher
    (``torch.UntypedStorage(n)``, ``torch.from_numpy``, C extensions), ``torch.cuda.empty_cache()``
    calls in the measured code, and backend choices that differ by device (e.g. attention kernels).
    It models one CUDA stream. It keeps no strong reference to any tensor or storage.

    Trackers nest (the innermost one is :func:`active_tracker`). One exited before a mode entered
    after it (out of order) counts nothing from then on; it stays on torch's mode stack, passing
    every op through, until the modes above it are exited.
    """

    def __init__(
        self,
        allocator: str | None = "cuda",
        capacity: int | str | None = None,
        adopt: bool = False,
        history: bool | int | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        modules: bool | None = None,
    ) -> None:
        super().__init__()
        if allocator not in _ALLOCATORS:
            raise ValueError(
                f"allocator must be 'cuda' (the CUDA caching allocator model) or None (exact bytes); "
                f"got {allocator!r}"
            )
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
        self._new_allocator()  # reads PYTORCH_CUDA_ALLOC_CONF now: a bad setting fails here, not in an op
        self._allocators: dict[torch.device, Any] = {}
        self._resumed: Any = None  # the allocator the first device starts from (see resume)
        self._seen: dict[torch.device, None] = {}  # devices of tracked storages, in order
        self._live: dict[int, _StorageRef] = {}
        self._pending: deque[_StorageRef] = deque()
        self._kinds: dict[Any, _OpKind] = {}
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
            watch(self.disabled_cuda_autocast)
        self.threads_not_counted.pop(threading.get_ident(), None)
        if self.adopt_on_enter and not self.adoptions:
            self.adopt()
        if first and self._records_modules():
            self.module_recorder.start()  # type: ignore[union-attr]
        if self.history or self._records_modules():
            saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
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
            self._stop_following = None
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

    def _enter_new_thread(self) -> None:
        """In a thread started while the tracker is active, before its first line (see
        :mod:`memlab.sources.threads`): put the tracker on the thread's dispatch stack for the
        rest of the thread's life, without an entry of its own (the thread cannot be told to
        exit it), so that its ops count while the tracker is active and pass through otherwise."""
        _push_mode(self)
        self._here.inherited = True
        self._inherited.add(threading.current_thread())

    # -- categories -----------------------------------------------------------------------------
    def add_model(self, model: torch.nn.Module) -> None:
        """Categorise ``model``'s parameters (``parameter``), buffers (``buffer``) and their
        gradients (``gradient``) in the history (see :mod:`memlab.history.categories`).

        Only with ``history`` on does anything happen: while the tracker is active a hook on each
        parameter categorises its gradient when backward accumulates it, and :meth:`snapshot` and
        :meth:`by_category` walk the model again. Storages the tracker did not count (created
        before it was entered, without ``adopt``) have no block to categorise. The tracker keeps a
        weak reference to the model.

        Memory per module (:meth:`by_module`) is recorded for the model while the tracker is active
        (unless ``modules=False``); added while active, from then on, its activations from the
        tracker's next entry (the pack hook is installed at entry).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__} {model!r:.80}")
        if all(ref() is not model for ref in self._models):
            self._models.append(weakref.ref(model))
            if self._categorising:
                self._hook_model(model)
            if self._entries and self.module_recorder is not None:
                self.module_recorder.start()

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Categorise the tensors of ``optimizer.state`` as ``optimizer_state`` in the history, after
        each ``step()`` while the tracker is active and at :meth:`snapshot` / :meth:`by_category`.
        Only with ``history`` on; the tracker keeps a weak reference to the optimizer."""
        check_optimizer(optimizer)
        if all(ref() is not optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
            if self._categorising:
                self._hook_optimizer(optimizer)

    @property
    def models(self) -> list[torch.nn.Module]:
        """The models given to :meth:`add_model` (or ``model=``) that are still alive, in order."""
        return [model for model in (ref() for ref in self._models) if model is not None]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers given to :meth:`add_optimizer` (or ``optimizer=``) still alive, in order."""
        return [optimizer for optimizer in (ref() for ref in self._optimizers) if optimizer is not None]

    def _hook_model(self, model: torch.nn.Module | None) -> None:
        if model is None:
            return
        self._categorise_model(model)
        for param in model.parameters():
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._gradient_hook))

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            return
        self._categorise_optimizer(optimizer)
        self._hooks.append(optimizer.register_step_post_hook(self._step_hook))

    def _gradient_hook(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._categorise(param.grad, categories.GRADIENT)

    def _step_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._categorise_optimizer(optimizer)

    def _records_modules(self) -> bool:
        recorder = self.module_recorder
        return recorder is not None and (recorder.discover or bool(self.models))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._categorise(tensor, categories.ACTIVATION)
        if self.module_recorder is not None:
            self.module_recorder.saved(tensor)
        # Not ``tensor`` itself: a saved output would then hold its own grad_fn, a reference cycle
        # through C++ that gc cannot break (the graph and its activations would never be freed).
        return tensor.detach()

    def _categorise_model(self, model: torch.nn.Module) -> None:
        for param in model.parameters():
            self._categorise(param, categories.PARAMETER)
            if param.grad is not None:
                self._categorise(param.grad, categories.GRADIENT)
        for buffer in model.buffers():
            self._categorise(buffer, categories.BUFFER)

    def _categorise_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._categorise(value, categories.OPTIMIZER_STATE)

    def _categorise_known(self) -> None:
        """Categorise what the added models and optimizers hold now."""
        for model_ref in self._models:
            model = model_ref()
            if model is not None:
                self._categorise_model(model)
        for optimizer_ref in self._optimizers:
            optimizer = optimizer_ref()
            if optimizer is not None:
                self._categorise_optimizer(optimizer)

    def _categorise(self, tensor: torch.Tensor, category: str) -> None:
        """Give the blocks of ``tensor``'s counted storages ``category``, unless they have one."""
        storages: list[torch.UntypedStorage] = []
        _collect_storages(tensor, storages)
        for storage in storages:
            self._set_category(storage, category)

    def allocation_context(self, tensor: torch.Tensor) -> tuple[Stack, str] | None:
        """Where the block of ``tensor``'s storage was allocated, and its category:
        ``(stack, category)``, the stack innermost first as ``(filename, line, function name)``
        (torch's and memlab's own frames left out; empty where no Python frame ran) and the
        category one of :data:`memlab.history.categories.CATEGORIES`. For a tensor with several
        storages (sparse, wrapper subclasses), its first. ``None`` with ``history`` off, or for
        a storage the tracker did not count (pre-existing, empty, or made outside the dispatcher).
        """
        _check_tensor(tensor)
        if not self.history:
            return None
        if self._pending:
            self._drain()
        storages: list[torch.UntypedStorage] = []
        _collect_storages(tensor, storages)
        block = self._block_of(storages[0]) if storages else None
        return None if block is None else block[0].block_context(block[1])

    def _set_category(self, storage: torch.UntypedStorage, category: str) -> None:
        block = self._block_of(storage)
        if block is not None:
            block[0].set_category(block[1], category)

    def _block_of(self, storage: torch.UntypedStorage) -> tuple[Any, int] | None:
        """(history, block address) of a counted ``storage``, or ``None`` (not counted, empty, or
        its allocator keeps no history)."""
        ref = self._live.get(id(storage))
        if ref is None or ref.handle is None or ref() is not storage or ref.allocator.history is None:
            return None
        return ref.allocator.history, ref.allocator._extent(ref.handle)[0]

    # -- dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self._entries or self._left_behind:
            return out  # exited (out of order, or before a thread it was inherited by ends): never count
        with self._lock:  # threads run ops at once; the counting state is one
            if self._pending:
                self._drain()
            kind = self._kinds.get(func)
            if kind is None:
                kind = self._kinds[func] = _OpKind(func)
            outputs: list[torch.UntypedStorage] = []
            _collect_storages(out, outputs)
            inputs: set[int] | None = None
            live = self._live
            for storage in outputs:
                ref = live.get(id(storage))
                if ref is not None:
                    if kind.writes and ref.nbytes != storage.nbytes():
                        self._resize(ref, storage)
                elif kind.fresh:
                    self._track(storage)
                elif kind.aliases:
                    if kind.resize:
                        self._track(storage)  # a pre-existing storage grown here: the growth is new
                else:
                    # Some ops alias an input without saying so in their schema (_unsafe_view):
                    # a storage that came in is never new.
                    if inputs is None:
                        found: list[torch.UntypedStorage] = []
                        _collect_storages((args, tuple(kwargs.values()) if kwargs else ()), found)
                        inputs = {id(s) for s in found}
                    if id(storage) not in inputs:
                        self._track(storage)
        return out

    def adopt_from_call(self, frame: FrameType) -> None:
        """:meth:`adopt` the tensors that the call ``frame`` starts can reach without walking
        ``gc``: those its arguments hold (category ``input``), then those held by its function's
        globals and by the local variables of the frames that called it (a tensor made between
        two profiled calls and kept in a global, a model in the training loop's locals). The line
        profiler calls it at each outermost profiled call, from its trace function, where an
        exception would stop the user's program: what cannot be read is skipped."""
        with contextlib.suppress(Exception):
            self.adopt(roots=frame.f_locals.values(), category=categories.INPUT)
        with contextlib.suppress(Exception):
            self.adopt(roots=call_roots(frame, is_own_code))

    def adopt(
        self,
        device: torch.device | str | int | None = None,
        roots: Iterable[object] | None = None,
        category: str | None = None,
    ) -> tuple[int, int]:
        """Count the storages that ``gc`` can reach (or, given ``roots``, that those objects hold:
        see :func:`memlab._tensors.tensors_within`) and the tracker does not know yet as allocated
        now, and their release when it happens, as if the tracker had seen them created.

        On a GPU, memory that existed before profiling (the model, optimizer state, the batch)
        is in the allocator's numbers; adoption puts it into the modelled ones. ``device``
        (default: every device) limits it to one device. Storages are allocated in the model in
        the order ``gc`` lists their tensors, which may fill the cache differently from the
        order they were created in (reserved bytes can then differ from a run tracked from the
        start; allocated and active bytes do not, except where a cached block is handed out
        whole). Returns ``(storages, bytes)`` adopted by this call; bytes as the modelled
        allocator counts them (``allocated_bytes.all``: with the CUDA model, rounded to blocks).

        With ``history`` on, ``category`` (one of :data:`memlab.history.categories.CATEGORIES`)
        is given to the adopted blocks (the line profiler adopts a call's arguments as ``input``);
        another value is a ``ValueError`` before anything is adopted, with or without history.

        Adoption cannot see autograd's saved tensors of a graph alive at that moment, tensors
        held only by C++ code, or memory allocated outside PyTorch's storages. Walking ``gc``
        costs time in proportion to the objects alive (tens of milliseconds with a few hundred
        thousand); walking ``roots`` costs almost nothing.
        """
        if category is not None:
            categories.category_code(category)  # checked before anything is adopted
        if roots is not None and (isinstance(roots, (str, bytes)) or not isinstance(roots, Iterable)):
            raise TypeError(
                f"roots must be None (what gc can reach) or an iterable of objects holding tensors, got "
                f"{type(roots).__name__} {roots!r:.80}"
            )
        if self._pending:
            self._drain()
        wanted = None if device is None else resolve_device(device)
        storages = [
            entry.storage for key, entry in live_storages(wanted, roots).items() if key not in self._live
        ]
        with self._lock:
            before = {d: a.table.stats["allocated_bytes.all"][0] for d, a in self._allocators.items()}
            for storage in storages:
                if id(storage) not in self._live:  # another thread may have counted it meanwhile
                    self._track(storage)
                if category is not None:
                    self._set_category(storage, category)
            adopted = sum(
                a.table.stats["allocated_bytes.all"][0] - before.get(d, 0)
                for d, a in self._allocators.items()
            )
        if storages and self._categorising:
            self._categorise_known()  # an added model's adopted parameters are parameters from now on
        if storages or not self.adoptions:  # the first call is kept: "nothing existed before"
            self.adoptions.append((len(storages), adopted))
        return len(storages), adopted

    def _new_allocator(self) -> Any:
        history = make_history(self.history, capture_stack)
        if history is not None:
            history.free_category = categories.category_code(categories.TEMPORARY)
        return _ALLOCATORS[self.allocator](capacity=self.capacity, history=history)

    def _allocator_for(self, device: torch.device) -> Any:
        allocator = self._allocators.get(device)
        if allocator is None:
            allocator, self._resumed = self._resumed or self._new_allocator(), None
            self._allocators[device] = allocator
        return allocator

    def resume(self, allocator: Any, blocks: Iterable[tuple[torch.UntypedStorage, int]] = ()) -> None:
        """Count on the first device from ``allocator`` as it is (an allocator model with cached
        segments and allocated blocks: a process's state replayed from its history, say) instead
        of a new, empty allocator of the tracker's settings: the allocator's own ``capacity``,
        configuration and history apply, and its statistics go on from where they are.

        Each ``(storage, handle)`` of ``blocks`` is counted as the storage that occupies
        ``allocator``'s allocated block ``handle``: nothing is allocated for it, and the block is
        freed when the storage is. The allocator's other allocated blocks stay allocated (memory
        that no storage the tracker sees holds). Call it before the tracker counts anything;
        ``ValueError`` otherwise, or when the storages are on several devices, or one is
        counted twice."""
        if self._allocators or self._live:
            raise ValueError("resume: the tracker has counted storages already; resume it before it counts")
        self._resumed = allocator
        for storage, handle in blocks:
            if self._allocator_for(storage.device) is not allocator:
                raise ValueError(f"resume: every storage must be on one device; {storage.device} is another")
            if id(storage) in self._live:
                raise ValueError(f"resume: a storage of {storage.nbytes()} bytes was given twice")
            if storage.device not in self._seen:
                self._seen[storage.device] = None
            ref = _StorageRef(storage, self._pending.append)
            ref.allocator, ref.handle, ref.key, ref.nbytes = allocator, handle, id(storage), storage.nbytes()
            self._live[ref.key] = ref

    def _track(self, storage: torch.UntypedStorage, nbytes: int | None = None) -> None:
        """Count ``storage`` as allocated now (``nbytes``: its size, when it is not the storage's own)."""
        if nbytes is None:
            nbytes = storage.nbytes()
        device = storage.device
        allocator = self._allocator_for(device)
        if device not in self._seen:
            self._seen[device] = None
        try:
            handle = allocator.malloc(nbytes) if nbytes else None
        except torch.OutOfMemoryError as error:
            self._out_of_memory(storage, nbytes, error)
            raise
        ref = _StorageRef(storage, self._pending.append)
        ref.allocator, ref.handle, ref.key, ref.nbytes = allocator, handle, id(storage), nbytes
        self._live[ref.key] = ref

    def _resize(self, ref: _StorageRef, storage: torch.UntypedStorage) -> None:
        # The CUDA allocator grows a storage by allocating the new block, copying, then freeing.
        nbytes = storage.nbytes()
        try:
            handle = ref.allocator.malloc(nbytes) if nbytes else None
        except torch.OutOfMemoryError as error:
            self._out_of_memory(storage, nbytes, error)
            raise
        if ref.handle is not None:
            ref.allocator.free(ref.handle)
        ref.handle, ref.nbytes = handle, nbytes

    def _out_of_memory(
        self, storage: torch.UntypedStorage, nbytes: int, error: torch.OutOfMemoryError
    ) -> None:
        for observer in list(OOM_OBSERVERS):
            observer(self, storage, nbytes, error)

    def block_address(self, tensor: torch.Tensor) -> int | None:
        """The address of the modelled block that holds ``tensor``'s (first) storage, as
        :meth:`snapshot` lists it, or ``None`` where the tracker did not count that storage."""
        _check_tensor(tensor)
        if self._pending:
            self._drain()
        storages: list[torch.UntypedStorage] = []
        _collect_storages(tensor, storages)
        ref = self._live.get(id(storages[0])) if storages else None
        if ref is None or ref.handle is None or ref() is not storages[0]:
            return None
        return ref.allocator._extent(ref.handle)[0]

    def block_size(self, tensor: torch.Tensor) -> int | None:
        """The bytes of the modelled block that holds ``tensor``'s (first) storage, as
        ``allocated_bytes`` counts it, or ``None`` where the tracker did not count that storage."""
        _check_tensor(tensor)
        if self._pending:
            self._drain()
        storages: list[torch.UntypedStorage] = []
        _collect_storages(tensor, storages)
        ref = self._live.get(id(storages[0])) if storages else None
        if ref is None or ref.handle is None or ref() is not storages[0]:
            return None
        return ref.allocator.block_size(ref.handle)

    def _drain(self) -> None:
        pending, live = self._pending, self._live
        with self._lock:
            while pending:
                ref = pending.popleft()
                if live.get(ref.key) is ref:
                    del live[ref.key]
                if ref.handle is not None:
                    ref.allocator.free(ref.handle)
                    ref.handle = None

    # -- statistics ---------------------------------------------------------------------------
    def _stats_allocator(self, device: torch.device | str | int | None) -> Any:
        if self._pending:
            self._drain()
        if device is None and len(self._seen) == 1:
            device = next(iter(self._seen))
        return self._allocator_for(resolve_device(device))

    def memory_stats(self, device: torch.device | str | int | None = None) -> dict[str, int]:
        """Allocator statistics of ``device`` with the keys of ``torch.cuda.memory_stats()``.

        Bytes for ``*_bytes.*`` keys, counts otherwise, as the modelled allocator would report
        them for the storages created since the tracker was entered (and those it adopted).
        ``device=None`` is the one device the tracker has seen storages on, or, when it has seen
        none or several, the default device (``torch.get_default_device()``); a device never
        used reads all zeros. The other methods read ``device=None`` the same way.
        """
        return self._stats_allocator(device).memory_stats()

    def sampler(
        self, keys: Sequence[str], device: torch.device | str | int | None = None
    ) -> Callable[[], tuple[int, ...]]:
        """A fast reader of ``keys`` for the line profiler (see ``MemorySource``).

        Each call returns the current values of ``keys``; a ``*.peak`` key reads the highest value
        since the previous call of the same sampler, leaving the user-visible peak untouched.
        """
        return self._stats_allocator(device).table.sampler(keys, self._pending, self._drain)

    def memory_allocated(self, device: torch.device | str | int | None = None) -> int:
        """Bytes currently allocated to tensors on ``device`` (``allocated_bytes.all.current``)."""
        return self.memory_stats(device)["allocated_bytes.all.current"]

    def max_memory_allocated(self, device: torch.device | str | int | None = None) -> int:
        """Peak allocated bytes on ``device`` since entry or the last peak reset."""
        return self.memory_stats(device)["allocated_bytes.all.peak"]

    def memory_reserved(self, device: torch.device | str | int | None = None) -> int:
        """Bytes the modelled allocator holds from the device (``reserved_bytes.all.current``)."""
        return self.memory_stats(device)["reserved_bytes.all.current"]

    def max_memory_reserved(self, device: torch.device | str | int | None = None) -> int:
        """Peak reserved bytes on ``device`` since entry or the last peak reset."""
        return self.memory_stats(device)["reserved_bytes.all.peak"]

    def reset_peak_memory_stats(self, device: torch.device | str | int | None = None) -> None:
        """Set every ``*.peak`` of ``device`` to its current value."""
        self._stats_allocator(device).reset_peak_memory_stats()

    def reset_accumulated_memory_stats(self, device: torch.device | str | int | None = None) -> None:
        """Zero the ``*.allocated`` / ``*.freed`` totals and event counters of ``device``."""
        self._stats_allocator(device).reset_accumulated_memory_stats()

    def empty_cache(self, device: torch.device | str | int | None = None) -> None:
        """Release the modelled cached blocks of ``device``, as ``torch.cuda.empty_cache()`` would."""
        self._stats_allocator(device).empty_cache()

    def snapshot(self, device: torch.device | str | int | None = None) -> dict[str, Any]:
        """The memory snapshot of ``device`` in the format of ``torch.cuda.memory._snapshot()``
        (``device=None`` read as by :meth:`memory_stats`), for PyTorch's viewer and
        ``python -m torch.cuda._memory_viz``: see :func:`memlab.history.export.allocator_snapshot`.

        ``segments`` are the modelled allocator's segments and blocks now (sizes in bytes, their
        total equal to ``reserved_bytes.all.current``); with ``history`` on, each active block
        carries the Python stack that allocated it and ``device_traces`` every recorded event
        (with ``history`` off it is empty). The device index is the device's own (0 for ``cpu``
        and ``meta``, which the snapshot presents as a CUDA device). Stacks leave out torch's
        and memlab's own frames; they cannot name what runs outside Python (C++ autograd
        threads report the Python stack of the thread that triggered them, if any).
        """
        allocator = self._stats_allocator(device)
        if allocator.history is not None:
            self._categorise_known()
        index = next(d for d, a in self._allocators.items() if a is allocator).index
        return allocator_snapshot(allocator, index or 0)

    def by_category(self, device: torch.device | str | int | None = None, at: str = "now") -> dict[str, int]:
        """Bytes of ``device``'s live blocks per category (every name of
        :data:`memlab.history.categories.CATEGORIES`, zeros included; ``device=None`` read as by
        :meth:`memory_stats`). Their sum is ``allocated_bytes.all.current`` (``at="now"``).

        Bytes are the modelled allocator's block sizes (with the CUDA model: 512 B blocks, or a
        whole cached block where one is handed out whole). ``at="now"``: the blocks live now
        (``temporary`` is then 0: a live block is never temporary). ``at="peak"``: the blocks
        live at the highest allocated total since the history began, replayed from the snapshot
        by :func:`memlab.history.series.memory_series` (the same series ``plot_memory`` draws);
        categories learnt after the peak count, and ``temporary`` holds the blocks freed without
        another category.

        Needs ``history`` on (categories live in the history): raises ``ValueError`` without
        it, for an ``at`` other than ``"now"``/``"peak"``, and for ``"peak"`` when a ring buffer
        has dropped entries. What the tracker cannot see (see the class) has no category.
        """
        if at not in _AT:
            raise ValueError(f"at must be one of {', '.join(map(repr, _AT))}; got {at!r}")
        if not self.history:
            raise ValueError(
                "by_category needs TensorTracker(history=True or an int max_entries): categories live there"
            )
        allocator = self._stats_allocator(device)
        history = allocator.history
        self._categorise_known()
        if at == "peak":
            if not history.recorded:  # nothing allocated since the history began: nothing at the peak
                return dict.fromkeys(categories.CATEGORIES, 0)
            if history.recorded != len(history):
                raise ValueError(
                    f"the peak needs the whole history, but the ring buffer (max_entries="
                    f"{history.max_entries}) dropped {history.recorded - len(history)} of "
                    f"{history.recorded} entries; use history=True"
                )
            series = memory_series(allocator_snapshot(allocator))
            peak = dict.fromkeys(categories.CATEGORIES, 0)
            for name, values in series.by_category.items():
                peak[name] = values[series.peak] if values else 0
            return peak
        totals = dict.fromkeys(categories.CATEGORIES, 0)
        for segment in allocator.snapshot():
            for block in segment["blocks"]:
                if block["allocated"]:
                    totals[history.block_context(block["address"])[1]] += block["size"]
        return totals

    def module_table(self, device: torch.device | str | int | None = None) -> ModuleTable:
        """The records behind :meth:`by_module` (``device=None`` read as by :meth:`memory_stats`):
        its ``text()`` and ``html()`` render them highest peak first. ``ValueError`` with
        ``modules=False`` or when the tracker knows no model (``model=``, :meth:`add_model`,
        ``modules=True``)."""
        if not self._records_modules():
            raise ValueError(
                "by_module needs a model: TensorTracker(model=...), tracker.add_model(model), or "
                "TensorTracker(modules=True) to record every model the code calls"
                + ("; this tracker has modules=False" if self.module_recorder is None else "")
            )
        allocator = self._stats_allocator(device)
        return self.module_recorder.table(next(d for d, a in self._allocators.items() if a is allocator))  # type: ignore[union-attr]

    def by_module(self, device: torch.device | str | int | None = None) -> pd.DataFrame:
        """Memory per module of the known models on ``device`` (read as by :meth:`memory_stats`):
        a DataFrame indexed by module path (``named_modules()``: the root ``""``, then
        ``layers.0``, ``layers.0.attn``; a further model's paths after its class name) with
        ``type``, ``calls`` (forward calls), ``forward_peak`` / ``backward_peak`` (the highest
        allocated bytes while that module's forward / backward ran, everything alive counted,
        ``<NA>`` where none ran; the maximum over its calls), ``parameter``, ``gradient``,
        ``optimizer_state`` (the blocks of its own parameters, their gradients and optimizer
        state now; a shared parameter counts in its first module) and ``activation`` (the most
        bytes that ops inside the module, not inside a child, held saved for backward at once).
        Bytes as the modelled allocator counts blocks; storages the tracker did not count are 0.

        A backward runs from the moment the first gradient reaches the module's outputs to the
        moment the gradients of all its positional inputs are computed (to the end of the
        backward pass where its inputs need none). Recorded only while the tracker is active;
        ``ValueError`` as for :meth:`module_table`. See :class:`memlab.sources.modules.ModuleRecorder`
        for what it cannot see."""
        return self.module_table(device).to_dataframe()

    @property
    def devices(self) -> list[torch.device]:
        """The devices on which the tracker has seen storages (or was asked about), in order."""
        return list(self._allocators)


def _check_tensor(tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__} {tensor!r:.80}")
