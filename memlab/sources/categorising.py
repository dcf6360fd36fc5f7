"""What a :class:`~memlab.sources.tracker.TensorTracker`'s blocks hold: the categories of the history.

:class:`TrackerCategories` is the tracker's half that names its blocks (parameter, gradient,
optimizer state, activation, ...) from the models and optimizers it knows, and reads the history
back per category (:meth:`~TrackerCategories.by_category`) or as a memory snapshot. It is a mixin of
``TensorTracker``: it reads the tracker's ``history``, ``_models``, ``_optimizers``, ``_hooks``,
``_categorising``, ``_live``, ``module_recorder`` and allocators, and keeps no state of its own.
Memory per module (:meth:`~TrackerCategories.by_module`) is read here too: the same question,
what the blocks hold, asked per module (the recording is :mod:`memlab.sources.modules`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from memlab._tensors import check_tensor, unwrap_optimizer
from memlab.history import categories
from memlab.history.recorder import Stack
from memlab.history.series import peak_by_category
from memlab.sources.allocator.snapshot import allocator_snapshot
from memlab.sources.storages import collect_storages
from memlab.sources.untraced import untraced

if TYPE_CHECKING:
    import pandas as pd

    from memlab.sources.module_table import ModuleTable

__all__ = ["TrackerCategories"]

_AT = ("now", "peak")  # the moments by_category can report


class TrackerCategories:
    """The categorising half of :class:`~memlab.sources.tracker.TensorTracker` (see the module)."""

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
        Only with ``history`` on; the tracker keeps a weak reference to the optimizer.

        ``optimizer`` is a ``torch.optim.Optimizer`` or a wrapper of one (accelerate's
        ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``): the tracker keeps the
        optimizer it wraps (:func:`memlab._tensors.unwrap_optimizer`), which :attr:`optimizers`
        lists. Anything else is a ``TypeError``."""
        optimizer = unwrap_optimizer(optimizer)
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

    @untraced
    def _gradient_hook(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._categorise(param.grad, categories.GRADIENT)

    @untraced
    def _step_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._categorise_optimizer(optimizer)

    def _records_modules(self) -> bool:
        recorder = self.module_recorder
        return recorder is not None and (recorder.discover or bool(self.models))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._categorise(tensor, categories.ACTIVATION)
        if self.module_recorder is not None:
            self.module_recorder.saved(tensor)
        if tensor.grad_fn is None:
            # A leaf (a parameter, an input, a mask that needs no gradient) refers to no node, so
            # the graph holding it makes no cycle: PyTorch's own SavedVariable keeps such a tensor
            # itself too. Saves a detach(), an op through every dispatch mode, per such tensor.
            return tensor
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
        collect_storages(tensor, storages)
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
        check_tensor(tensor)
        if not self.history:
            return None
        if self._pending:
            self._drain()
        storages: list[torch.UntypedStorage] = []
        collect_storages(tensor, storages)
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

    def snapshot(self, device: torch.device | str | int | None = None) -> dict[str, Any]:
        """The memory snapshot of ``device`` in the format of ``torch.cuda.memory._snapshot()``
        (``device=None`` read as by :meth:`memory_stats`), for PyTorch's viewer and
        ``python -m torch.cuda._memory_viz``: see
        :func:`memlab.sources.allocator.snapshot.allocator_snapshot`.

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
        live at the highest allocated total since the history began, replayed from the history
        as :func:`memlab.history.series.memory_series` replays the snapshot (the same series
        ``plot_memory`` draws: :func:`~memlab.history.series.peak_by_category`);
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
            # memory_series(allocator_snapshot(allocator)).by_category at its peak, read from the
            # history's columns without building the snapshot's entries and frames
            entries = ((action, addr, size, name) for action, addr, size, _, _, name in history.entries())
            return {**dict.fromkeys(categories.CATEGORIES, 0), **peak_by_category(entries)}
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
        device = next(d for d, a in self._allocators.items() if a is allocator)
        return self.module_recorder.table(device)  # type: ignore[union-attr]

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
