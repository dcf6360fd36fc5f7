"""What a data-free run answers when the step reads its tensors' values on the host.

Training code reads values: ``loss.item()`` to log, ``torch.all(mask == 1)`` to choose a branch,
``clip_grad_norm_(...).item()``, a GradScaler's found-inf flags, ``.tolist()``, ``.numpy()``.
Fake tensors have no values, so without help each read would force a real run. :class:`HostValues`
sits under the tracker, above ``FakeTensorMode``, and gives every value one of two answers:

- **known**: tensors computed only from the step's inputs and buffers (token ids, masks, labels,
  ``torch.arange``) carry their real values, computed alongside (:mod:`memlab.estimate.known`).
  Reading one gives its true value, so a branch on an attention mask takes the side the real run
  takes, and sizes they decide (``nonzero``, a boolean mask, ``x[: n.item()]``) are exact.
- **unknown** (what depends on weights: a loss, a gradient norm): ``.item()`` gives an unbacked
  ``SymFloat``/``SymInt``/``SymBool`` of a ``ShapeEnv`` (PyTorch's symbols for values
  it does not have). Host code may keep, add, format (``f"{loss:.4f}"``) and log them; read as a
  ``float`` (``float()``, ``math.exp``) it is 0.0, a placeholder that only feeds logging (the next
  tensor made of Python data, ``torch.tensor(loss.item())``, is taken as unknown). Read as an
  ``int`` (``int()``, ``range``, an index) or passed to an op as a size, it may decide an
  allocation; read as a ``bool`` (``if``, ``not``, a comparison), it decides a branch that may
  allocate. The run cannot know which, so it stops there and the estimate runs for real
  (``forced_by`` names the read, its line and the line the value came from). ``.numpy()`` of an
  unknown value gives zeros (NumPy arrays carry no symbols), named in ``caveats``.

Unknown values are taken as finite (:mod:`memlab.estimate.known`): ``isnan(loss)`` is known to be
False, a GradScaler's found-inf flag stays 0; a read of such a value names the assumption in
``caveats``. If the run fails after a host read of an unknown value (a placeholder can:
``math.log(0.0)``), it is re-run for real.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

from memlab.estimate.fake_cache import FaithfulFakeTensorMode
from memlab.estimate.known import KNOWN_LIMIT, KnownValues
from memlab.estimate.modes import UnwrappedDispatch
from memlab.estimate.result import EstimateError
from memlab.history.recorder import capture_stack

__all__ = ["FINITE", "HostValues", "ValueNeeded", "fake_mode_with_values", "stands_for"]

#: The end of the caveat for a value that rests on the assumption that unknown values are finite.
FINITE = "rests on the assumption that values the estimate does not have are finite (no inf, no NaN)"

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
aten = torch.ops.aten
_LIFT = {id(aten.lift_fresh.default), id(aten.lift_fresh_copy.default)}  # a tensor made of Python data
_ITEM = aten._local_scalar_dense.default


class ValueNeeded(RuntimeError):
    """A value the data-free run does not have decides something it cannot take on trust."""


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
    """A ``FakeTensorMode`` whose ``.item()`` gives unbacked symbols (input shapes stay static) and
    whose dispatch cache keeps storage sharing (:mod:`memlab.estimate.fake_cache`), and the
    :class:`HostValues` to enter above it."""
    mode = FaithfulFakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    values = HostValues(mode)
    mode.shape_env_on_demand = values.shapes  # for a nested jagged tensor's ragged size
    return mode, values


def _outside_modes(make_dummy: Callable[[], Any]) -> Callable[[], Any]:
    """``torch/nested/_internal/nested_tensor.py``'s ``_nt_view_dummy``, which makes at the first
    nested jagged tensor of the process a dummy one that PyTorch keeps for good, run outside the
    estimate's modes: made inside a step it would be a fake tensor, counted by the first estimate of
    the process (1 KiB) and left behind. A process whose steps make none is left without one."""

    def dummy() -> Any:
        with _disable_current_modes():
            return make_dummy()

    return dummy


def stands_for(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Inside a data-free estimate, record that ``fake``, a tensor the run made, holds ``real``'s
    values: data the real program has but the run makes anew where the program would (a batch a
    data loader collates, :mod:`memlab.integrations`), so that what the step reads of it (an
    attention-mask check) is known. Outside such a run, or for a tensor that is not fake, nothing."""
    for mode in _get_current_dispatch_mode_stack():
        values = mode if isinstance(mode, HostValues) else getattr(mode, "host_values", None)
        if isinstance(values, HostValues):  # the estimate's tracker calls it, off the stack
            values.known.know(fake, real)
            return


