"""A ``FakeTensorMode`` whose dispatch cache gives the storages an uncached call gives.

``FakeTensorMode`` keeps a process-wide cache of op results (``_cached_dispatch_impl``): on a hit it
rebuilds each output from recorded metadata, as a new storage, or as the input it modifies in place
(the same object), or as a view of a view op's input. Outputs that share a storage in other ways
come back from the cache as storages of their own: ``mkldnn_rnn_layer_backward``'s meta kernel
returns the bias gradient twice (one storage), a hit returns two. A tracker counts storages, so
the first call of such an op in a process (a miss) and every later one (hits) counted different
bytes, and an estimate changed between its first and its second call (4,096 B for an LSTM step).

:class:`FaithfulFakeTensorMode` refuses to cache such a result (PyTorch's own bypass: the op runs
uncached, and the cache remembers to bypass it for every fake mode of the process), so every
call gives the storages the op's fake kernel gives. What it cannot see: entries another
``FakeTensorMode`` of the process cached before (``torch.compile`` in the same process) for the
same op and arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache

from memlab.estimate.modes import UnwrappedDispatch

__all__ = ["FaithfulFakeTensorMode", "shares_storage_unlike_cache"]


def _storage(tensor: torch.Tensor) -> int | None:
    """The identity of ``tensor``'s storage (``None`` for a tensor without one: sparse, nested)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def shares_storage_unlike_cache(func: Any, args: Sequence[Any], output: Any) -> str | None:
    """Why a cache hit of ``func(*args)`` would not give ``output``'s storages (``None``: it would):
    an output that shares its storage with another output, or with an input whose view or
    in-place result it is not (a hit rebuilds only those)."""
    outputs = output if isinstance(output, tuple) else (output,)
    inputs: dict[int, list[Any]] = {}
    for arg in args:
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, torch.Tensor) and (key := _storage(item)) is not None:
                inputs.setdefault(key, []).append(item)
    seen: set[int] = set()
    for out in outputs:
        if not isinstance(out, torch.Tensor) or (key := _storage(out)) is None:
            continue
        if key in inputs:
            in_place = any(out is item for item in args)
            if not in_place and not getattr(func, "is_view", False):
                return "output shares an input's storage"
        elif key in seen:
            return "outputs share a storage"
        seen.add(key)
    return None


class FaithfulFakeTensorMode(UnwrappedDispatch, FakeTensorMode):
    """A ``FakeTensorMode`` that caches no op result whose outputs share storages in a way a cache
    hit would not rebuild (see the module docstring); otherwise the same, but for its
    ``__torch_dispatch__``: ``FakeTensorMode.dispatch`` called directly, without the
    ``torch._disable_dynamo`` wrapper and the call counter ``FakeTensorMode``'s own goes through
    (:class:`~memlab.estimate.modes.UnwrappedDispatch`: 2-3 % of an estimate's CPU time,
    ``benchmarks/bench_floor.py``).

    ``shape_env_on_demand``: a ``ShapeEnv`` the mode takes when it first needs one and has none (a
    nested jagged tensor's ragged size is a symbol of one): a mode with a ``ShapeEnv`` runs every
    op slower, so one that needs none runs without."""

    shape_env_on_demand: Any = None

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        return self.dispatch(func, types, args, kwargs)

    def create_symbolic_nested_int(self, *, nt_tensor_id: int | None = None) -> Any:
        if self.shape_env is None and self.shape_env_on_demand is not None:
            self.shape_env = self.shape_env_on_demand
        return super().create_symbolic_nested_int(nt_tensor_id=nt_tensor_id)

    def _make_cache_entry(
        self,
        state: Any,
        key: Any,
        func: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        output: Any,
    ) -> Any:
        entry = super()._make_cache_entry(state, key, func, args, kwargs, output)  # PyTorch's checks first
        why = shares_storage_unlike_cache(func, args, output)
        if why is not None:
            raise _BypassDispatchCache(why)
        return entry
