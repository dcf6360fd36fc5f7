"""Tensors a call reaches other than through its arguments, seen while an estimate runs.

An estimate copies the tensors among a call's arguments and the names it uses; a tensor it reaches
another way (a model held by another module's global, an EMA of the weights in a global dict) is
the user's own. :class:`OutsideCopies` hands every op a copy of it instead (made at its first use,
the same copy at every later one), so that in-place ops (``ema.mul_(0.5)``) change the copy, never
the user's tensor, whether the run is on fake tensors (where an op whose tensors are all real would
run for real), ``meta`` tensors or real CPU copies. :func:`watch_outside` notes each one (an
:class:`EstimateError` at once for one that requires grad: backward would give it a gradient that
no copy holds, and an optimizer's copy would not update it) and :func:`outside_tensors` turns them
into the estimate's caveat: they are used, not counted (a real run holds them before it starts).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from memlab._units import format_size
from memlab.estimate.result import EstimateError

__all__ = ["OutsideCopies", "outside_tensors", "watch_outside"]


def watch_outside(mode: FakeTensorMode | None) -> list[torch.Tensor]:
    """From now on, the real tensors ``mode`` is handed by an op: tensors the call reached other
    than through its copied arguments (the constants fake tensors make of literals are not, nor
    the outputs of an op without a meta kernel, which ``mode`` runs for real on zeros and hands
    back as fake tensors: the tracker counts those as the op's outputs). One that requires grad
    is an :class:`EstimateError` at once: backward would give it a gradient."""
    found: list[torch.Tensor] = []
    if mode is None:
        return found
    converter = mode.fake_tensor_converter
    convert = converter.from_real_tensor

    def from_real_tensor(
        fake_mode: Any, tensor: torch.Tensor, make_constant: bool = False, *a: Any, **k: Any
    ) -> Any:
        if not make_constant and converter._get_memo(tensor) is None and not _fallback_output():
            _check_trainable(tensor)
            found.append(tensor)
        return convert(fake_mode, tensor, make_constant, *a, **k)

    converter.from_real_tensor = from_real_tensor
    return found


def _fallback_output() -> bool:
    """Whether ``from_real_tensor`` is being called by FakeTensorMode's fallback for an op without a
    meta kernel, on the op's real outputs (torch/_subclasses/fake_tensor.py: run_fallback_kernel,
    map_out): two frames up from here."""
    caller = sys._getframe(2).f_code
    return caller.co_name == "map_out" and caller.co_filename == fake_tensor.__file__


def outside_tensors(found: list[torch.Tensor]) -> list[str]:
    """The caveat for tensors the call reached other than through its arguments: not counted."""
    if not found:
        return []
    nbytes = sum(t.untyped_storage().nbytes() for t in found)
    return [
        f"{len(found)} tensor(s) ({format_size(nbytes)}) that fn reached other than through its arguments "
        f"were used but not counted (pass them as arguments to count them)"
    ]


def _check_trainable(tensor: torch.Tensor) -> None:
    if tensor.requires_grad:
        what = f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        raise EstimateError(
            f"fn used a tensor that requires grad and is not among its arguments or the names it "
            f"uses ({what}), e.g. a parameter of a model another module holds; pass the model and "
            f"optimizer to fn as arguments so that the estimate copies them"
        )


class OutsideCopies:
    """What hands each op of an estimate copies of the user's tensors in place of the tensors
    themselves, one copy per tensor for the whole run: the estimate's tracker calls
    :meth:`arguments` first thing in its dispatch, in the thread that entered it, while it is
    entered (:meth:`memlab.estimate.run_tracker.EstimateTracker.copying`), so the estimate runs one
    Python dispatch mode fewer (a mode of its own above the tracker cost ~3 us per op).

    ``method`` is the estimate's: ``"fake"`` (``mode``: its FakeTensorMode; every real tensor an op
    is handed is the user's, since the run's own are fake; its copy is the mode's fake tensor of it,
    and a one-element CPU tensor outside autograd a fake constant of a clone, whose value code may
    read, as :mod:`memlab.estimate.copies` copies a step counter), ``"meta"`` or ``"cpu"`` (the
    user's tensors are those whose storage one of ``user_tensors`` holds, which the isolation's walk
    found; the copy is a ``meta`` tensor of the same shape and strides, or a real CPU clone).
    ``found`` is :func:`watch_outside`'s list: each copied tensor is added to it once.

    An in-place op on a user's tensor still bumps its version counter (autograd does, after the op
    returns from the dispatch modes); on exit (it is a context manager) each one is set back to
    its value before the run (the tensor's data is unchanged, so autograd's saved-tensor checks
    hold as before)."""

    def __init__(
        self,
        method: str,
        mode: FakeTensorMode | None,
        user_tensors: dict[int, torch.Tensor],
        found: list[torch.Tensor],
        host_scalar: Callable[[torch.Tensor], bool],
    ) -> None:
        self._method = method
        self._mode = mode
        self._found = found
        self._host_scalar = host_scalar
        self._storages = {id(t.untyped_storage()) for t in user_tensors.values() if _plain(t)}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._versions: dict[int, tuple[torch.Tensor, int]] = {}  # before the run
        # by id: an OpOverload hashes in Python, and this is asked once per op
        self._skip = frozenset(map(id, mode.lift_fns)) if mode is not None else frozenset()

    def arguments(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """``(args, kwargs)`` for the op ``func``, with each of the user's tensors replaced by its copy."""
        if id(func) in self._skip:
            return args, kwargs
        swap = self._swap
        args = tuple([swap(value) for value in args])
        if kwargs:
            kwargs = {key: swap(value) for key, value in kwargs.items()}
        return args, kwargs

    def __enter__(self) -> OutsideCopies:
        return self

    def __exit__(self, *exc: Any) -> None:
        changed = [(t, version) for t, version in self._versions.values() if t._version != version]
        if changed:
            tensors, versions = zip(*changed, strict=True)
            torch._C._autograd._unsafe_set_version_counter(tensors, versions)

    def _swap(self, value: Any) -> Any:
        if type(value) in _PLAIN:  # a subclass (a fake tensor, a DTensor) is never the user's
            return self._copy(value) if self._users(value) else value
        if type(value) in (list, tuple) and value and isinstance(value[0], torch.Tensor):
            swapped = [self._swap(item) for item in value]
            if any(new is not old for new, old in zip(swapped, value, strict=True)):
                return type(value)(swapped)
        return value

    def _users(self, tensor: torch.Tensor) -> bool:
        if not _plain(tensor):
            return False  # a fake tensor, or a subclass (DTensor) whose ops reach here flattened
        return self._method == "fake" or id(tensor.untyped_storage()) in self._storages

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        found = self._copies.get(id(tensor))
        if found is not None:
            return found[1]
        if not tensor.is_inference():  # autograd bumps it after the op returns from here
            self._versions[id(tensor)] = (tensor, tensor._version)
        if self._mode is not None and not self._host_scalar(tensor):
            new = self._mode.from_tensor(tensor)  # watch_outside's checks and notes
        else:
            _check_trainable(tensor)
            with _disable_current_modes():
                if self._method == "meta":
                    new = torch.empty_strided(
                        tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"
                    )
                else:
                    new = tensor.detach().clone()
            if self._mode is not None:
                new = self._mode.fake_tensor_converter.from_real_tensor(self._mode, new, make_constant=True)
            self._found.append(tensor)
        self._copies[id(tensor)] = (tensor, new)
        return new


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(tensor: torch.Tensor) -> bool:
    """A tensor with a storage of its own: not a subclass (a fake tensor, a DTensor), not nested."""
    return type(tensor) in _PLAIN and not tensor.is_nested