class HostValues(UnwrappedDispatch, TorchDispatchMode):
    """Known values computed alongside a fake run, and the host's reads of values (see the module
    docstring). Enter it above ``mode`` (made by :func:`fake_mode_with_values`) and below the
    tracker. ``forced_by``: why the run needs real values (the op or read, and the line), or None;
    ``caveats``: what the run took without having it (one sentence each)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self.mode = mode
        # Given to the mode at the first .item() of an unknown value (a step's last line, often):
        # a FakeTensorMode with a ShapeEnv runs every op 2-20 % slower (benchmarks/bench_values.py).
        self.shapes = _HostReads(allow_dynamic_output_shape_ops=False)
        self.shapes.values = self
        self._placeholder_read = False  # a float placeholder was read since the last literal
        self.forced_by: str | None = None
        self.caveats: list[str] = []
        self._origins: dict[Any, str] = {}  # unknown value's symbol -> where it was read from a tensor
        self._first_read: str | None = None  # the first host read of an unknown value
        self.known = KnownValues(mode)
        self._sizes: dict[Any, tuple[int, ...]] = {}  # op -> positions of its SymInt arguments
        self._patched: dict[tuple[type, str], Any] = {}

    def know_inputs(self, copier: Any) -> None:
        """Record the values of the step's inputs and buffers (:meth:`KnownValues.know_inputs`)."""
        self.known.know_inputs(copier)

    # -- the mode ------------------------------------------------------------------------------
    def __enter__(self) -> HostValues:
        for cls in _SYM:
            self._patch(cls, "__format__", self._format(cls.__dict__.get("__format__", object.__format__)))
        self._patch(FakeTensor, "numpy", self._numpy(FakeTensor.numpy))
        self._patch(torch.Tensor, "numpy", _subclass_numpy(torch.Tensor.numpy))
        nested = sys.modules.get("torch.nested._internal.nested_tensor")
        if nested is not None and callable(getattr(nested, "_nt_view_dummy", None)):
            self._patch(nested, "_nt_view_dummy", _outside_modes(nested._nt_view_dummy))
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
        if kwargs is None:
            kwargs = {}
        if self._origins:
            self._check_sizes(func, args, kwargs)
        if func is _ITEM:
            return self._item(func, args[0])
        if id(func) in _LIFT and type(args[0]) is torch.Tensor:
            if self._placeholder_read:  # torch.tensor(loss.item()): made of a placeholder, not known
                self._placeholder_read = False
                return self.known.unknown(args[0])
            if 1 < args[0].numel() <= KNOWN_LIMIT:
                return self.known.literal(args[0])  # one element: FakeTensorMode's own constant
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self.known.run(func, args, kwargs)
            if out is None:
                raise
            return out
        self.known.propagate(func, args, kwargs, out)
        return out

    # -- reads ---------------------------------------------------------------------------------
    def _item(self, func: Any, tensor: torch.Tensor) -> Any:
        value = self.known.value(tensor)
        if value is not None:
            self._note_assumed(tensor, "read")
            with no_dispatch():
                return value.item()
        # From the first symbol on, the mode keeps the ShapeEnv: ops on fake tensors given symbols
        # need it (without it an FSDP2 step that reads its loss loses ten 512 B blocks).
        self.mode.shape_env = self.shapes
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
        self._placeholder_read = True
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
        if self.known.assumed(tensor):
            caveat = f"a value {how} at {_where()} {FINITE}"
            if caveat not in self.caveats:
                self.caveats.append(caveat)

    # -- host conversions fake tensors lack --------------------------------------------------------
    def _patch(self, cls: Any, name: str, function: Any) -> None:
        self._patched[(cls, name)] = cls.__dict__.get(name)
        setattr(cls, name, function)

    def _format(self, original: Callable[..., str]) -> Callable[..., str]:
        values = self

        def __format__(number: Any, spec: str) -> str:
            if getattr(number.node, "shape_env", None) is values.shapes:
                return format(values.placeholder(number.node), spec)
            return original(number, spec)

        return __format__

    def _numpy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        values = self

        def numpy(tensor: Any, *, force: bool = False) -> Any:
            if tensor.fake_mode is not values.mode:
                return original(tensor, force=force)
            value = values.known.value(tensor)
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


def _subclass_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.numpy``, whose refusal of a tensor subclass (a nested jagged tensor, a DTensor) is
    an :class:`EstimateError` naming the line: a real run fails there too."""

    def numpy(tensor: Any, *, force: bool = False) -> Any:
        try:
            return original(tensor, force=force)
        except (RuntimeError, TypeError) as error:
            if "not supported for tensor subclasses" not in str(error):
                raise
            raise EstimateError(
                f".numpy() of a {type(tensor).__name__} at {_where()}: PyTorch makes NumPy arrays of plain "
                f"tensors only ({str(error).strip()!r}), so the step fails there on real tensors too; read a "
                "plain tensor instead (a nested tensor's .values() or .unbind(), a DTensor's .to_local())"
            ) from error

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
