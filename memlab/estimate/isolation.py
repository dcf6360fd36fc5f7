"""An estimate leaves the user's program as it found it: what a step changes outside its copies is undone.

An estimate runs the user's step on copies of its tensors, modules and optimizers
(:mod:`memlab.estimate.copies`), but the step also reaches other objects: a global list it appends
losses to, a dict of EMA weights, a counter in a closure, the attributes of the trainer whose
method it is, the random number generators. :class:`Isolation` saves the shallow state of every
mutable object the step can reach before the estimate runs it (a journal: through the globals its
functions name, their closure cells and defaults, a bound method's owner, the arguments, and
recursively through lists, dicts, sets, deques, objects' ``__dict__`` and ``__slots__``, the
methods of the classes the user wrote and the user's own modules; not into the standard library's,
installed packages' or memlab's modules and functions) and puts it back when the estimate ends,
also when it fails or is interrupted.
A tensor the walk finds is not copied here: an estimate's ops never run on it
(:class:`memlab.estimate.outside.OutsideCopies` hands them copies), and its ``grad`` and
``requires_grad`` are put back. NumPy arrays are made read-only for the run (a write is an
:class:`EstimateError` naming the array and the line, before anything is written); a generator
the step advances cannot be rewound, which is an :class:`EstimateError` after the run.
"""

from __future__ import annotations

import collections
import functools
import linecache
import random
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memlab._user_code import is_library_file
from memlab.estimate.restore import (
    MISSING,
    RandomStates,
    TensorData,
    attributes,
    cell_value,
    has_slot,
    restore_cell,
    restore_deque,
    restore_dict,
    restore_list,
    restore_set,
    restore_slot,
    restore_tensor,
    slots,
    version,
)
from memlab.estimate.result import EstimateError

__all__ = ["Isolation"]

#: How many objects the walk saves at most; a step that reaches more gets a caveat.
LIMIT = 500_000

# Objects that hold no state a step can change, or none the journal could save.
_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis), type,
    types.CodeType, types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
    types.GetSetDescriptorType, types.MemberDescriptorType, property, staticmethod, classmethod,
    torch.dtype, torch.device, torch.layout, torch.memory_format,
)  # fmt: skip


