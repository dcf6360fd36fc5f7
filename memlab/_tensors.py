"""The tensors ``gc`` can reach and the storages behind them, each storage once.

One walker serves the reporter (naming tensors), ``Courtesy`` (moving them off a device) and the
tensor tracker's adoption of tensors that existed before profiling. A tensor's storages are its own
for dense tensors, those of its parts for sparse layouts (indices, values) and for traceable wrapper
subclasses (``__tensor_flatten__``), and none for tensors that have no storage (fake or lazy ones).
"""

from __future__ import annotations

import functools
import gc
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import BuiltinFunctionType, CodeType, FrameType, FunctionType, ModuleType

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "SPARSE_PARTS",
    "LiveStorage",
    "call_roots",
    "check_optimizer",
    "check_tensor",
    "disown",
    "live_storages",
    "live_tensors",
    "on_device",
    "parts",
    "reachable_tensors",
    "storages_of",
    "tensor_classes",
    "tensors_within",
    "unwrap_optimizer",
]

#: The accessors of a sparse layout's component tensors, in the order they are listed.
SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def check_tensor(tensor: object) -> None:
    """``TypeError`` unless ``tensor`` is a ``torch.Tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__} {tensor!r:.80}")


def check_optimizer(optimizer: object) -> None:
    """``TypeError`` unless ``optimizer`` is a ``torch.optim.Optimizer`` or a wrapper of one (see
    :func:`unwrap_optimizer`)."""
    unwrap_optimizer(optimizer)


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose ``step`` updates the parameters for ``optimizer``: the
    optimizer itself, or the one a wrapper holds as ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``, which derives from ``Optimizer`` without running its ``__init__``, so
    it has no step hooks of its own) or ``._optimizer`` (Lightning's ``LightningOptimizer``),
    followed through wrappers of wrappers. ``TypeError`` for anything else."""
    found = optimizer
    for _ in range(8):  # wrappers of wrappers; a cycle of wrappers ends here
        if isinstance(found, torch.optim.Optimizer) and "_optimizer_step_post_hooks" in vars(found):
            return found  # initialised by torch.optim.Optimizer.__init__: its own step hooks
        inner = getattr(found, "optimizer", None)
        if inner is None:
            inner = getattr(found, "_optimizer", None)
        if inner is None or inner is found:
            break
        found = inner
    if isinstance(found, torch.optim.Optimizer):
        return found
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer (e.g. torch.optim.AdamW) or an object that wraps one "
        f"as .optimizer (accelerate's AcceleratedOptimizer) or ._optimizer (Lightning's "
        f"LightningOptimizer), got {type(optimizer).__name__} {optimizer!r:.80}"
    )


def tensor_classes() -> set[type]:
    """``torch.Tensor`` and every class defined so far that derives from it."""
    classes, unvisited = {torch.Tensor}, [torch.Tensor]
    while unvisited:
        for subclass in type.__subclasses__(unvisited.pop()):
            if subclass not in classes:
                classes.add(subclass)
                unvisited.append(subclass)
    return classes


#: Tensors that memlab itself left alive and that hold no one's data (see :func:`disown`), by
#: ``id``, each with a weak reference (the ``id`` of a freed tensor may be reused).
_DISOWNED: dict[int, weakref.ref[torch.Tensor]] = {}


def disown(tensors: Iterable[torch.Tensor]) -> None:
    """Leave ``tensors`` (and every tensor sharing their storages) out of the tensors and storages
    found alive from now on, for as long as they live: memlab's own leftovers, never the user's
    data. :func:`memlab.distributed.fake_group` disowns the rank tables of the device meshes made
    inside it that are still alive after it (PyTorch keeps references to them, in torch 2.8's and
    2.11's C++ DTensor sharding code; they describe a process group that no longer exists), so that a
    profile after the block does not count them as tensors of the user's that existed before
    profiling."""
    for tensor in tensors:
        key = id(tensor)
        _DISOWNED[key] = weakref.ref(tensor, functools.partial(_forget, key))


def _forget(key: int, _: object) -> None:
    _DISOWNED.pop(key, None)


def _disowned() -> tuple[set[int], set[int]]:
    """The ``id``s of the disowned tensors alive now and the ``_cdata`` of their storages."""
    tensors, storages = set(), set()
    for key, ref in list(_DISOWNED.items()):
        tensor = ref()
        if tensor is not None:
            tensors.add(key)
            storages.add(tensor.untyped_storage()._cdata)
    return tensors, storages


def reachable_tensors() -> list[torch.Tensor]:
    """Every tensor object ``gc`` tracks, any device, in ``gc`` order (weak proxies are skipped:
    they are not tensors), except memlab's own leftovers (:func:`disown`).

    Tensors whose Python object was never created (a ``.grad`` made by autograd and not yet read,
    the base of a view, autograd's saved tensors) are not among them: see :func:`live_tensors`.
    """
    classes = tensor_classes()  # every live object's class is a live class: all of them
    objects = gc.get_objects()
    found = list(itertools.compress(objects, map(classes.__contains__, map(type, objects))))  # in C
    del objects
    if _DISOWNED:
        disowned, _ = _disowned()
        found = [tensor for tensor in found if id(tensor) not in disowned]
    return found


