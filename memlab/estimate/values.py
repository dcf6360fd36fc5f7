"""What a data-free run answers when the step reads its tensors' values on the host.

Training code reads values: ``loss.item()`` to log, ``torch.all(mask == 1)`` to choose a branch,
``clip_grad_norm_(...).item()``, a GradScaler's found-inf flags, ``.tolist()``, ``.numpy()``.
Fake tensors have no values, so without help each read would force a real run. :class:`HostValues`
sits under the tracker, above ``FakeTensorMode``, and gives every value one of two answers:

- **known**: tensors computed only from the step's inputs and buffers (token ids, masks, labels,
  ``torch.arange``, ``torch.ones``: no parameter, no random op) carry their real values, computed
  op by op on CPU copies while they stay small (:data:`KNOWN_LIMIT` elements per tensor). Reading
  one gives its true value, so a branch on an attention mask takes the side the real run takes;
  ops whose output size depends on values (``nonzero``, a boolean mask) run on them and give the
  exact size. A write by an op whose inputs are not all known makes the storage's value unknown.
- **unknown** (what depends on weights: a loss, a gradient norm): ``.item()`` gives an unbacked
  ``SymFloat``/``SymInt``/``SymBool`` of the fake mode's ``ShapeEnv`` (PyTorch's symbols for values
  it does not have). Host code may keep, add, format (``f"{loss:.4f}"``) and log them; read as a
  ``float`` (``float()``, ``math.exp``) it is 0.0, a placeholder that only feeds logging. Read as an
  ``int`` (``int()``, ``range``, an index) or passed to an op as a size, it may decide an
  allocation; read as a ``bool`` (``if``, ``not``, a comparison), it decides a branch that may
  allocate. The run cannot know which, so it stops there and the estimate runs for real
  (``forced_by`` names the read, its line and the line the value came from). ``.numpy()`` of an
  unknown value gives zeros (NumPy arrays carry no symbols), named in ``caveats``.

Unknown values are taken as finite: comparisons that finiteness alone answers are known
(``isnan``/``isinf``/``isfinite``, ``x != inf``, ``x == x``), and a GradScaler's found-inf flags
stay 0 (``_amp_foreach_non_finite_check_and_unscale_`` finds no inf), as in a real step without
overflow; reading such a value names the assumption in ``caveats``. If the run fails after a host
read of an unknown value (a placeholder can: ``math.log(0.0)``), it is re-run for real.
"""

from __future__ import annotations

import linecache
import math
import sys
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorConverter,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.history.recorder import capture_stack

__all__ = ["FINITE", "KNOWN_LIMIT", "HostValues", "ValueNeeded", "fake_mode_with_values"]

#: The end of the caveat for a value that rests on the assumption that unknown values are finite.
FINITE = "rests on the assumption that values the estimate does not have are finite (no inf, no NaN)"

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
_LIFT = {aten.lift_fresh.default, aten.lift_fresh_copy.default}  # a tensor made of Python data


class ValueNeeded(RuntimeError):
    """A value the data-free run does not have decides something it cannot take on trust."""


class _Cell:
    """Whether the values recorded for the tensors on one fake storage are still right."""

    __slots__ = ("assumed", "valid")

    def __init__(self, assumed: bool) -> None:
        self.valid = True
        self.assumed = assumed  # the value rests on the assumption that unknown values are finite


class _HostReads(ShapeEnv):
    """A ``ShapeEnv`` whose unknown values, read on the host, are answered by :class:`HostValues`."""

    values: HostValues

    def evaluate_sym_node(
        self, sym_node: Any, size_oblivious: bool = False, fallback_value: Any = None
    ) -> Any:
        if fallback_value is None and free_unbacked_symbols(sym_node.expr):
            return self.values.host_read(sym_node)
        return super().evaluate_sym_node(sym_node, size_oblivious, fallback_value)


