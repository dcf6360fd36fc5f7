"""Real values a data-free run computes alongside its fake tensors, for the tensors it can know.

A tensor computed only from the step's inputs and buffers (token ids, masks, labels, ``arange``,
``ones``: no parameter, no random op) has a value the run can compute cheaply: :class:`KnownValues`
runs each op whose inputs all have values on CPU copies of those values too, while the outputs stay
small (:data:`KNOWN_LIMIT` elements), and keeps the result on the fake output. Views of a known
tensor get views of its value, so an in-place write through any of them updates all; a write by an
op whose inputs are not all known marks the storage's values wrong (a flag shared by every tensor
on it). Ops whose output size depends on values (``nonzero``, a boolean mask) run on known inputs
and give outputs of the real size.

Unknown values (what depends on weights) are taken as finite: comparisons that finiteness alone
answers are known (``isnan``/``isinf``/``isfinite``, ``x != inf``, ``x == x``), and a GradScaler's
found-inf flag stays as it was (``_amp_foreach_non_finite_check_and_unscale_`` finds no inf), as in a
real step without overflow. A value that rests on that assumption says so (:meth:`KnownValues.assumed`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_map_only

__all__ = ["KNOWN_LIMIT", "KnownValues"]

#: The largest tensor (elements) whose real value a data-free run computes alongside it.
KNOWN_LIMIT = 1 << 20

_VALUE = "_memlab_value"  # a FakeTensor's real value (a CPU tensor), when known
_CELL = "_memlab_cell"  # on a fake storage: whether the values of the tensors on it are still right
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
aten = torch.ops.aten

# Ops whose outputs' values are not a function of their inputs' values.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_"}
# What finiteness alone answers, for any value: isnan(x) is False, isfinite(x) True, ...
_FINITE_UNARY = {
    aten.isnan.default: False,
    aten.isinf.default: False,
    aten.isposinf.default: False,
    aten.isneginf.default: False,
    aten.isfinite.default: True,
}
# x == inf is False, x != inf True, x < inf True, ... (x compared with an infinite scalar)
_FINITE_COMPARE = {
    aten.eq.Scalar: lambda inf: False,
    aten.ne.Scalar: lambda inf: True,
    aten.lt.Scalar: lambda inf: inf > 0,
    aten.le.Scalar: lambda inf: inf > 0,
    aten.gt.Scalar: lambda inf: inf < 0,
    aten.ge.Scalar: lambda inf: inf < 0,
}
_SELF_COMPARE = {aten.eq.Tensor: True, aten.ne.Tensor: False}  # x == x is True: x is not NaN
_FOUND_INF = aten._amp_foreach_non_finite_check_and_unscale_.default
_FINITE_IDS = {id(op) for op in (*_FINITE_UNARY, *_FINITE_COMPARE, *_SELF_COMPARE, _FOUND_INF)}  # fast lookup


class _Cell:
    """Whether the values recorded for the tensors on one fake storage are still right."""

    __slots__ = ("assumed", "valid")

    def __init__(self, assumed: bool) -> None:
        self.valid = True
        self.assumed = assumed  # the value rests on the assumption that unknown values are finite


class KnownValues:
    """The values of the fake tensors of one run under ``mode`` that it can know (module docstring)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self._writes: dict[Any, tuple[int, ...]] = {}  # op -> positions of the arguments it writes

    def know(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Record ``real``'s value (copied) as ``fake``'s: an input or buffer of the step."""
        if not isinstance(fake, FakeTensor) or real.numel() > KNOWN_LIMIT or real.is_sparse:
            return
        if type(real) is not torch.Tensor:  # a wrapper subclass (DTensor) is not copied under no_dispatch
            return
        with no_dispatch():
            value = real.detach().to("cpu", copy=True)
        setattr(fake, _VALUE, value)
        storage = fake.untyped_storage()
        if getattr(storage, _CELL, None) is None:
            setattr(storage, _CELL, _Cell(assumed=False))

    def know_inputs(self, copier: Any) -> None:
        """Record the values of the step's inputs (the tensors among its arguments that are not
        parameters and need no gradient) and of its modules' buffers, from the originals of
        ``copier``'s copies (a :class:`~memlab.estimate.copies.Copier` before ``release()``)."""
        originals = {
            id(copy): original for copy, original in zip(copier.copies, copier.originals, strict=True)
        }
        buffers = [buffer for module in copier.modules for buffer in module.buffers()]
        for copy in [*copier.inputs, *buffers]:
            original = originals.get(id(copy))
            if original is not None and not original.requires_grad:
                self.know(copy, original)

    def value(self, tensor: Any) -> torch.Tensor | None:
        """``tensor``'s real value if this run knows it, else None."""
        if not isinstance(tensor, FakeTensor):  # a user's real tensor: a plain CPU one has its value
            plain = type(tensor) is torch.Tensor and tensor.device.type == "cpu"
            return tensor if plain and tensor.numel() <= KNOWN_LIMIT else None
        value = tensor.__dict__.get(_VALUE)
        if value is not None:
            cell = getattr(tensor.untyped_storage(), _CELL, None)
            return value if cell is not None and cell.valid else None
        return tensor.constant  # FakeTensorMode's own constants (an optimizer's step counter)

    def assumed(self, tensor: Any) -> bool:
        """Whether ``tensor``'s value rests on the assumption that unknown values are finite."""
        return _assumed(tensor)

    def literal(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor PyTorch made of Python data (``torch.tensor([...])``, the index of
        ``x[:, [-1, 0]]``), as the fake tensor FakeTensorMode makes of it, carrying its value."""
        with no_dispatch():
            value = tensor.detach().clone()
        fake = FakeTensorConverter.from_real_tensor(self.mode.fake_tensor_converter, self.mode, value)
        setattr(fake, _VALUE, value)
        setattr(fake.untyped_storage(), _CELL, _Cell(assumed=False))
        return fake

    def unknown(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor made of Python data that holds placeholders, as a fake tensor without a value."""
        with no_dispatch():
            value = tensor.detach().clone()
        return FakeTensorConverter.from_real_tensor(self.mode.fake_tensor_converter, self.mode, value)

    def propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """After ``func`` made ``out`` from ``args``: the values of its outputs, where it can know them."""
        tensors = _tensors(args, kwargs)
        if id(func) in _FINITE_IDS:
            values = [self.value(t) for t in tensors]
            if self._finite(func, args, out, values):
                return
            known = None not in values
        else:  # most ops: stop at the first input whose value is not known
            value = self.value
            known = all(value(t) is not None for t in tensors)
        if known and self._computable(func, args, kwargs, tensors, out):
            real = self._compute(func, args, kwargs)
            if real is not None and self._attach(out, real, any(_assumed(t) for t in tensors)):
                return
        for tensor in self._written(func, args, kwargs):
            _invalidate(tensor)

    def _computable(self, func: Any, args: Any, kwargs: Any, tensors: list[Any], out: Any) -> bool:
        """Whether ``func``'s outputs, from inputs whose values are all known, can be known too."""
        outputs = _tensors(out, {})
        if not outputs or sum(t.numel() for t in outputs) > KNOWN_LIMIT:
            return False
        if any(t.layout is not torch.strided for t in outputs):
            return False  # a value is kept on its storage, which a sparse tensor does not have
        if all(isinstance(t, FakeTensor) and t.constant is not None for t in outputs):
            return False  # FakeTensorMode made constants of them (a one-element literal)
        if tensors and all(isinstance(t, FakeTensor) and t.constant is not None for t in tensors):
            return False  # FakeTensorMode propagates its own constants
        written = self._written(func, args, kwargs)
        return (
            func.overloadpacket.__name__ not in _UNINITIALISED
            and torch.Tag.nondeterministic_seeded not in func.tags
            and not any(isinstance(a, _SYM) for a in _flat(args, kwargs))
            and all(isinstance(t, FakeTensor) and t.constant is None for t in written)
        )

    def _compute(self, func: Any, args: Any, kwargs: Any) -> Any:
        def real(a: Any) -> Any:
            if isinstance(a, FakeTensor):
                return self.value(a)
            if isinstance(a, torch.Tensor):  # a user's plain CPU tensor (value()): never a view of it
                return a.detach().clone()
            if isinstance(a, torch.device):
                return torch.device("cpu")
            if isinstance(a, (list, tuple)):
                return type(a)(real(i) for i in a)
            return a

        threads = torch.get_num_threads()
        try:
            # One thread: these tensors are small, and some kernels (tril) open a parallel region
            # whatever the size, which costs milliseconds on a busy machine (microseconds on one).
            if threads > 1:
                torch.set_num_threads(1)
            with no_dispatch():  # plain CPU tensors only (value()): no wrapper subclass reaches here
                call_kwargs = {k: real(v) for k, v in kwargs.items()}
                if call_kwargs.get("pin_memory"):
                    call_kwargs["pin_memory"] = False
                return func(*[real(a) for a in args], **call_kwargs)
        except Exception:  # a kernel CPU lacks (a device's own op): the value stays unknown
            return None
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def _attach(self, out: Any, real: Any, assumed: bool) -> bool:
        fakes, reals = _tensors(out, {}), _tensors(real, {})
        if len(fakes) != len(reals) or any(f.shape != r.shape for f, r in zip(fakes, reals, strict=True)):
            return False
        for fake, value in zip(fakes, reals, strict=True):
            if not isinstance(fake, FakeTensor):
                continue
            setattr(fake, _VALUE, value)
            storage = fake.untyped_storage()
            cell = getattr(storage, _CELL, None)
            if cell is None:
                setattr(storage, _CELL, _Cell(assumed))
            else:
                cell.assumed = cell.assumed or assumed
        return True

    def _finite(self, func: Any, args: Any, out: Any, values: list[Any]) -> bool:
        """Apply what finiteness answers (module docstring); False where it answers nothing."""
        if func is _FOUND_INF:  # grads, found_inf, inv_scale: finite gradients leave found_inf as it is
            for grad in args[0]:
                _invalidate(grad)
            cell = getattr(args[1].untyped_storage(), _CELL, None)
            if cell is not None:
                cell.assumed = True
            return True
        if any(v is not None for v in values) or not isinstance(out, FakeTensor) or out.numel() > KNOWN_LIMIT:
            return False
        if func in _FINITE_UNARY:
            answer = _FINITE_UNARY[func]
        elif func in _FINITE_COMPARE:
            if not (isinstance(args[1], float) and math.isinf(args[1])):
                return False
            answer = _FINITE_COMPARE[func](args[1])
        elif args[0] is args[1]:
            answer = _SELF_COMPARE[func]
        else:
            return False
        with no_dispatch():
            value = torch.full(out.shape, answer, dtype=out.dtype)
        return self._attach(out, value, assumed=True)

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op whose output size depends on values (``nonzero``), on known inputs: its real output,
        made fake (a new storage of the real size), with its value known."""
        tensors = _tensors(args, kwargs)
        if not tensors or any(self.value(t) is None for t in tensors):
            return None
        real = self._compute(func, args, kwargs)
        if real is None:
            return None

        def fake(value: torch.Tensor) -> torch.Tensor:
            made = FakeTensorConverter.from_real_tensor(self.mode.fake_tensor_converter, self.mode, value)
            setattr(made, _VALUE, value)
            setattr(made.untyped_storage(), _CELL, _Cell(any(_assumed(t) for t in tensors)))
            return made

        return tree_map_only(torch.Tensor, fake, real)

    def _written(self, func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
        positions = self._writes.get(func)
        if positions is None:
            positions = self._writes[func] = tuple(
                i
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
        if not positions:
            return []
        arguments = func._schema.arguments
        found = []
        for i in positions:
            value = args[i] if i < len(args) else kwargs.get(arguments[i].name)
            found += _tensors(value, {})
        return found


def _flat(args: Any, kwargs: Any) -> list[Any]:
    """The arguments, with lists and tuples among them opened one level (foreach ops' lists)."""
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if type(value) is list or type(value) is tuple:
            found.extend(value)
        else:
            found.append(value)
    return found


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among ``args`` (a tensor, or a list or tuple of arguments) and ``kwargs``."""
    if isinstance(args, torch.Tensor):
        return [args]
    if not isinstance(args, (list, tuple)):
        return []
    return [t for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)]


def _cell(tensor: torch.Tensor) -> _Cell | None:
    """The value cell on a fake tensor's storage (``None``: none, or no storage: a sparse tensor)."""
    if not isinstance(tensor, FakeTensor) or tensor.layout is not torch.strided:
        return None
    return getattr(tensor.untyped_storage(), _CELL, None)


def _assumed(tensor: torch.Tensor) -> bool:
    cell = _cell(tensor)
    return cell is not None and cell.assumed


def _invalidate(tensor: torch.Tensor) -> None:
    cell = _cell(tensor)
    if cell is not None:
        cell.valid = False
