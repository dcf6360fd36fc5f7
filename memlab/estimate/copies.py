"""Copies of a call's tensors, modules and optimizers for an estimate, the user's own left alone.

An estimate runs ``fn(*args, **kwargs)`` on copies: every tensor among the arguments (inside lists,
tuples, dicts, named tuples and dataclasses), every module (its parameters, buffers and gradients)
and every optimizer (its state, bound to the copied parameters) is replaced by a copy made by
``copy_tensor`` (a fake tensor, or a real CPU clone for a real run). What ``fn`` names directly
(a global ``model``, a closure's ``optimizer``) is copied too: the function is rebuilt over a copy
of its module's namespace in which those names, and the functions of the same module that ``fn``
calls, are replaced. Other objects are passed as they are (what the call changes in them is
undone when the estimate ends: :mod:`memlab.estimate.isolation`). A module sharded with FSDP2 or wrapped
in DDP, which cannot be deep-copied, is copied without its wrapper and wrapped again
(:mod:`memlab.estimate.sharded`); modules are copied before optimizers, so that each optimizer's
copy is bound to the parameters of the modules' copies.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memlab.estimate import sharded

__all__ = ["Copier"]

# Objects an estimate copies; anything else is shared with the user's program.
_COPIED = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


class Copier:
    """Copies objects with ``copy_tensor`` applied to each tensor, each object once (a tensor held
    twice, or a parameter held by a module and an optimizer, is copied once and shared).

    ``modules``, ``optimizers`` and ``inputs`` list the copies made, in order (``inputs`` until
    :meth:`release`): the tensors that are not parameters, buffers or optimizer state are the
    call's inputs.
    """

    def __init__(self, copy_tensor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._copy_tensor = copy_tensor
        self._memo: dict[int, Any] = {}
        self._keep: list[Any] = []  # originals, so that ids in the memo stay unique
        self._builds: list[Callable[[], None]] = []  # see finish()
        #: What the copies cannot carry into the estimate (one sentence each).
        self.caveats: list[str] = []
        self.modules: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.inputs: list[torch.Tensor] = []
        #: Every tensor copy made, in order (until :meth:`release`).
        self.copies: list[torch.Tensor] = []
        #: The tensor each of :attr:`copies` copies, in the same order (until :meth:`release`).
        self.originals: list[torch.Tensor] = []

    # -- tensors --------------------------------------------------------------------------------
    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The copy of ``tensor``: a ``Parameter`` stays one, ``requires_grad`` and ``.grad`` are kept."""
        found = self._memo.get(id(tensor))
        if found is not None:
            return found
        new = self._copy_tensor(tensor)
        if isinstance(tensor, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
        if tensor.is_leaf and tensor.grad is not None:
            new.grad = self.tensor(tensor.grad)
        self._remember(tensor, new)
        self.copies.append(new)
        self.originals.append(tensor)
        return new

    def _remember(self, original: Any, new: Any) -> None:
        self._memo[id(original)] = new
        self._keep.append(original)

    def release(self) -> None:
        """Drop every reference the copier holds to copies of tensors, so that each copy lives
        exactly as long as the copied structures (modules, optimizers, arguments) hold it, as the
        original does in the user's program: a step that sets gradients to ``None`` or replaces
        optimizer state or drops a global's tensor frees them at that moment. ``inputs``, ``copies``
        and ``originals`` are emptied; ``modules`` and ``optimizers`` stay listed (a program holds its
        model and optimizer for the whole step). Nothing more can be copied."""
        self._memo.clear()
        self._keep.clear()
        for made in (self.inputs, self.copies, self.originals):
            made.clear()
        self._copy_tensor = _released

    # -- structures -----------------------------------------------------------------------------
    def __call__(self, obj: Any) -> Any:
        """The copy of ``obj`` (see the module docstring); objects that hold nothing copied are
        returned as they are."""
        found = self._memo.get(id(obj), self)
        if found is not self:
            return found
        if isinstance(obj, torch.Tensor):
            new = self.tensor(obj)
            self.inputs.append(new)
            return new
        if isinstance(obj, torch.nn.Module):
            return self._module(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return self._optimizer(obj)
        if type(obj) in (list, tuple):
            new = type(obj)(self(item) for item in obj)
        elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            new = type(obj)(*(self(item) for item in obj))
        elif type(obj) is dict:
            new = {key: self(value) for key, value in obj.items()}
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {field.name: self(getattr(obj, field.name)) for field in dataclasses.fields(obj)}
            new = dataclasses.replace(obj, **{k: v for k, v in changes.items() if v is not getattr(obj, k)})
        else:
            return obj
        self._remember(obj, new)
        return new

    def adopt_copy(self, original: torch.Tensor, new: torch.Tensor) -> None:
        """Take ``new``, made elsewhere, as the copy of ``original`` (a parameter FSDP2 re-sharded)."""
        self._remember(original, new)
        self.copies.append(new)
        self.originals.append(original)

    def deepcopy(self, obj: Any, memo: dict[int, Any]) -> Any:
        """``copy.deepcopy(obj)`` with the copies made so far and ``memo``'s replacements; process
        groups (which cannot be copied) are shared."""
        memo = {**memo, **self._memo}
        for value in _shallow_values(obj):
            if _process_group(value):
                memo[id(value)] = value
        return copy.deepcopy(obj, memo)

    def modules_first(self, roots: list[Any]) -> None:
        """Copy the modules among ``roots`` (and inside the lists, tuples, dicts, named tuples and
        dataclasses :meth:`__call__` enters) before anything else, so that an optimizer copied
        later, whatever the order it is named in, is bound to the parameters of the modules' copies
        (which FSDP2 makes anew when it shards a copy)."""
        todo = list(roots)
        while todo:
            obj = todo.pop(0)
            if isinstance(obj, torch.nn.Module):
                self(obj)
            elif type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
                todo.extend(obj)
            elif type(obj) is dict:
                todo.extend(obj.values())
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                todo.extend(getattr(obj, field.name) for field in dataclasses.fields(obj))

    def finish(self) -> None:
        """Build the wrappers whose construction allocates (DDP's reducer and its gradient buckets):
        called once the estimate's tracker counts, after the copies are adopted."""
        builds, self._builds = self._builds, []
        for build in builds:
            build()

    def _module(self, module: torch.nn.Module) -> torch.nn.Module:
        if sharded.is_data_parallel(module):
            new, build = sharded.copy_data_parallel(self, module)
            self._remember(module, new)

            def built() -> None:
                build()
                self.modules.append(new)

            self._builds.append(built)
            return new
        if sharded.is_fully_sharded(module):
            new = sharded.copy_fully_sharded(self, module)
            self._remember(module, new)
            self.modules.append(new)
            return new
        memo: dict[int, Any] = {}
        for sub in module.modules():
            for value in (*sub._parameters.values(), *sub._buffers.values(), *vars(sub).values()):
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = self.tensor(value)
        for sub in module.modules():
            for tensor in _nested_tensors(list(vars(sub).values())):
                if id(tensor) not in memo:
                    memo[id(tensor)] = _host_clone(tensor)
        new = self._deepcopy(module, memo)
        self.modules.append(new)
        return new

    def _optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        memo: dict[int, Any] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                memo[id(param)] = self.tensor(param)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = self.tensor(value)
        new = self._deepcopy(optimizer, memo)
        self.optimizers.append(_unwrapped(new))
        return new

    def _deepcopy(self, obj: Any, memo: dict[int, Any]) -> Any:
        new = self.deepcopy(obj, memo)
        self._remember(obj, new)
        return new

    def _owner(self, owner: Any) -> Any:
        """The copy of a bound method's owner: a module or optimizer is copied; another object is
        copied shallowly, its attributes that hold tensors, modules or optimizers replaced by
        copies (``self.model`` in a trainer's ``loss`` method)."""
        new = self(owner)
        if new is not owner or not isinstance(getattr(owner, "__dict__", None), dict):
            return new
        changes = {k: self(v) for k, v in vars(owner).items() if isinstance(v, _COPIED)}
        if not changes:
            return owner
        new = copy.copy(owner)
        vars(new).update(changes)
        self._remember(owner, new)
        return new

    # -- functions ------------------------------------------------------------------------------
    def function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` rebound to copies: a module is copied and called; a bound method is bound to a
        copy of its owner (see :meth:`_owner`); a ``functools.partial`` gets copied arguments; a plain
        function is rebuilt with the modules, optimizers and tensors it names (as globals or
        closure variables, also through the functions of its module it names) replaced by copies."""
        if isinstance(fn, _COPIED):
            return self(fn)
        if isinstance(fn, types.MethodType):
            owner = self._owner(fn.__self__)
            func = self.function(fn.__func__)
            return (
                types.MethodType(func, owner) if owner is not fn.__self__ or func is not fn.__func__ else fn
            )
        if isinstance(fn, functools.partial):  # functions among its arguments rebound as fn is
            args = [self.function(arg) if isinstance(arg, _FUNCTIONS) else self(arg) for arg in fn.args]
            return functools.partial(self.function(fn.func), *args, **self(dict(fn.keywords)))
        if isinstance(fn, types.FunctionType):
            rebinder = _Rebinder(self, fn.__globals__)
            new = rebinder.function(fn)
            rebinder.finish()
            return new
        return fn


def _nested_tensors(values: list[Any]) -> list[torch.Tensor]:
    """The tensors inside the lists, tuples and dicts among ``values`` (not ``values`` themselves)."""
    found, todo = [], [v for v in values if type(v) in (list, tuple, dict)]
    while todo:
        obj = todo.pop()
        for item in obj.values() if type(obj) is dict else obj:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif type(item) in (list, tuple, dict):
                todo.append(item)
    return found


def _host_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A real clone, made outside the estimate's modes, of a tensor a module keeps in a container
    attribute (a dataset a ``LightningModule`` holds): ``module.to()`` does not move it, so it is
    not the device's memory and is not counted; ``copy.deepcopy`` of a real tensor inside the fake
    mode fails, and the user's tensor must not be shared with the copy."""
    with _disable_current_modes():
        return tensor.detach().clone()


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper that subclasses ``Optimizer`` without its state
    (accelerate's ``AcceleratedOptimizer`` keeps the real one as ``.optimizer`` and has no step
    hooks): the one whose steps a tracker hooks and whose state it counts."""
    while not hasattr(optimizer, "_optimizer_step_post_hooks") and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer
    return optimizer


def _shallow_values(obj: Any) -> list[Any]:
    """The values ``obj`` holds one level down: its attributes, or a dict's values, and for a module
    those of its submodules (where a process group is kept: DDP's ``process_group``)."""
    if isinstance(obj, torch.nn.Module):
        return [value for sub in obj.modules() for value in vars(sub).values()]
    if isinstance(obj, dict):
        return list(obj.values())
    return list(vars(obj).values()) if isinstance(getattr(obj, "__dict__", None), dict) else []


def _process_group(value: Any) -> bool:
    return torch.distributed.is_available() and isinstance(value, torch.distributed.ProcessGroup)


def _released(tensor: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("Copier.release() was called: no more copies can be made")


class _Rebinder:
    """Rebuilds the functions of one module namespace over a copy of it (created on first need)."""

    def __init__(self, copier: Copier, namespace: dict[str, Any]) -> None:
        self.copier = copier
        self.namespace = namespace
        self.new_namespace: dict[str, Any] | None = None
        self.done: dict[int, types.FunctionType] = {}

    def function(self, fn: types.FunctionType) -> types.FunctionType:
        found = self.done.get(id(fn))
        if found is not None:
            return found
        if fn.__globals__ is not self.namespace:
            return fn  # another module's function: it sees its own module's objects
        self.done[id(fn)] = fn  # recursion (a function naming itself) ends here
        changes: dict[str, Any] = {}
        for name in sorted(_global_names(fn.__code__)):  # the same order in every process
            if name in self.namespace:
                value = self._value(self.namespace[name])
                if value is not self.namespace[name]:
                    changes[name] = value
        closure = fn.__closure__
        if closure is not None:
            values = _cell_contents(fn)
            new_values = [
                value if value is cell else self._value(value)
                for value, cell in zip(values, closure, strict=True)
            ]
            if any(new is not old for new, old in zip(new_values, values, strict=True)):
                closure = tuple(
                    cell if value is cell else types.CellType(value)
                    for value, cell in zip(new_values, fn.__closure__, strict=True)
                )
        if not changes and closure is fn.__closure__ and self.new_namespace is None:
            del self.done[id(fn)]
            return fn
        if self.new_namespace is None:
            self.new_namespace = dict(self.namespace)
        self.new_namespace.update(changes)
        new = types.FunctionType(fn.__code__, self.new_namespace, fn.__name__, fn.__defaults__, closure)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__dict__.update(fn.__dict__)
        new.__qualname__ = fn.__qualname__
        self.done[id(fn)] = new
        return new

    def finish(self) -> None:
        """Point the copied namespace's names at the rebuilt functions (a function reached again
        through recursion was first left as it was)."""
        if self.new_namespace is not None:
            for name, value in self.new_namespace.items():
                new = self.done.get(id(value))
                if new is not None:
                    self.new_namespace[name] = new

    def _value(self, value: Any) -> Any:
        if isinstance(value, _COPIED):
            return self.copier(value)
        if isinstance(value, types.FunctionType):
            return self.function(value)
        return value


def _cell_contents(fn: types.FunctionType) -> list[Any]:
    """What each closure cell of ``fn`` holds, in order; an empty cell (a name assigned later)
    stands for itself."""
    contents: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:
            contents.append(cell)
    return contents


def _global_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it (lambdas, inner functions) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


#: The callables whose names an estimate rebinds, also as a ``functools.partial``'s arguments.
_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def named_objects(fn: Callable[..., Any]) -> list[Any]:
    """The objects ``fn`` uses by name, as :meth:`Copier.function` finds them, without copying:
    a module or optimizer passed as ``fn`` itself, the owner of a bound method, a partial's
    arguments, and a plain function's globals and closure variables (also those of the functions
    of its own module that it names)."""
    if isinstance(fn, _COPIED):
        return [fn]
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        held = list(vars(owner).values()) if isinstance(getattr(owner, "__dict__", None), dict) else []
        return [owner, *held, *named_objects(fn.__func__)]
    if isinstance(fn, functools.partial):
        held = [named_objects(arg) if isinstance(arg, _FUNCTIONS) else [arg] for arg in fn.args]
        return [*named_objects(fn.func), *(obj for objs in held for obj in objs), *fn.keywords.values()]
    found: list[Any] = []
    if not isinstance(fn, types.FunctionType):
        return found
    namespace, todo, seen = fn.__globals__, [fn], set()
    while todo:
        func = todo.pop()
        if id(func) in seen or func.__globals__ is not namespace:
            continue
        seen.add(id(func))
        values = [namespace[name] for name in sorted(_global_names(func.__code__)) if name in namespace]
        values += [value for value in _cell_contents(func) if not isinstance(value, types.CellType)]
        for value in values:
            if isinstance(value, types.FunctionType):
                todo.append(value)
            else:
                found.append(value)
    return found
