"""Memory per module: the highest allocated bytes while each module's forward and backward ran, and
the activations each module saved, recorded for a :class:`~memlab.sources.tracker.TensorTracker`.

While the tracker is active, PyTorch's global module hooks (``register_module_forward_pre_hook``,
``register_module_forward_hook(always_call=True)``) open and close each module's forward, and
gradient hooks on the tensors of that call open and close its backward: a hook on its outputs fires
when the first of their gradients is about to flow into the module (the backward begins), hooks on
its inputs when the gradients of all of them have come out (it ends). No module is wrapped and the
autograd graph is not changed: the hooks only read. At each of these moments the tracker's
allocated bytes are sampled (the highest since the previous moment, from the allocator model's own
window, as the line profiler reads it), so a module's peak is exact without a hook per op. The
module a tensor saved for backward belongs to is the innermost module whose forward was running when
autograd packed it (the tracker's ``saved_tensors_hooks``). :meth:`ModuleRecorder.table` turns the
records into a :class:`~memlab.sources.module_table.ModuleTable`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

from memlab._tensors import storages_of
from memlab.sources.module_paths import ModulePaths
from memlab.sources.module_table import ModuleRow, ModuleTable
from memlab.sources.untraced import untraced

__all__ = ["ModuleRecord", "ModuleRecorder"]

_KEYS = ("allocated_bytes.all.peak", "allocated_bytes.all.current")


class ModuleRecord:
    """What was recorded for one module path, per device (bytes as the tracker's allocator counts
    them): the highest allocated bytes while its forward (``forward_peak``) and its backward
    (``backward_peak``) ran, its forward ``calls``, and the bytes of the tensors it saved for
    backward: alive now (``saved``) and the most alive at once (``activation``)."""

    __slots__ = ("activation", "backward_peak", "calls", "forward_peak", "path", "saved", "type")

    def __init__(self, path: str, type_name: str) -> None:
        self.path = path
        self.type = type_name
        self.calls = 0
        self.forward_peak: dict[torch.device, int] = {}
        self.backward_peak: dict[torch.device, int] = {}
        self.saved: dict[torch.device, int] = {}
        self.activation: dict[torch.device, int] = {}


class _Run:
    """A forward or backward of one module, running: the highest allocated bytes so far, per device."""

    __slots__ = ("backward", "call", "key", "peaks", "record", "thread")

    def __init__(
        self, record: ModuleRecord, backward: bool, key: int, peaks: dict[torch.device, int]
    ) -> None:
        self.record = record
        self.backward = backward
        self.key = key  # id of the module (forward) or of its call (backward)
        self.peaks = peaks
        self.thread = threading.get_ident()
        self.call: _Call | None = None  # a forward's call, once its inputs carry hooks


class _Call:
    """One forward call of a module, as its backward hooks need it: the record, the graph task
    whose backward of it runs (``task``, ``run``), the inputs whose gradients have come out in that
    task, and the handles of the hooks on its tensors (removed when the tracker stops)."""

    __slots__ = ("__weakref__", "done", "handles", "inputs", "record", "run", "task")

    def __init__(self, record: ModuleRecord) -> None:
        self.record = record
        self.inputs = 0
        self.done: set[int] = set()
        self.task: int | None = None
        self.run: _Run | None = None
        self.handles: list[Any] = []


class ModuleRecorder:
    """Records memory per module for ``tracker`` between :meth:`start` and :meth:`stop` (the
    tracker calls them as it becomes active and inactive; records are kept across entries).

    Modules are named by their path in a model the tracker knows (``tracker.models``), as
    :class:`~memlab.sources.module_paths.ModulePaths` names them (the first model's root ``""``,
    further models' after their class name). With ``discover``, a module called while no module
    of a model runs forward becomes a model itself (``memlab run --by-module``). Other modules are
    not recorded: their memory counts in the module that called them.

    A forward run again during backward (activation checkpointing's recomputation) is no forward
    call: its memory counts in the backward of the modules whose backward runs.

    What it cannot see: a module compiled with ``torch.compile`` (its hooks are skipped while
    compiling), inputs given to a module as keyword arguments (its backward then ends with the
    whole backward pass), and modules run by threads the tracker does not count.
    """

    def __init__(self, tracker: Any, discover: bool = False) -> None:
        self._tracker = tracker
        #: The paths modules are recorded under.
        self.paths = ModulePaths(lambda: tracker.models, discover)
        #: One record per module path, in the order modules were first seen.
        self.records: dict[str, ModuleRecord] = {}
        self._open: list[_Run] = []
        self._samplers: dict[torch.device, Callable[[], tuple[int, ...]]] = {}
        self._current: dict[torch.device, int] = {}
        self._saved: dict[int, tuple[weakref.ref[torch.UntypedStorage], ModuleRecord, torch.device, int]] = {}
        self._weights: set[int] = set()  # ids of the storages of the models' parameters and buffers
        self._calls: weakref.WeakSet[_Call] = weakref.WeakSet()  # calls whose tensors carry hooks
        self._handles: list[Any] = []
        self._end_queued: int | None = None  # the graph task whose end is awaited
        self._lock = threading.RLock()
        self.active = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Install the global module hooks (once; nothing happens when started already)."""
        if self.active:
            return
        self.active = True
        with self._lock:
            self._sample()
        self._handles = [
            register_module_forward_pre_hook(self._forward_begins),
            register_module_forward_hook(self._forward_ends, always_call=True),
        ]

    def stop(self) -> None:
        """Remove every hook (the global ones and those on tensors of calls not yet backpropagated)
        and end the runs still open, their peaks kept."""
        if not self.active:
            return
        self.active = False
        while self._handles:
            self._handles.pop().remove()
        for call in list(self._calls):
            while call.handles:
                call.handles.pop().remove()
        with self._lock:
            self._sample()
            for run in list(self._open):
                self._close(run)
            self._samplers.clear()  # a sampler's window slows the tracker's other samplers while alive
            self._end_queued = None

    # -- names ---------------------------------------------------------------------------------
    @property
    def discover(self) -> bool:
        """Whether models the code calls that the tracker was not given are recorded too."""
        return self.paths.discover

    def models(self) -> list[torch.nn.Module]:
        """The models modules are named in (see :class:`~memlab.sources.module_paths.ModulePaths`)."""
        return self.paths.models()

    def _record(self, path: str, module: torch.nn.Module) -> ModuleRecord:
        record = self.records.get(path)
        if record is None:
            record = self.records[path] = ModuleRecord(path, type(module).__name__)
        return record

    # -- sampling ------------------------------------------------------------------------------
    def _sample(self) -> None:
        """Fold the highest allocated bytes since the previous moment into every open run and note
        the current bytes, per device (called with the lock held)."""
        tracker = self._tracker
        for device in tracker.devices:
            sampler = self._samplers.get(device)
            if sampler is None:  # an allocator that appeared since the previous moment: its peak so far
                peak = tracker.max_memory_allocated(device)
                sampler = self._samplers[device] = tracker.sampler(_KEYS, device)
                _, current = sampler()
            else:
                peak, current = sampler()
            self._current[device] = current
            for run in self._open:
                if peak > run.peaks.get(device, 0):
                    run.peaks[device] = peak

    def _open_run(self, record: ModuleRecord, backward: bool, key: int) -> _Run:
        self._sample()
        run = _Run(record, backward, key, dict(self._current))
        self._open.append(run)
        return run

    def _close(self, run: _Run) -> None:
        """End ``run`` (sampled just before, with the lock held): its peaks go to its record."""
        self._open.remove(run)
        peaks = run.record.backward_peak if run.backward else run.record.forward_peak
        for device, peak in run.peaks.items():
            if peak > peaks.get(device, -1):
                peaks[device] = peak

    def _forward_running(self) -> _Run | None:
        """The innermost forward of this thread still running, or ``None``."""
        me = threading.get_ident()
        return next((run for run in reversed(self._open) if not run.backward and run.thread == me), None)

    # -- forward -------------------------------------------------------------------------------
    @untraced
    def _forward_begins(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if not self.active or torch.compiler.is_compiling() or not self._tracker.counts_this_thread():
            return
        if torch._C._current_graph_task_id() != -1:
            return  # recomputed for backward (activation checkpointing): the backward of its callers
        with self._lock:
            top = self._forward_running() is None
            path = self.paths.path(module, top)
            if path is None:
                return
            record = self._record(path, module)
            record.calls += 1
            if top:  # a model's forward: its weights may have changed
                self._weights = {id(s) for model in self.models() for s in _weight_storages(model)}
            run = self._open_run(record, False, id(module))
        if torch.is_grad_enabled():
            inputs = _grad_tensors(args)
            if inputs:
                call = run.call = _Call(record)
                call.inputs = len(inputs)
                for index, tensor in enumerate(inputs):
                    call.handles.append(tensor.register_hook(self._input_hook(call, index)))
                self._calls.add(call)

    @untraced
    def _forward_ends(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.active or torch.compiler.is_compiling():
            return
        me, key = threading.get_ident(), id(module)
        with self._lock:
            run = next(
                (r for r in reversed(self._open) if r.key == key and not r.backward and r.thread == me), None
            )
            if run is None:  # began before the recorder started, or outside every known model
                return
            self._sample()
            self._close(run)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            outputs = [t for t in _grad_tensors(output) if t.grad_fn is not None]
            if outputs:
                call = run.call
                if call is None:
                    call = _Call(run.record)
                    self._calls.add(call)
                hook = self._output_hook(call)
                call.handles += [tensor.register_hook(hook) for tensor in outputs]

    # -- backward ------------------------------------------------------------------------------
    def _output_hook(self, call: _Call) -> Callable[[torch.Tensor], None]:
        @untraced
        def begins(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if not self.active or call.task == task:
                return
            with self._lock:
                if call.run is not None and call.run in self._open:  # a backward of it that never ended
                    self._sample()
                    self._close(call.run)
                call.task, call.done = task, set()
                if self._end_queued != task:
                    self._end_queued = task
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                call.run = self._open_run(call.record, True, id(call))

        return begins

    def _input_hook(self, call: _Call, index: int) -> Callable[[torch.Tensor], None]:
        @untraced
        def ends(grad: torch.Tensor) -> None:
            if not self.active or call.run is None or call.task != torch._C._current_graph_task_id():
                return
            call.done.add(index)
            if len(call.done) < call.inputs:
                return
            with self._lock:
                if call.run in self._open:
                    self._sample()
                    self._close(call.run)
                call.run = None

        return ends

    @untraced
    def _backward_done(self) -> None:
        """The end of a backward pass: the backward of every module still running ends here
        (those whose inputs need no gradient, or whose inputs' gradients were not all computed)."""
        if not self.active:
            return
        with self._lock:
            self._sample()
            for run in [r for r in self._open if r.backward]:
                self._close(run)
            self._end_queued = None

    # -- activations ---------------------------------------------------------------------------
    def saved(self, tensor: torch.Tensor) -> None:
        """``tensor`` is being saved for backward (the tracker's pack hook): its storage's bytes
        count for the innermost module running forward in this thread, once per storage, until
        the storage is freed; a parameter or buffer of a known model (a weight saved by a matmul)
        is no activation."""
        if not self.active:
            return
        with self._lock:
            run = self._forward_running()
            if run is None:
                return
            storages = storages_of(tensor)
            if not storages:
                return
            storage = storages[0]
            key = id(storage)
            if key in self._weights:
                return
            entry = self._saved.get(key)
            if entry is not None and entry[0]() is storage:
                return
            nbytes = self._tracker.block_size(tensor) or 0
            if not nbytes:
                return
            record, device = run.record, storage.device
            self._saved[key] = (weakref.ref(storage, self._freed(key)), record, device, nbytes)
            now = record.saved[device] = record.saved.get(device, 0) + nbytes
            if now > record.activation.get(device, 0):
                record.activation[device] = now

    def _freed(self, key: int) -> Callable[[Any], None]:
        def freed(ref: Any) -> None:
            entry = self._saved.get(key)
            if entry is not None and entry[0] is ref:
                del self._saved[key]
                _, record, device, nbytes = entry
                record.saved[device] -= nbytes

        return freed

    # -- reading -------------------------------------------------------------------------------
    def running(self) -> tuple[str, str] | None:
        """``(path, "forward" | "backward")`` of the module whose run began last among those still
        running (this thread's forward first), or ``None``."""
        with self._lock:
            run = self._forward_running() or (self._open[-1] if self._open else None)
            if run is None:
                return None
            return run.record.path, "backward" if run.backward else "forward"

    def most_activations(self, device: torch.device) -> tuple[str, int] | None:
        """``(path, bytes)`` of the module whose saved tensors on ``device`` hold the most bytes
        now, or ``None`` when none holds any."""
        held = [(record.saved.get(device, 0), record.path) for record in list(self.records.values())]
        nbytes, path = max(held, key=lambda item: item[0], default=(0, ""))
        return (path, nbytes) if nbytes > 0 else None

    def table(self, device: torch.device) -> ModuleTable:
        """The modules of the known models (alive now) and of the records, with their bytes on
        ``device``: peaks and activations as recorded, ``parameter``, ``gradient`` and
        ``optimizer_state`` read now from each module's own parameters (a parameter two modules
        share counts in the first), as the tracker's blocks of them (0 for storages it did not
        count)."""
        with self._lock:
            live = self.paths.named()
            paths = list(dict.fromkeys([*live, *self.records]))
            optimizers = self._tracker.optimizers
            seen: set[int] = set()
            rows = []
            for path in paths:
                module = live.get(path)
                record = self.records.get(path)
                own = (
                    (0, 0, 0)
                    if module is None
                    else _own_bytes(self._tracker, module, optimizers, device, seen)
                )
                rows.append(
                    ModuleRow(
                        path=path,
                        type=record.type if record is not None else type(module).__name__,
                        calls=record.calls if record is not None else 0,
                        forward_peak=record.forward_peak.get(device) if record is not None else None,
                        backward_peak=record.backward_peak.get(device) if record is not None else None,
                        parameter=own[0],
                        gradient=own[1],
                        optimizer_state=own[2],
                        activation=record.activation.get(device, 0) if record is not None else 0,
                    )
                )
        return ModuleTable(str(device), tuple(rows))


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    """The distinct tensors among ``value``'s leaves (lists, tuples, dicts) that require grad."""
    found: dict[int, torch.Tensor] = {}
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            found.setdefault(id(leaf), leaf)
    return list(found.values())


def _weight_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    found = []
    for tensor in (*model.parameters(), *model.buffers()):
        found += storages_of(tensor)
    return found


def _own_bytes(
    tracker: Any,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    device: torch.device,
    seen: set[int],
) -> tuple[int, int, int]:
    """Bytes of ``module``'s own parameters, their gradients and their optimizer state on
    ``device``: the tracker's blocks, each storage once across calls sharing ``seen``."""

    def size(tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor):
            return 0
        storages = storages_of(tensor)  # a fake tensor's storage is on meta, where the tracker counts it
        if not storages or storages[0].device != device or id(storages[0]) in seen:
            return 0
        seen.add(id(storages[0]))
        return tracker.block_size(tensor) or 0

    parameter = gradient = state = 0
    for param in module._parameters.values():
        if param is None:
            continue
        parameter += size(param)
        gradient += size(param.grad)
        for optimizer in optimizers:
            for value in optimizer.state.get(param, {}).values():
                state += size(value)
    return parameter, gradient, state
