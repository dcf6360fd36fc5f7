"""MemReporter: name every tensor ``gc`` can reach and say how much memory its storage takes.

This module finds tensors (walking ``gc``) and names them from a model and optimizers;
:mod:`~memlab.reporter.records` turns them into records, one storage counted once;
:mod:`~memlab.reporter.snapshot` holds and renders them; :mod:`~memlab.reporter.diff` compares two.
"""

from __future__ import annotations

import gc
import itertools
import operator
import weakref
from collections.abc import Iterable, Iterator, Sequence, Set
from typing import TYPE_CHECKING, Protocol, TextIO

import torch

from memlab._devices import DeviceLike
from memlab._outputs import check_stream
from memlab._tensors import reachable_tensors, unwrap_optimizer
from memlab._user_code import user_frame
from memlab.history.categories import BUFFER, GRADIENT, OPTIMIZER_STATE, PARAMETER, UNKNOWN
from memlab.reporter.diff import SnapshotDiff
from memlab.reporter.records import DEVICE_MODELS, DenseTensors, build_records
from memlab.reporter.snapshot import TensorRecord, TensorSnapshot, device_key, paused_gc

if TYPE_CHECKING:
    import pandas as pd

    from memlab.sources.tracker import TensorTracker

__all__ = ["AllocatedMemorySource", "MemReporter"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_FIRST, _SECOND, _THIRD = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
_DEVICE = operator.attrgetter("device")
# The entry of a tensor not numbered yet: its "weak reference" is a C callable returning None.
_UNSEEN = (type(None), -1, "")
_ANONYMOUS_CATEGORY = {torch.Tensor: UNKNOWN, torch.nn.Parameter: PARAMETER}


class AllocatedMemorySource(Protocol):
    """Anything that knows the bytes allocated on a device (e.g. :class:`memlab.TensorTracker`)."""

    def memory_allocated(self, device: DeviceLike | None = None) -> int: ...


class MemReporter:
    """Report the tensors ``gc`` can reach, per device, each storage counted once.

    ``model`` (an ``nn.Module``, optional) names parameters and buffers (tied weights as
    ``enc.weight+dec.weight``) and their gradients (``weight.grad``); :meth:`add_optimizer` names
    optimizer state (``AdamW.0.weight.exp_avg``). Other tensors are ``Tensor0``, ``Tensor1``, … (a
    subclass shows its class name, e.g. ``Parameter3``); a tensor keeps its number for as long as it
    lives, so reports and snapshots over time can be compared. The reporter keeps only weak
    references to the model, the optimizers and tensors. Categories are the history's
    (:mod:`memlab.history.categories`): ``parameter``, ``buffer``, ``gradient``,
    ``optimizer_state``, and ``unknown`` for the others.

    ``tracker`` (a :class:`memlab.TensorTracker`; default: the active one, if any, at each
    report) with a history adds where each storage was allocated (``file:line`` of the innermost
    user frame: the ``allocated_at`` column, and a last column in the text report) and gives the
    ``unknown`` rows the tracker's category where it knows one (``activation``, ``input``).
    Storages the tracker did not count have no place. Without a history nothing changes.

    ``pre_collect=True`` runs ``gc.collect()`` before each walk so that tensors only kept alive by
    unreachable reference cycles are freed rather than reported.

    Bytes are each storage's ``nbytes``: exact on ``cpu`` and ``meta`` (where nothing is
    allocated), rounded up as the CUDA caching allocator rounds requests on CUDA devices (to
    512 B blocks: 1..512 B take 512 B; an empty storage takes 0). ``device_model="cuda"`` rounds
    every storage that way, whatever its device, so that a run on ``cpu`` or ``meta`` shows the
    sizes a GPU would: the totals then match the line profiler's modelled numbers
    (:class:`memlab.TensorTracker` with ``allocator="cuda"``) for the same live tensors, except
    where the allocator hands out a whole cached block larger than the request. Each text report
    ends with a ``sizes:`` line saying which of the two it shows. What it cannot see:
    tensors without a Python object that ``gc`` tracks, in particular autograd's saved tensors,
    buffers held by C++ (cuDNN/cuBLAS workspaces, NCCL, C++ extensions), the CUDA context, and the
    allocator's cached but unused memory. The ``allocated memory`` line, where a memory source knows
    it, shows the difference.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        pre_collect: bool = False,
        device_model: str | None = None,
        tracker: TensorTracker | None = None,
    ) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module or None, got {type(model).__name__} {model!r:.80}"
            )
        self.device_model = _check_device_model(device_model)
        if tracker is not None:
            from memlab.sources.tracker import TensorTracker

            if not isinstance(tracker, TensorTracker):
                raise TypeError(
                    f"tracker must be a memlab.TensorTracker or None, got {type(tracker).__name__}"
                )
        _check_flag(pre_collect, "pre_collect")
        self.tracker = tracker
        self._model = None if model is None else weakref.ref(model)
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.pre_collect = pre_collect
        self._anonymous: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self._next_number = 0

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Name ``optimizer``'s state as ``<Optimizer>.<param>.<key>``, e.g. ``AdamW.0.weight.exp_avg``.

        ``<param>`` is the parameter's name in the model, or its index in the optimizer's
        ``state_dict()`` when the reporter has no model or the model does not hold it.
        """
        optimizer = unwrap_optimizer(optimizer)
        if all(ref() is not optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))

    def report(
        self,
        verbose: bool = False,
        device: DeviceLike | None = None,
        stream: TextIO | None = None,
        source: AllocatedMemorySource | None = None,
    ) -> None:
        """Print the tensors on each device (or only ``device``) with their storage bytes.

        Layout as pytorch_memlab's: ``Element type / Size / Used MEM``, a ``Storage on <device>``
        block per device, ``Total Tensors`` (elements in the counted storages) and ``Used Memory``,
        then ``The allocated memory on <device>`` where a memory source knows it: ``source`` if
        given, else ``torch.cuda`` on CUDA devices and the active :class:`memlab.TensorTracker`
        elsewhere, with one line explaining a difference. ``verbose=True`` also lists tensors
        sharing another's storage as ``name(->owner)`` with ``0.00B``. Writes to ``stream``
        (default ``sys.stdout`` at call time). No reference to any tensor is kept afterwards.
        ``TypeError`` for a ``stream`` without ``write()`` or a ``verbose`` that is not a bool.
        """
        check_stream(stream)
        _check_flag(verbose, "verbose")
        wanted = device_key(device)
        with paused_gc():  # the records die before a collection could traverse them
            self._snapshot(source, dtypes=False).report(verbose=verbose, device=wanted, stream=stream)

    def to_dataframe(self, verbose: bool = False, device: DeviceLike | None = None) -> pd.DataFrame:
        """The rows :meth:`report` would print, as a DataFrame (see :meth:`TensorSnapshot.to_dataframe`)."""
        _check_flag(verbose, "verbose")
        wanted = device_key(device)
        with paused_gc():
            return self._snapshot(None).to_dataframe(verbose=verbose, device=wanted)

    def snapshot(self, source: AllocatedMemorySource | None = None) -> TensorSnapshot:
        """Record every reachable tensor now, as plain data; see :meth:`report` for what it can see."""
        with paused_gc():
            return self._snapshot(source)

    def diff(self, before: TensorSnapshot, after: TensorSnapshot | None = None) -> SnapshotDiff:
        """What appeared, disappeared, grew or shrank from ``before`` to ``after`` (default: now),
        both :class:`TensorSnapshot` s taken by :meth:`snapshot` (``TypeError`` otherwise)."""
        for name, value in (("before", before), ("after", after)):
            if not isinstance(value, TensorSnapshot) and not (name == "after" and value is None):
                raise TypeError(
                    f"{name} must be a TensorSnapshot (from MemReporter.snapshot())"
                    f"{' or None (now)' if name == 'after' else ''}, got {type(value).__name__} {value!r:.80}"
                )
        return SnapshotDiff.between(before, self.snapshot() if after is None else after)

    # -- collection --------------------------------------------------------------------------
    def _snapshot(self, source: AllocatedMemorySource | None, dtypes: bool = True) -> TensorSnapshot:
        if source is not None and not callable(getattr(source, "memory_allocated", None)):
            raise TypeError(
                "source must have a memory_allocated(device) method (e.g. a memlab.TensorTracker), "
                f"got {type(source).__name__}"
            )
        if self.pre_collect:
            gc.collect()
        records = self._collect_records(dtypes)
        return TensorSnapshot(tuple(records), _allocated(records, source), device_model=self.device_model)

    def _collect_records(self, dtypes: bool) -> list[TensorRecord]:
        named: dict[int, tuple[torch.Tensor, str, str]] = {}
        self._name_model_tensors(named)
        self._name_optimizer_state(named)
        found = reachable_tensors()
        dense = DenseTensors.read(found)  # None when some tensor needs the record builder's care
        candidates = found if dense is None else list(itertools.compress(found, dense.requires_grad))
        grads = _gradients([entry[0] for entry in named.values()] + candidates)
        skip = named.keys() | {id(grad) for grad in grads.values()}
        names, positions = self._number_anonymous(found, skip)
        anonymous = list(map(found.__getitem__, positions))
        del found, skip, candidates
        # Report order: named tensors each followed by its gradient, then the others by number.
        head = list(_with_gradients(named.values(), grads))
        anonymous_owners = grads.keys() - named.keys()  # of a gradient; usually none (parameters are named)
        del named
        tensors = [row[0] for row in head]
        labels = [row[1] for row in head]
        categories: list[str | None] = [row[2] for row in head]
        # Plain tensors are "unknown", parameters "parameter", subclasses decided by the record builder.
        anonymous_categories = list(map(_ANONYMOUS_CATEGORY.get, map(type, anonymous)))
        if not anonymous_owners or anonymous_owners.isdisjoint(map(id, anonymous)):
            if dense is not None:  # read the few named tensors; the others were read already
                head_dense = DenseTensors.read(tensors)
                dense = None if head_dense is None else head_dense.followed_by(dense.take(positions))
            tensors += anonymous
            labels += names
            categories += anonymous_categories
        else:
            dense = None
            rows = _with_gradients(zip(anonymous, names, anonymous_categories, strict=True), grads)
            for tensor, name, category in rows:
                tensors.append(tensor)
                labels.append(name)
                categories.append(category)
        del anonymous
        records = build_records(tensors, labels, categories, dtypes, dense, self.device_model)
        tracker = self.tracker
        if tracker is None:
            from memlab.sources.tracker import active_tracker

            tracker = active_tracker()
        if tracker is not None and tracker.history:
            return _with_places(records, tensors, labels, tracker)
        return records

    def _name_model_tensors(self, named: dict[int, tuple[torch.Tensor, str, str]]) -> None:
        model = None if self._model is None else self._model()
        if model is None:
            return
        for category, items in (
            (PARAMETER, model.named_parameters(remove_duplicate=False)),
            (BUFFER, model.named_buffers(remove_duplicate=False)),
        ):
            for name, tensor in items:
                entry = named.get(id(tensor))
                joined = name if entry is None else f"{entry[1]}+{name}"
                named[id(tensor)] = (tensor, joined, category)

    def _name_optimizer_state(self, named: dict[int, tuple[torch.Tensor, str, str]]) -> None:
        labels: dict[str, int] = {}
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            label = type(optimizer).__name__
            labels[label] = labels.get(label, 0) + 1
            if labels[label] > 1:
                label = f"{label}[{labels[label] - 1}]"
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index, param in enumerate(params):
                owner = named.get(id(param))
                param_name = owner[1] if owner is not None and owner[2] == PARAMETER else str(index)
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and id(value) not in named:
                        named[id(value)] = (value, f"{label}.{param_name}.{key}", OPTIMIZER_STATE)

    def _number_anonymous(
        self, tensors: list[torch.Tensor], skip: Set[int]
    ) -> tuple[list[str], Sequence[int]]:
        """Names and positions in ``tensors``, by number, of the tensors whose ``id`` is not in ``skip``.

        A tensor keeps its ``TensorN`` for as long as it lives (checked through a weak reference).
        Each step is one C-level pass over all tensors; only tensors new since the last call (or
        whose ``id`` was reused by a new tensor) get a number in Python.
        """
        keys = list(map(id, tensors))
        positions: Sequence[int] = range(len(tensors))
        if not skip.isdisjoint(keys):
            keep = list(map(operator.not_, map(skip.__contains__, keys)))
            keys, tensors = list(itertools.compress(keys, keep)), list(itertools.compress(tensors, keep))
            positions = list(itertools.compress(positions, keep))
        entries = list(map(self._anonymous.get, keys, itertools.repeat(_UNSEEN)))
        # Whether each entry's weak reference still points at this very tensor.
        same = map(operator.is_, map(operator.call, map(_FIRST, entries)), tensors)
        renumbered = False
        for index in itertools.compress(range(len(tensors)), map(operator.not_, same)):
            tensor, number = tensors[index], self._next_number
            entries[index] = (weakref.ref(tensor), number, f"{type(tensor).__name__}{number}")
            self._next_number += 1
            renumbered = True
        # Keep only this call's entries. When every tensor kept its entry and there are as many
        # (distinct) tensors as entries, those are exactly the entries already there.
        if renumbered or len(keys) != len(self._anonymous):
            self._anonymous = dict(zip(keys, entries, strict=True))
        numbers = list(map(_SECOND, entries))
        if all(map(operator.lt, numbers, itertools.islice(numbers, 1, None))):
            return list(map(_THIRD, entries)), positions  # the usual case: gc lists older tensors first
        order = sorted(range(len(numbers)), key=numbers.__getitem__)
        return list(map(_THIRD, map(entries.__getitem__, order))), list(map(positions.__getitem__, order))


