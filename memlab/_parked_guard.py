"""The class a parked ``torch.Tensor`` or ``nn.Parameter`` has while :class:`memlab.Courtesy` keeps
it in a file: :class:`ParkedTensor` / :class:`ParkedParameter` (subclasses, so ``isinstance`` holds),
whose ``__torch_function__`` runs for parked tensors only, never for others:

- an op that would write to a parked tensor or change its shape, strides or storage in place
  (``add_``, ``copy_``, ``resize_``, ``set_``, ``unsqueeze_``, ``t[...] = x``, ``out=``,
  ``inplace=True``) raises :class:`ParkedTensorError` before it runs;
- a tensor an op returns over a parked storage (a view, ``.detach()``, ``.data``, ``split``) is
  parked too: where it sits in the parked storage (offset, sizes, strides, dtype) is found by
  running the op again on ``meta`` tensors that have the parked tensors' real offsets, sizes and
  strides (placeholders have stride 0 and offset 0, which tells nothing). A result that is a copy
  on real data but a view of a placeholder (``x.T.reshape(-1)``) is copied.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from memlab._parked import ParkedTensorError, Parking, View, parking_of, parking_of_shadow

__all__ = ["ParkedParameter", "ParkedTensor", "follow", "park"]


def park(parking: Parking, tensor: torch.Tensor, view: View) -> None:
    """Re-point ``tensor`` at a placeholder of ``view``'s shape and dtype, and follow it. A leaf
    that requires grad gets a hook that refuses a backward pass accumulating into a parked
    ``.grad`` (autograd's C++ writes there without asking ``__torch_function__``)."""
    tensor.data = parking.placeholder(view.dtype, view.size, tensor.is_inference())
    follow(parking, tensor, view)
    if tensor.requires_grad and tensor.is_leaf:
        view.hook = tensor.register_hook(_refuse_accumulation(weakref.ref(tensor)))


def _refuse_accumulation(leaf: weakref.ref[torch.Tensor]) -> Any:
    def hook(grad: torch.Tensor) -> None:
        tensor = leaf()
        held = None if tensor is None else tensor.grad
        if held is not None and parking_of(held) is not None:
            raise ParkedTensorError(_message(held, "backward (accumulating into .grad)"))

    return hook


def follow(parking: Parking, tensor: torch.Tensor, view: View) -> None:
    """Remember where ``tensor`` (on a placeholder of ``parking``) sits; guard it if it is a plain
    ``torch.Tensor`` or ``nn.Parameter`` (other subclasses keep their own ``__torch_function__``)."""
    parking.remember(tensor, view)  # first: a tensor whose class changed is always released
    guard = _GUARDS.get(type(tensor))
    if guard is not None:
        view.cls = type(tensor)
        tensor.__class__ = guard


def _torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return _run(func, args, kwargs or {})


def _refuse_unparked(name: str, method: Any) -> Any:
    """``method`` (of ``torch.Tensor``), refused while its tensor is parked: for the few in-place
    methods and setters that PyTorch runs without asking ``__torch_function__``."""

    def guarded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if parking_of(self) is not None:
            raise ParkedTensorError(_message(self, name))
        return method(self, *args, **kwargs)

    return guarded


def _guarded_property(attribute: str) -> property:
    getter = getattr(torch.Tensor, attribute).__get__
    setter = getattr(torch.Tensor, attribute).__set__
    return property(lambda self: getter(self), _refuse_unparked(f".{attribute} = ...", setter))


class ParkedTensor(torch.Tensor):
    """A ``torch.Tensor`` while :class:`memlab.Courtesy` has it parked (see the module)."""

    __slots__ = ()
    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]
    set_ = _refuse_unparked("set_", torch.Tensor.set_)  # runs without __torch_function__
    real = _guarded_property("real")  # its setter too
    imag = _guarded_property("imag")


class ParkedParameter(torch.nn.Parameter):
    """A ``torch.nn.Parameter`` while :class:`memlab.Courtesy` has it parked (see the module)."""

    __slots__ = ()
    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]
    set_ = ParkedTensor.set_
    real = ParkedTensor.real
    imag = ParkedTensor.imag


_GUARDS: dict[type, type] = {torch.Tensor: ParkedTensor, torch.nn.Parameter: ParkedParameter}