def tensors_within(roots: Iterable[object], depth: int = 4, breadth: int = 256) -> list[torch.Tensor]:
    """The tensors held by ``roots`` (a call's arguments, say), without walking ``gc``: tensors
    themselves, and inside lists, tuples, sets, dicts, modules (parameters and buffers), optimizers
    (state and parameters) and the ``__dict__`` of other objects, down to ``depth`` levels. A
    container or object of more than ``breadth`` items (other than a module or an optimizer) is not
    entered (a data set passed as an argument would make every call slow), nor is an object that
    refuses to be read."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [(root, depth) for root in roots]
    while todo:
        obj, left = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
            continue
        if left == 0 or isinstance(obj, _LEAVES):
            continue
        try:
            children = _children(obj)
            if len(children) <= breadth or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                todo.extend((child, left - 1) for child in children)
        except Exception:  # a user object whose attributes or items cannot be read
            continue
    return list(found.values())


_LEAVES = (str, bytes, int, float, bool, type(None), type)


def call_roots(frame: FrameType, skip: Callable[[CodeType], bool]) -> list[object]:
    """What the call that ``frame`` runs can reach besides its arguments, for :func:`tensors_within`:
    the values of its function's globals and of the locals of every frame that called it
    (frames whose code ``skip`` names left out: torch's and memlab's own). Left out as well:
    modules (another module's tensors are reached through its own functions' globals),
    functions, classes, numbers and strings, memlab's own objects (a profiler, a tracker: they
    hold no tensor of the user's) and dunder names (``__builtins__``, ``__spec__``...)."""
    roots = _holders(frame.f_globals)
    caller = frame.f_back
    while caller is not None:
        if not skip(caller.f_code):
            roots += _holders(caller.f_locals)
        caller = caller.f_back
    return roots


def _holders(names: dict[str, object]) -> list[object]:
    return [value for name, value in names.items() if not name.startswith("__") and _may_hold_tensors(value)]


_NO_TENSORS = frozenset((*_LEAVES, FunctionType, BuiltinFunctionType))


def _may_hold_tensors(value: object) -> bool:
    kind = type(value)
    return not (
        kind in _NO_TENSORS or isinstance(value, (type, ModuleType)) or kind.__module__.startswith("memlab.")
    )


def _children(obj: object) -> list[object] | tuple[object, ...]:
    if isinstance(obj, torch.nn.Module):
        return (*obj.parameters(), *obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return (obj.state, obj.param_groups)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return tuple(obj)
    return list(getattr(obj, "__dict__", {}).values())


def live_tensors(roots: Iterable[object] | None = None) -> list[torch.Tensor]:
    """:func:`reachable_tensors` (or, given ``roots``, :func:`tensors_within` them), plus the
    ``.grad`` of leaves and the ``._base`` of views (which hold memory although their Python
    objects may not exist yet), each tensor object once.

    Not visible: autograd's saved tensors, tensors held only by C++ (a graph kept alive by a loss
    that Python still holds shows its parameters, not its activations)."""
    found: dict[int, torch.Tensor] = {}
    stack = reachable_tensors() if roots is None else tensors_within(roots)
    stack.reverse()  # popped in gc order
    while stack:
        tensor = stack.pop()
        if id(tensor) in found:
            continue
        found[id(tensor)] = tensor
        try:
            if tensor.requires_grad and tensor.is_leaf and tensor.grad is not None:
                stack.append(tensor.grad)
            if tensor._is_view() and tensor._base is not None:
                stack.append(tensor._base)
        except Exception:  # subclasses that refuse (e.g. an uninitialized lazy parameter)
            continue
    return list(found.values())


def parts(tensor: torch.Tensor, name: str = "") -> Iterator[tuple[torch.Tensor, str]]:
    """The storage-holding tensors behind ``tensor`` with their names: ``(tensor, name)`` itself,
    or a sparse / wrapper tensor's parts as ``name.values``, ``name.indices``, ``name.<attr>``."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(tensor, attr)
            if isinstance(inner, torch.Tensor):
                yield from parts(inner, f"{name}.{attr}")
        return
    accessors = SPARSE_PARTS.get(tensor.layout)
    if accessors is None:
        yield tensor, name
        return
    for accessor in accessors:
        yield getattr(tensor, accessor)(), f"{name}.{accessor.lstrip('_')}"


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s data (see :func:`parts`); empty for a tensor without
    storage (fake tensors outside their mode, uninitialized lazy parameters, nested layouts)."""
    if type(tensor) is torch.Tensor and tensor.layout is torch.strided:
        return [tensor.untyped_storage()]
    found = []
    try:
        for part, _ in parts(tensor):
            found.append(part.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):
        return []  # ValueError: an uninitialized lazy parameter refuses every op
    return found


class LiveStorage:
    """A storage found by :func:`live_storages` with the tensors that hold it."""

    __slots__ = ("storage", "tensors")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.tensors: list[torch.Tensor] = []


def live_storages(
    device: torch.device | None = None, roots: Iterable[object] | None = None
) -> dict[int, LiveStorage]:
    """The storages behind :func:`live_tensors` (of ``roots``, if given), keyed by ``id`` of the
    storage object, each once, in the order their first tensor was found; ``device`` keeps only
    storages on that device (``cuda`` without an index: every CUDA device). Storages of zero
    bytes and storages whose size is symbolic (fake tensors) are left out: they hold no memory;
    so are memlab's own leftovers (:func:`disown`), also where a view of them is reached."""
    found: dict[int, LiveStorage] = {}
    disowned = _disowned()[1] if _DISOWNED else set()
    for tensor in live_tensors(roots):
        for storage in storages_of(tensor):
            if device is not None and not on_device(storage.device, device):
                continue
            if disowned and storage._cdata in disowned:
                continue
            entry = found.get(id(storage))
            if entry is None:
                nbytes = storage.nbytes()
                if not isinstance(nbytes, int) or nbytes == 0:
                    continue
                entry = found[id(storage)] = LiveStorage(storage)
            entry.tensors.append(tensor)
    return found


def on_device(device: torch.device, wanted: torch.device) -> bool:
    """Whether ``device`` is ``wanted``; a ``wanted`` without an index matches every index."""
    return device.type == wanted.type and (wanted.index is None or device.index == wanted.index)