class Isolation:
    """The saved state of everything ``fn`` (the step) and ``make_arguments`` (the function that
    makes its arguments) reach; a context manager that puts it back on exit. :meth:`add` saves
    what the arguments reach, once they are made. ``tensors`` holds the user's tensors found (by
    ``id``), which an estimate must never hand to an op."""

    def __init__(self, fn: Callable[..., Any], make_arguments: Callable[..., Any]) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        #: What the walk could not cover (one sentence each).
        self.caveats: list[str] = []
        self._seen: set[int] = set()
        self._keep: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self._checks: list[Callable[[], None]] = []
        self._read_only: list[tuple[Any, str]] = []  # NumPy arrays made read-only, and their paths
        self._warnings: warnings.catch_warnings[Any] | None = None
        with _disable_current_modes():  # its state tensors are no allocation of a tracker's
            self._randoms = RandomStates()
        self._walk([(fn, ("the step",)), (make_arguments, ("the arguments",))])

    def add(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Save the state of what the step's arguments reach, too (objects already saved are not
        saved again)."""
        named = [*enumerate(args), *kwargs.items()]
        self._walk([(arg, ("the arguments", key)) for key, arg in named])

    def _walk(self, roots: list[tuple[Any, tuple[Any, ...]]]) -> None:
        with _disable_current_modes():  # a generator's state is a tensor: a real one
            todo = roots[::-1]
            while todo:
                obj, path = todo.pop()
                if isinstance(obj, _ATOMS) or id(obj) in self._seen:
                    continue
                if len(self._seen) >= LIMIT:
                    self.caveats[:] = [
                        f"the step reaches more than {LIMIT} objects; the estimate saved and restored "
                        f"the state of the first {LIMIT} only"
                    ]
                    return
                self._seen.add(id(obj))
                self._keep.append(obj)
                try:
                    held = self._save(obj, path)
                except Exception:  # an object that cannot be read (a proxy, say)
                    continue  # one whose state cannot be read cannot be saved either
                todo.extend(reversed(held))

    # -- saving one object ----------------------------------------------------------------------
    def _save(self, obj: Any, path: tuple[Any, ...]) -> list[tuple[Any, tuple[Any, ...]]]:
        """Save ``obj``'s own state; the objects it holds, with their paths, to walk next."""
        if isinstance(obj, torch.Tensor):
            self._tensor(obj)
            return []
        if isinstance(obj, types.ModuleType):
            if _library(getattr(obj, "__name__", None)):
                return []
            self._dict(vars(obj), namespace=True)
            return [(value, (*path, key)) for key, value in vars(obj).items() if key != "__builtins__"]
        if isinstance(obj, types.FunctionType):
            return self._function(obj, path)
        if isinstance(obj, types.MethodType):
            return [(obj.__self__, path), (obj.__func__, path)]
        if isinstance(obj, functools.partial):
            return [(obj.func, path), *((arg, path) for arg in (*obj.args, *obj.keywords.values()))]
        if isinstance(obj, types.GeneratorType):
            self._generator(obj, path)
            return []
        if isinstance(obj, torch.Generator | random.Random) or _numpy_type(obj, "Generator"):
            self._random(obj)
            return []
        if _numpy_type(obj, "ndarray"):
            if obj.flags.writeable:
                self._read_only.append((obj, _name(path)))
            return []
        if type(obj).__module__.partition(".")[0] == "memlab":
            return []  # a tracker or profiler of the user's: weak references update it during the run
        held = self._container(obj, path)
        found = attributes(obj)
        if found is not None:
            self._dict(found)
            held += [(value, (*path, f".{key}")) for key, value in found.items()]
        for slot in slots(type(obj)):
            value = slot.__get__(obj) if has_slot(slot, obj) else MISSING
            self._undo.append(functools.partial(restore_slot, slot, obj, value))
            if value is not MISSING:
                held.append((value, (*path, f".{slot.__name__}")))
        return held + self._methods(type(obj))

    def _methods(self, cls: type) -> list[tuple[Any, tuple[Any, ...]]]:
        """The functions of ``cls`` and its bases that the user wrote (``self.helper()`` reaches
        them by attribute, not by a name the walk sees): their globals and closures are the step's."""
        held: list[tuple[Any, tuple[Any, ...]]] = []
        for klass in cls.__mro__:
            if id(klass) in self._seen or _library(getattr(klass, "__module__", None)):
                continue
            self._seen.add(id(klass))
            for name, value in vars(klass).items():
                where = (f"{klass.__qualname__}.{name}",)
                if isinstance(value, staticmethod | classmethod):
                    held.append((value.__func__, where))
                elif isinstance(value, property):
                    held += [(f, where) for f in (value.fget, value.fset, value.fdel) if f is not None]
                elif isinstance(value, types.FunctionType):
                    held.append((value, where))
        return held

    def _container(self, obj: Any, path: tuple[Any, ...]) -> list[tuple[Any, tuple[Any, ...]]]:
        if isinstance(obj, dict):
            self._dict(obj)
            return [item for key, value in dict.items(obj) for item in ((key, path), (value, (*path, key)))]
        if isinstance(obj, list):
            saved = list.copy(obj)
            self._undo.append(lambda: restore_list(obj, saved))
        elif isinstance(obj, set):
            saved_set = set.copy(obj)
            self._undo.append(lambda: restore_set(obj, saved_set))
        elif isinstance(obj, collections.deque):
            saved = list(obj)
            self._undo.append(lambda: restore_deque(obj, saved))
        elif isinstance(obj, bytearray):
            saved_bytes = bytes(obj)
            self._undo.append(lambda: obj.__setitem__(slice(None), saved_bytes))
            return []
        elif not isinstance(obj, tuple | frozenset):
            return []
        return [(item, (*path, index)) for index, item in enumerate(list(obj))]

    def _dict(self, obj: dict[Any, Any], namespace: bool = False) -> None:
        saved = list(dict.items(obj))
        self._undo.append(lambda: restore_dict(obj, saved, namespace))

    def _function(self, fn: types.FunctionType, path: tuple[Any, ...]) -> list[tuple[Any, tuple[Any, ...]]]:
        namespace = fn.__globals__
        if _library(namespace.get("__name__")):
            # its globals are the library's; what its closure holds may be the user's (the
            # `make_batch` inside the function max_batch_size makes a step's arguments with). A
            # list, dict or set in its closure is the library's own (an integration's record of
            # what its runs made): its items are walked, the container is neither saved nor put back.
            held = []
            for cell in fn.__closure__ or ():
                value = cell_value(cell)
                if type(value) in (list, set):
                    held += [(item, path) for item in value]
                elif type(value) is dict:
                    held += [(item, (*path, key)) for key, item in value.items()]
                elif value is not MISSING:
                    held.append((value, path))
            return held
        held: list[tuple[Any, tuple[Any, ...]]] = []
        if id(namespace) not in self._seen:  # names a step assigns with `global` live here
            self._seen.add(id(namespace))
            self._keep.append(namespace)
            self._dict(namespace, namespace=True)
        where = f"{fn.__qualname__}"
        for name in sorted(_global_names(fn.__code__)):
            value = namespace.get(name, MISSING)
            if value is not MISSING:
                held.append((value, (f"global {name!r} of {where}",)))
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            value = cell_value(cell)
            self._undo.append(functools.partial(restore_cell, cell, value))
            if value is not MISSING:
                held.append((value, (f"closure variable {name!r} of {where}",)))
        held += [(value, (f"default of {where}",)) for value in (fn.__defaults__ or ())]
        held += [(value, (f"default of {where}",)) for value in (fn.__kwdefaults__ or {}).values()]
        if fn.__dict__:
            self._dict(fn.__dict__)
            held += [(value, path) for value in fn.__dict__.values()]
        return held

    def _tensor(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, FakeTensor):
            return  # made by the estimate
        self.tensors[id(tensor)] = tensor
        before = version(tensor)
        data = TensorData(tensor)  # `tensor.data = ...` swaps what the Python object holds
        if tensor.is_leaf:
            grad, requires_grad = tensor.grad, tensor.requires_grad
            self._undo.append(lambda: restore_tensor(tensor, data, grad, requires_grad))
        else:
            self._undo.append(lambda: data.restore(tensor))
        self._checks.append(lambda: _check_version(tensor, before))

    def _generator(self, generator: types.GeneratorType, path: tuple[Any, ...]) -> None:
        position = _position(generator)

        def check() -> None:
            if _position(generator) != position:
                raise EstimateError(
                    f"the step advanced the generator {_name(path)} ({generator.__qualname__}), whose "
                    f"position an estimate cannot save and restore; pass the step the values it draws "
                    f"instead (its arguments, or a list)"
                )

        self._checks.append(check)

    def _random(self, generator: Any) -> None:
        if isinstance(generator, torch.Generator):
            state = generator.get_state()
            self._undo.append(lambda: generator.set_state(state))
        elif isinstance(generator, random.Random):
            saved = generator.getstate()
            self._undo.append(lambda: generator.setstate(saved))
        else:  # numpy.random.Generator
            bits = generator.bit_generator
            saved_bits = bits.state
            self._undo.append(lambda: setattr(bits, "state", saved_bits))

    # -- the run --------------------------------------------------------------------------------
    def __enter__(self) -> Isolation:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        """Put everything back; a write to a NumPy array made read-only becomes an EstimateError."""
        try:
            self.restore()
        finally:
            written = self._written_array(error)
        if written is not None:
            raise written from error
        if error is None:
            for check in self._checks:
                check()

    def protect(self) -> None:
        """Make the NumPy arrays found read-only until :meth:`restore` (called as the step starts);
        ``torch.from_numpy`` of one does not warn that it is (the user's array is writable)."""
        if self._read_only and self._warnings is None:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        for array, _ in self._read_only:
            array.flags.writeable = False

    def restore(self) -> None:
        """Put back the state saved: containers, attributes, cells, globals, random generators."""
        with _disable_current_modes():
            for array, _ in self._read_only:
                array.flags.writeable = True
            if self._warnings is not None:
                self._warnings.__exit__(None, None, None)
                self._warnings = None
            for undo in reversed(self._undo):
                undo()
            self._randoms.restore()

    def _written_array(self, error: BaseException | None) -> EstimateError | None:
        if not isinstance(error, ValueError) or "read-only" not in str(error) or not self._read_only:
            return None
        names = ", ".join(name for _, name in self._read_only)
        return EstimateError(
            f"the step wrote to a NumPy array it reaches outside its copies ({names}){_where(error)}; an "
            f"estimate cannot copy NumPy arrays, and it never changes the user's objects: keep the values "
            f"in a tensor instead (torch.from_numpy(array) shares them), which an estimate copies"
        )