def _with_gradients(
    tensors: Iterable[tuple[torch.Tensor, str, str | None]], grads: dict[int, torch.Tensor]
) -> Iterator[tuple[torch.Tensor, str, str | None]]:
    """``tensors`` with each one's gradient right after it, named ``<name>.grad``."""
    for tensor, name, category in tensors:
        yield tensor, name, category
        if id(tensor) in grads:
            yield grads[id(tensor)], f"{name}.grad", GRADIENT


def _with_places(
    records: list[TensorRecord], tensors: list[torch.Tensor], labels: list[str], tracker: TensorTracker
) -> list[TensorRecord]:
    """``records`` with ``allocated_at`` (and, for ``unknown`` rows, the category) from ``tracker``'s
    history, matched to ``tensors`` by their ``labels`` (parts of sparse and wrapper tensors, named
    ``<label>.<part>``, have none)."""
    contexts = {}
    for tensor, label in zip(tensors, labels, strict=True):
        context = tracker.allocation_context(tensor)
        if context is not None:
            contexts[label] = context
    placed = []
    for record in records:
        context = contexts.get(record.name)
        if context is None:
            placed.append(record)
            continue
        stack, category = context
        frame = user_frame(stack)
        placed.append(
            record._replace(
                category=category if record.category == UNKNOWN else record.category,
                allocated_at=None if frame is None else f"{frame[0]}:{frame[1]}",
            )
        )
    return placed