def fake_mode_with_values() -> tuple[FakeTensorMode, HostValues]:
    """A ``FakeTensorMode`` whose ``.item()`` gives unbacked symbols (input shapes stay static),
    and the :class:`HostValues` to enter above it."""
    shapes = _HostReads(allow_dynamic_output_shape_ops=False)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shapes, static_shapes=True)
    values = HostValues(mode)
    shapes.values = values
    return mode, values


class HostValues(TorchDispatchMode):
    """Known values computed alongside a fake run, and the host's reads of values (see the module
    docstring). Enter it above ``mode`` (made by :func:`fake_mode_with_values`) and below the
    tracker. ``forced_by``: why the run needs real values (the op or read, and the line), or None;
    ``caveats``: what the run took without having it (one sentence each)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self.mode = mode
        self.forced_by: str | None = None
        self.caveats: list[str] = []
        self._origins: dict[Any, str] = {}  # unknown value's symbol -> where it was read from a tensor
        self._first_read: str | None = None  # the first host read of an unknown value
        self._writes: dict[Any, tuple[int, ...]] = {}  # op -> positions of the arguments it writes
        self._sizes: dict[Any, tuple[int, ...]] = {}  # op -> positions of its SymInt arguments
        self._patched: dict[tuple[type, str], Any] = {}

    # -- values the step's inputs carry ------------------------------------------------------------
    def know(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Record ``real``'s value (copied) as ``fake``'s: an input or buffer of the step."""
        if not isinstance(fake, FakeTensor) or real.numel() > KNOWN_LIMIT or real.is_sparse:
            return
        if type(real) is not torch.Tensor and not isinstance(real, torch.nn.Parameter):
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

    def known(self, tensor: Any) -> torch.Tensor | None:
        """``tensor``'s real value if this run knows it, else None."""
        if not isinstance(tensor, FakeTensor):
            return tensor if isinstance(tensor, torch.Tensor) else None
        value = tensor.__dict__.get(_VALUE)
        if value is not None:
            cell = getattr(tensor.untyped_storage(), _CELL, None)
            return value if cell is not None and cell.valid else None
        return tensor.constant  # FakeTensorMode's own constants (an optimizer's step counter)

    # -- the mode ------------------------------------------------------------------------------
    def __enter__(self) -> HostValues:
        for cls in _SYM:
            self._patch(cls, "__format__", self._format(cls.__dict__.get("__format__", object.__format__)))
        self._patch(FakeTensor, "numpy", self._numpy(FakeTensor.numpy))
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        for (cls, name), original in self._patched.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._patched.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._origins:
            self._check_sizes(func, args, kwargs)
        if func is aten._local_scalar_dense.default:
            return self._item(func, args[0])
        if func in _LIFT and type(args[0]) is torch.Tensor and args[0].numel() <= KNOWN_LIMIT:
            return self._literal(args[0])
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self._run_on_values(func, args, kwargs)
            if out is None:
                raise
            return out
        self._propagate(func, args, kwargs, out)
        return out

    def _literal(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor PyTorch made of Python data (``torch.tensor([...])``, the index of
        ``x[:, [-1, 0]]``), as the fake tensor FakeTensorMode makes of it, carrying its value."""
        with no_dispatch():
            value = tensor.detach().clone()
        fake = FakeTensorConverter.from_real_tensor(self.mode.fake_tensor_converter, self.mode, value)
        setattr(fake, _VALUE, value)
        setattr(fake.untyped_storage(), _CELL, _Cell(assumed=False))
        return fake

    # -- reads ---------------------------------------------------------------------------------
    def _item(self, func: Any, tensor: torch.Tensor) -> Any:
        value = self.known(tensor)
        if value is not None:
            self._note_assumed(tensor, "read")
            with no_dispatch():
                return value.item()
        out = func(tensor)  # an unbacked symbol (or a constant's value)
        if isinstance(out, _SYM):
            for symbol in free_unbacked_symbols(out.node.expr):
                self._origins.setdefault(symbol, _where())
        return out

    def host_read(self, node: Any) -> Any:
        """The host reads an unknown value (``float()``, ``int()``, ``bool()``): see the module docstring."""
        where = _where()
        if self._first_read is None:
            self._first_read = where
        asked = _asked(node.pytype)
        if asked is int:
            self._force(f"an integer the estimate does not have (int(), an index, a size) at {where}", node)
        if asked is bool:
            self._force(
                f"a branch on a value the estimate does not have (if, bool(), a comparison) at {where}", node
            )
        return float(self.placeholder(node))

    def placeholder(self, node: Any) -> Any:
        """``node``'s value with every unknown value taken as 0."""
        value = node.expr.xreplace({symbol: 0 for symbol in node.expr.free_symbols})
        if value is sympy.true or value is sympy.false:
            return bool(value)
        return node.pytype(value)

    def failed(self, error: BaseException) -> None:
        """The fake run raised ``error``: after a host read of an unknown value, the placeholder may be
        the cause, so the run needs real values."""
        if self.forced_by is None and self._first_read is not None and not isinstance(error, ValueNeeded):
            self.forced_by = (
                f"the run failed ({type(error).__name__}: {error}) after reading a value the estimate "
                f"does not have at {self._first_read}"
            )

    def _force(self, what: str, node: Any) -> None:
        if self.forced_by is None:
            origins = [self._origins.get(s) for s in sorted(free_unbacked_symbols(node.expr), key=str)]
            elsewhere = [o for o in dict.fromkeys(origins) if o is not None and not what.endswith(f" at {o}")]
            self.forced_by = what + ("; read from a tensor at " + ", ".join(elsewhere) if elsewhere else "")
        raise ValueNeeded(self.forced_by)

    def _check_sizes(self, func: Any, args: Any, kwargs: Any) -> None:
        positions = self._sizes.get(func)
        if positions is None:
            positions = self._sizes[func] = tuple(
                i
                for i, a in enumerate(func._schema.arguments)
                if "int" in str(a.type)  # SymInt, SymInt?, SymInt[] (a Scalar is a "number")
            )
        names = [func._schema.arguments[i].name for i in positions]
        for i, name in zip(positions, names, strict=True):
            value = args[i] if i < len(args) else kwargs.get(name)
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.SymInt) and free_unbacked_symbols(item.node.expr):
                    op = f"aten.{func.overloadpacket.__name__}"
                    self._force(f"{op} takes a size the estimate does not have at {_where()}", item.node)

    def _note_assumed(self, tensor: Any, how: str) -> None:
        cell = getattr(tensor.untyped_storage(), _CELL, None) if isinstance(tensor, FakeTensor) else None
        if cell is not None and cell.assumed:
            caveat = f"a value {how} at {_where()} {FINITE}"
            if caveat not in self.caveats:
                self.caveats.append(caveat)

    # -- known values, op by op ------------------------------------------------------------------
    def _propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        tensors = _tensors(args, kwargs)
        written = self._written(func, args, kwargs)
        values = [self.known(t) for t in tensors]
        if func in _FINITE_UNARY or func in _FINITE_COMPARE or func in _SELF_COMPARE or func is _FOUND_INF:
            if self._finite(func, args, out, values):
                return
        name = func.overloadpacket.__name__
        computable = (
            all(v is not None for v in values)
            and name not in _UNINITIALISED
            and torch.Tag.nondeterministic_seeded not in func.tags
            and not any(isinstance(a, _SYM) for a in _flat(args, kwargs))
            and not any(isinstance(t, FakeTensor) and t.constant is not None for t in written)
            and not any(not isinstance(t, FakeTensor) for t in written)
            and sum(t.numel() for t in _tensors(out, {})) <= KNOWN_LIMIT
        )
        if computable and (tensors or _tensors(out, {})):
            if tensors and all(isinstance(t, FakeTensor) and t.constant is not None for t in tensors):
                return  # FakeTensorMode propagated its own constants
            assumed = any(_assumed(t) for t in tensors)
            real = self._compute(func, args, kwargs)
            if real is not None and self._attach(out, real, assumed):
                return
        for tensor in written:
            _invalidate(tensor)

    def _compute(self, func: Any, args: Any, kwargs: Any) -> Any:
        def real(a: Any) -> Any:
            if isinstance(a, FakeTensor):
                return self.known(a)
            if isinstance(a, torch.Tensor):  # a real tensor of the user's: never a view of it, never written
                return a.detach().clone()
            if isinstance(a, torch.device):
                return torch.device("cpu")
            if isinstance(a, (list, tuple)):
                return type(a)(real(i) for i in a)
            return a

        call_kwargs = {k: real(v) for k, v in kwargs.items()}
        if call_kwargs.get("pin_memory"):
            call_kwargs["pin_memory"] = False
        try:
            with no_dispatch():
                return func(*[real(a) for a in args], **call_kwargs)
        except Exception:  # a kernel CPU lacks (a device's own op): the value stays unknown
            return None

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

    def _run_on_values(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op whose output size depends on values (``nonzero``), on known inputs: its real output,
        made fake (a new storage of the real size), with its value known."""
        tensors = _tensors(args, kwargs)
        if not tensors or any(self.known(t) is None for t in tensors):
            return None
        real = self._compute(func, args, kwargs)
        if real is None:
            return None
        from torch.utils._pytree import tree_map_only

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

    # -- host conversions fake tensors lack --------------------------------------------------------
    def _patch(self, cls: type, name: str, function: Any) -> None:
        self._patched[(cls, name)] = cls.__dict__.get(name)
        setattr(cls, name, function)

    def _format(self, original: Callable[..., str]) -> Callable[..., str]:
        values = self

        def __format__(number: Any, spec: str) -> str:
            if getattr(number.node, "shape_env", None) is values.mode.shape_env:
                return format(values.placeholder(number.node), spec)
            return original(number, spec)

        return __format__

    def _numpy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        values = self

        def numpy(tensor: Any, *, force: bool = False) -> Any:
            if tensor.fake_mode is not values.mode:
                return original(tensor, force=force)
            value = values.known(tensor)
            if value is not None:
                values._note_assumed(tensor, "read into NumPy")
                with no_dispatch():
                    return value.detach().numpy(force=force).copy()
            caveat = f".numpy() at {_where()} read values the estimate does not have: it gave zeros"
            if caveat not in values.caveats:
                values.caveats.append(caveat)
            with no_dispatch():
                return torch.zeros(tensor.shape, dtype=tensor.dtype).numpy()

        return numpy


def _where() -> str:
    """The innermost line of user code running now, as ``file:line: code``."""
    stack = capture_stack()
    if not stack:
        return "an unknown line"
    filename, line, _ = stack[0]
    code = linecache.getline(filename, line).strip()
    return f"{filename}:{line}" + (f": {code}" if code else "")


def _asked(pytype: type) -> type:
    """What the host asked for: ``bool`` for ``SymNode.guard_bool`` (``if``, ``not``, a comparison),
    ``float`` for ``guard_float``, ``int`` for ``guard_int``; else the value's own type."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        asked = _GUARDS.get(frame.f_code.co_name)
        if asked is not None:
            return asked
        frame = frame.f_back
    return pytype


_GUARDS = {"guard_bool": bool, "guard_size_oblivious": bool, "guard_float": float, "guard_int": int}


def _flat(args: Any, kwargs: Any) -> list[Any]:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            found.extend(value)
        else:
            found.append(value)
    return found


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if not isinstance(args, (list, tuple)):
        return []
    return [t for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)]


def _assumed(tensor: torch.Tensor) -> bool:
    cell = getattr(tensor.untyped_storage(), _CELL, None) if isinstance(tensor, FakeTensor) else None
    return cell is not None and cell.assumed


def _invalidate(tensor: torch.Tensor) -> None:
    cell = getattr(tensor.untyped_storage(), _CELL, None) if isinstance(tensor, FakeTensor) else None
    if cell is not None:
        cell.valid = False