#: Properties whose value aliases the tensor; the other getters and setters pass through.
_VIEW_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
_OPS = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "mod", "pow", "lshift", "rshift")
_IN_PLACE_DUNDERS = frozenset({"__setitem__", *(f"__i{op}__" for op in (*_OPS, "and", "or", "xor"))})
_HARMLESS = frozenset({"requires_grad_"})  # in place, but changes neither data nor geometry
# What PyTorch says when a kernel writes to a placeholder it did not see coming (a write through
# an argument passed by keyword, a C++ path): the storage refuses, or the stride-0 write overlaps.
_REFUSALS = ("Cannot access data pointer of Tensor", "more than one element of the written-to tensor")


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__set__" and attribute == "data":  # the user replaces the data: not parked now
            parking = parking_of(args[0])
            result = func(*args, **kwargs)
            if parking is not None and parking_of(args[0]) is not parking:
                parking.release(args[0])
            return result
        if name == "__set__" or attribute not in _VIEW_PROPERTIES:
            return func(*args, **kwargs)
        name = f".{attribute}"
    for tensor, how in _written(func, name, args, kwargs):
        if parking_of(tensor) is not None:
            raise ParkedTensorError(_message(tensor, how))
    try:
        result = func(*args, **kwargs)
    except RuntimeError as error:
        parked = [t for t in _tensors((args, kwargs)) if parking_of(t) is not None]
        if parked and any(refusal in str(error) for refusal in _REFUSALS):
            needs_data = _REFUSALS[0] in str(error)  # else a write the checks above did not foresee
            raise ParkedTensorError(_message(parked[0], name, needs_data)) from error
        if not parked:
            raise
        # A view a placeholder cannot take (stride 0: .view(torch.uint8), view_as_real) that the
        # parked tensor can: made from where it sits.
        result = _from_shadows_only(func, args, kwargs, name)
        if result is None:
            raise
        return result
    return _follow(func, args, kwargs, result, name)


def _written(func: Any, name: str, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, str]]:
    """The tensors ``func`` writes to or changes in place, each with how it is called."""
    positions: tuple[int, ...] = ()
    if isinstance(func, torch._ops.OpOverload):
        positions = _schema_writes(func._schema)
    elif name in _IN_PLACE_DUNDERS:
        positions = (0,)
    elif name.endswith("_") and not name.endswith("__") and name not in _HARMLESS:
        positions = _aten_writes(name)
        if not args:  # nn.init passes the tensor it fills by keyword
            first = _tensors(kwargs)[:1]
            return [(t, name) for t in first]
    found = [(t, name) for i in positions if i < len(args) for t in _tensors(args[i])]
    if kwargs.get("out") is not None:
        found += [(t, f"{name}(out=...)") for t in _tensors(kwargs["out"])]
    if kwargs.get("inplace") is True and args:
        found += [(t, f"{name}(inplace=True)") for t in _tensors(args[0])]
    return found


@functools.cache
def _aten_writes(name: str) -> tuple[int, ...]:
    """Positions of the arguments the aten op ``name`` writes to, in any overload; ``(0,)`` (self)
    for an in-place method that is not an aten op (``share_memory_``, ``apply_``)."""
    try:
        packet = getattr(torch.ops.aten, name)
        schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
    except (AttributeError, RuntimeError):
        return (0,)
    positions = sorted({i for schema in schemas for i in _schema_writes(schema)})
    return tuple(positions) or (0,)


def _schema_writes(schema: Any) -> tuple[int, ...]:
    return tuple(
        i
        for i, argument in enumerate(schema.arguments)
        if not argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
    )