def _check_version(tensor: torch.Tensor, before: int | None) -> None:
    if version(tensor) != before:
        raise EstimateError(
            f"the estimate changed a tensor of the user's in place ({tuple(tensor.shape)} "
            f"{str(tensor.dtype).removeprefix('torch.')}), which it could not copy; please report it"
        )  # pragma: no cover  (OutsideCopies hands every op copies)


def _position(generator: types.GeneratorType) -> int:
    frame = generator.gi_frame
    return -1 if frame is None else frame.f_lasti


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _numpy_type(obj: Any, name: str) -> bool:
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return False
    kind = numpy.ndarray if name == "ndarray" else numpy.random.Generator
    return isinstance(obj, kind)


def _name(path: tuple[Any, ...]) -> str:
    """``global 'ema' of step['weight'].history`` from the walk's path."""
    head, *rest = path
    parts = (part if isinstance(part, str) and part.startswith(".") else f"[{part!r}]" for part in rest)
    return str(head) + "".join(parts)


def _where(error: BaseException) -> str:
    """`` at file:line: code`` of the user's frame that raised ``error`` (the innermost outside libraries)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not is_library_file(frame.filename):
            code = linecache.getline(frame.filename, frame.lineno or 0).strip()
            return f" at {frame.filename}:{frame.lineno}" + (f": {code}" if code else "")
    return ""


@functools.cache
def _library(module_name: str | None) -> bool:
    """Whether a module is a library's (the standard library, an installed package, memlab), whose
    globals an estimate does not save: a step's state lives in the user's own modules."""
    if not module_name or module_name == "__main__":
        return False
    module = sys.modules.get(module_name.partition(".")[0])
    if module is None:
        return False  # a namespace made by exec, say: the user's
    filename = getattr(module, "__file__", None)
    return filename is None or is_library_file(filename)