def _gradients(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """``id(owner) -> grad`` for every leaf tensor with a ``.grad``; each gradient listed once."""
    grads: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for tensor in itertools.compress(tensors, map(_REQUIRES_GRAD, tensors)):
        try:
            grad = tensor.grad if tensor.is_leaf else None
        except Exception:  # subclasses that refuse (e.g. an uninitialized lazy parameter)
            continue
        if grad is not None and id(grad) not in seen:
            seen.add(id(grad))
            grads[id(tensor)] = grad
    return grads


def _check_flag(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.80}")


def _check_device_model(device_model: object) -> str | None:
    """``device_model`` if it is one of :data:`~memlab.reporter.records.DEVICE_MODELS`."""
    valid = "None (each device's own sizes) or 'cuda' (sizes as the CUDA caching allocator rounds them)"
    if device_model is not None and not isinstance(device_model, str):
        raise TypeError(f"device_model must be {valid}; got {type(device_model).__name__} {device_model!r}")
    if device_model not in DEVICE_MODELS:
        raise ValueError(f"device_model must be {valid}; got {device_model!r}")
    return device_model


def _allocated(
    records: list[TensorRecord], source: AllocatedMemorySource | None
) -> dict[str, tuple[int, str]]:
    """Bytes a memory source reports as allocated on each device that has records: ``source`` if
    given, else the source already measuring that device (:func:`memlab.sources.select.open_source`:
    ``torch.cuda`` for a GPU that exists, the active tracker elsewhere)."""
    from memlab.sources.cuda import CudaSource
    from memlab.sources.select import open_source

    allocated = {}
    for device in set(map(_DEVICE, records)):
        measuring = source if source is not None else open_source(torch.device(device))
        if measuring is not None:
            label = "torch.cuda" if isinstance(measuring, CudaSource) else type(measuring).__name__
            allocated[device] = (int(measuring.memory_allocated(device)), label)
    return allocated