def _message(tensor: torch.Tensor, how: str, needs_data: bool = False) -> str:
    what = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
    does = (
        "needs its data pointer, which a placeholder does not hand out"
        if needs_data
        else "would write to it or change its shape, strides or storage in place"
    )
    return f"tensor {what} is parked by memlab.Courtesy until restore(): {how} {does}; call restore() first"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _shadows(args: tuple, kwargs: dict) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """``(args, kwargs)`` with every tensor replaced by a ``meta`` tensor of its real geometry
    (parked ones: where they sit in their parking), and a map from shadow ``id`` to real tensor."""
    real: dict[int, torch.Tensor] = {}

    def shadow(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        parking = parking_of(leaf)
        view = None if parking is None else parking.view_of(leaf)
        if parking is not None and view is not None:
            made = parking.shadow(view)
        else:
            made = torch.empty_strided(leaf.size(), leaf.stride(), dtype=leaf.dtype, device="meta")
        real[id(made)] = leaf
        return made

    try:
        return pytree.tree_map(shadow, (args, kwargs)), real
    except (RuntimeError, NotImplementedError, TypeError):  # a layout meta cannot copy
        return None


def _run_on_shadows(
    func: Any, args: tuple, kwargs: dict
) -> tuple[list[Any], Any, dict[int, torch.Tensor]] | None:
    """``func`` run on the shadows of its arguments: the result's leaves, its spec, the shadow map."""
    with _disable_current_modes(), torch.no_grad():  # memlab's bookkeeping: no tracker sees it
        made = _shadows(args, kwargs)
        if made is None:
            return None
        (shadow_args, shadow_kwargs), real = made
        try:
            result = func(*shadow_args, **shadow_kwargs)
        except Exception:  # an op meta cannot run: the view is not followed
            return None
    leaves, spec = pytree.tree_flatten(result)
    return leaves, spec, real


def _follow(func: Any, args: tuple, kwargs: dict, result: Any, name: str) -> Any:
    """``result`` with every tensor that aliases a parked storage parked too (see the module)."""
    leaves, spec = pytree.tree_flatten(result)
    inputs = {id(t) for t in _tensors((args, kwargs))}
    new = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and id(leaf) not in inputs]
    if not any(_needs_shadow(leaf) for leaf in new):
        return result
    shadowed = _run_on_shadows(func, args, kwargs)
    if shadowed is None or len(shadowed[0]) != len(leaves):
        stray = [leaf for leaf in new if parking_of(leaf) is not None]
        if stray:
            raise ParkedTensorError(_unfollowed(stray[0], name))
        return result
    shadow_leaves, _, real = shadowed
    matched = [_match(leaf, shadow, real, name) for leaf, shadow in zip(leaves, shadow_leaves, strict=True)]
    return pytree.tree_unflatten(matched, spec)


def _needs_shadow(leaf: torch.Tensor) -> bool:
    """Whether ``leaf`` may alias a parked storage in the real op: a tensor over a placeholder not
    yet followed, or any new tensor (``contiguous()`` copies a placeholder but returns a parked
    tensor itself). Tensors of other devices (``.cuda()`` of a placeholder) are copies."""
    parking = parking_of(leaf)
    if parking is not None:
        return parking.view_of(leaf) is None
    return leaf.device.type == "cpu" and leaf.layout is torch.strided


def _match(leaf: Any, shadow: Any, real: dict[int, torch.Tensor], name: str) -> Any:
    if not isinstance(leaf, torch.Tensor) or not isinstance(shadow, torch.Tensor):
        return leaf
    if id(shadow) in real:  # the op returned one of its arguments (contiguous(), to())
        return real[id(shadow)]
    parking = parking_of_shadow(shadow)
    if parking is None:  # a new tensor on real data: a copy, even where a placeholder viewed
        return leaf.clone() if parking_of(leaf) is not None else leaf
    if parking_of(leaf) is not parking:
        if parking_of(leaf) is not None:
            raise ParkedTensorError(_unfollowed(leaf, name))
        # a copy of a placeholder where real data would be viewed: a placeholder in its place
        leaf = parking.placeholder(shadow.dtype, tuple(shadow.size()), leaf.is_inference())
    elif parking.view_of(leaf) is not None:
        return leaf
    follow(parking, leaf, View.of(leaf, like=shadow))
    return leaf


def _from_shadows_only(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The result of a view op that failed on placeholders, made from the shadows where every
    tensor it returns is a view of a parking; ``None`` otherwise."""
    shadowed = _run_on_shadows(func, args, kwargs)
    if shadowed is None:
        return None
    leaves, spec, _ = shadowed
    inference = any(t.is_inference() for t in _tensors((args, kwargs)))
    made = []
    for shadow in leaves:
        if not isinstance(shadow, torch.Tensor):
            made.append(shadow)
            continue
        parking = parking_of_shadow(shadow)
        if parking is None:
            return None
        leaf = parking.placeholder(shadow.dtype, tuple(shadow.size()), inference)
        follow(parking, leaf, View.of(leaf, like=shadow))
        made.append(leaf)
    return pytree.tree_unflatten(made, spec)


def _unfollowed(tensor: torch.Tensor, how: str) -> str:
    what = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
    return (
        f"memlab.Courtesy cannot follow {how} of a parked tensor (it made tensor {what} over the parked "
        "storage, at a place it cannot work out); take it after restore()"
    )
