"""Data-free copies of sharded models: FSDP2 (``fully_shard``) and DDP re-created on copies.

Neither wrapper can be deep-copied (FSDP2 refuses, DDP's reducer and process group are C++
objects), and a copy of their internals would carry their streams, buffers and hooks into the
estimate. What an estimate needs is the wrapping a user asked for, applied to data-free copies of
the modules: :func:`copy_fully_sharded` copies the module tree without FSDP2 (each managed
parameter as a tensor of its whole, unsharded shape: fake, so no byte is allocated) and calls
``fully_shard`` on the copies with the arguments each original was sharded with, read back from its
state (mesh, ``reshard_after_forward``, mixed-precision and offload policies, shard placements,
ignored parameters) and the settings changed after it (``set_reshard_after_backward``,
``set_requires_gradient_sync``, a custom reduce-scatter, prefetching). FSDP2 then shards the copies
as it sharded the originals, over the same mesh and process group (a real one, or
:func:`memlab.distributed.fake_group`'s, which moves no data). :func:`copy_data_parallel` does the
same for DDP (communication hooks registered with ``register_comm_hook`` included), whose reducer
allocates its gradient buckets when it is built: it is built when the estimate's tracker is counting
(:meth:`Copier.finish`), over the original's group if that is a fake one, else over a stand-in of the
same rank and size.

What a copy cannot carry: FSDP2 over DTensor parameters (tensor parallelism inside FSDP),
``dp_mesh_dims`` SPMD meshes and per-parameter meshes are an :class:`~memlab.estimate.result.EstimateError`
naming the module; DDP's bucket rebuild before the second forward is skipped (:data:`REBUILD_CAVEAT`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memlab.estimate.result import EstimateError

if TYPE_CHECKING:
    from memlab.estimate.copies import Copier

__all__ = ["copy_data_parallel", "copy_fully_sharded", "is_data_parallel", "is_fully_sharded"]

# The settings FSDP2's setters (set_reshard_after_backward, set_requires_gradient_sync,
# set_custom_reduce_scatter, ...) leave on a parameter group, copied as they are.
_GROUP_SETTINGS = (
    "reduce_grads",
    "all_reduce_grads",
    "reshard_after_backward",
    "gradient_divide_factor",
    "reduce_scatter_unused_params",
    "force_sum_reduction_for_comms",
    "unshard_async_op",
    "unshard_in_backward",
    "_all_gather_comm",
    "_reduce_scatter_comm",
    "_all_reduce_hook",
    "_all_reduce_hook_stream",
)
_FSDP_HOOKS = "torch.distributed.fsdp._fully_shard"
_FSDP_ATTRIBUTES = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def is_fully_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module inside it is an FSDP2 module (``fully_shard`` was applied)."""
    fsdp = _fsdp_module_class()
    return fsdp is not None and any(isinstance(sub, fsdp) for sub in module.modules())


def is_data_parallel(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``DistributedDataParallel`` wrapper."""
    if not torch.distributed.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def _fsdp_module_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


# -- FSDP2 -------------------------------------------------------------------------------------------
def _param_groups(state: Any) -> list[Any]:
    """FSDP2's parameter groups of one ``fully_shard`` state: the list ``_fsdp_param_groups``
    (torch 2.13), or the one optional ``_fsdp_param_group`` (torch 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def copy_fully_sharded(copier: Copier, module: torch.nn.Module) -> torch.nn.Module:
    """A data-free copy of ``module`` with ``fully_shard`` re-applied to the copies of the modules it
    was applied to; the copier remembers each original sharded parameter's copy (optimizers copied
    later are bound to them), and copies their gradients."""
    states = _fsdp_states(module)
    names = {id(sub): name for name, sub in module.named_modules()}
    fsdp_params = {}
    for state in states:
        for group in _param_groups(state):
            _check_supported(group, _describe(state._modules[0], names))
            _check_group_exists(group, _describe(module, names))
            for fsdp_param in group.fsdp_params:
                fsdp_params[id(fsdp_param.sharded_param)] = fsdp_param
    memo: dict[int, Any] = {}
    for fsdp_param in fsdp_params.values():
        sharded = fsdp_param.sharded_param
        # The whole parameter, data-free (the copier runs under the estimate's fake mode).
        whole = torch.empty(fsdp_param._orig_size, dtype=sharded.dtype, device=sharded.device)
        memo[id(sharded)] = torch.nn.Parameter(whole, requires_grad=sharded.requires_grad)
    modules: dict[int, torch.nn.Module] = {}
    new = _plain_module(module, copier, memo, modules)
    managed = {id(memo[key]) for key in fsdp_params}
    ignored = {p for p in new.parameters() if id(p) not in managed}
    new_states = {}
    from torch.distributed.fsdp import fully_shard

    # A module whose parameters all belong to its children's groups (a root, often) keeps no mesh:
    # it was sharded over its children's (the default mesh, unless one was given).
    mesh = next((g.mesh_info.mesh for state in states for g in _param_groups(state)), None)

    for state in states:
        copies = [modules[id(m)] for m in state._modules]
        arguments = _arguments(state, memo, ignored, mesh)
        fully_shard(copies if len(copies) > 1 else copies[0], **arguments)
        new_state = fully_shard.state(copies[0])
        for old_group, new_group in zip(_param_groups(state), _param_groups(new_state), strict=True):
            for name in _GROUP_SETTINGS:
                if hasattr(old_group, name):
                    setattr(new_group, name, getattr(old_group, name))
        new_states[id(state)] = new_state
    for state in states:  # prefetching, set_modules_to_forward_prefetch and _backward_prefetch
        new_state = new_states[id(state)]
        new_state._states_to_forward_prefetch = [new_states[id(s)] for s in state._states_to_forward_prefetch]
        new_state._states_to_backward_prefetch = [
            new_states[id(s)] for s in state._states_to_backward_prefetch
        ]
    for fsdp_param in fsdp_params.values():
        info = fsdp_param._module_info
        old = fsdp_param.sharded_param
        sharded = getattr(modules[id(info.module)], info.param_name)
        copier.adopt_copy(old, sharded)
        if old.grad is not None:
            sharded.grad = copier.tensor(old.grad)
    return new


def _fsdp_states(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 states inside ``module``, children's before their parents' (the order ``fully_shard``
    must be applied in)."""
    fsdp = _fsdp_module_class()
    from torch.distributed.fsdp import fully_shard

    states: dict[int, Any] = {}
    for sub in reversed(list(module.modules())):
        if isinstance(sub, fsdp):
            state = fully_shard.state(sub)
            states.setdefault(id(state), state)
    return list(states.values())


def _user_class(module: torch.nn.Module) -> type:
    """``module``'s class as the user wrote it: ``fully_shard`` swaps in a subclass of it and
    ``FSDPModule``."""
    fsdp = _fsdp_module_class()
    cls = type(module)
    return next(base for base in cls.__bases__ if base is not fsdp) if isinstance(module, fsdp) else cls


def _describe(module: torch.nn.Module, names: dict[int, str]) -> str:
    """``the model (Sequential)`` or ``module 'layers.0' (Block)``: its class as the user wrote it."""
    cls = _user_class(module)
    name = names.get(id(module), "")
    return f"module {name!r} ({cls.__name__})" if name else f"the model ({cls.__name__})"


def _check_supported(group: Any, where: str) -> None:
    """An :class:`EstimateError` for FSDP2 groups a copy cannot re-create."""
    if getattr(group.mesh_info, "is_spmd_mesh", False):
        raise EstimateError(
            f"cannot estimate {where}: FSDP2 with dp_mesh_dims (an SPMD mesh) is not supported"
        )
    for fsdp_param in group.fsdp_params:
        if fsdp_param.is_dtensor:
            raise EstimateError(
                f"cannot estimate {where}: FSDP2 over DTensor parameters (tensor parallelism inside FSDP) "
                f"is not supported; estimate the tensor-parallel model without fully_shard"
            )
        if fsdp_param.mesh_info is not group.mesh_info:
            raise EstimateError(
                f"cannot estimate {where}: a parameter sharded over its own mesh is not supported"
            )


def _check_group_exists(group: Any, where: str) -> None:
    """An :class:`EstimateError` for an FSDP2 group sharded over a process group destroyed since
    (a :func:`memlab.distributed.fake_group` left, ``destroy_process_group``): ``fully_shard``
    cannot shard a copy over it."""
    from memlab.distributed.fake import is_fake

    process_group = getattr(group.mesh_info, "shard_process_group", None)
    if process_group is None or process_group in torch.distributed.distributed_c10d._world.pg_names:
        return
    if is_fake(process_group):
        raise EstimateError(
            f"cannot estimate {where}: it was sharded with fully_shard inside memlab.distributed.fake_group"
            f"({process_group.size()}, rank={process_group.rank()}), which has been left, so its process "
            f"group no longer exists; call memlab.estimate inside the same `with fake_group(...)` block"
        )
    raise EstimateError(
        f"cannot estimate {where}: it was sharded with fully_shard over a process group that has been "
        f"destroyed (destroy_process_group); estimate it while the group exists"
    )


def _arguments(
    state: Any, memo: dict[int, Any], ignored: set[torch.nn.Parameter], mesh: Any
) -> dict[str, Any]:
    """The arguments ``fully_shard`` was called with for ``state``, read back from it, for copies
    (``mesh`` for a state without parameters of its own)."""
    group = next(iter(_param_groups(state)), None)
    arguments: dict[str, Any] = {"mp_policy": state._mp_policy, "ignored_params": ignored, "mesh": mesh}
    if group is None:
        return arguments
    mesh_info = group.mesh_info
    arguments["mesh"] = mesh_info.mesh
    arguments["offload_policy"] = group.offload_policy
    if not state._auto_reshard_after_forward:
        after = group.post_forward_mesh_info
        arguments["reshard_after_forward"] = (
            False if after is None else True if after is mesh_info else after.shard_mesh_size
        )
    placements = {
        id(memo[id(p.sharded_param)]): p.fsdp_placement
        for p in group.fsdp_params
        if p.fsdp_placement.dim != 0
    }
    if placements:
        arguments["shard_placement_fn"] = lambda param: placements.get(id(param))
    return arguments


def _plain_module(
    module: torch.nn.Module, copier: Copier, memo: dict[int, Any], modules: dict[int, torch.nn.Module]
) -> torch.nn.Module:
    """A copy of ``module``'s tree as it was before ``fully_shard``: its classes, its attributes
    (deep-copied), its own hooks; parameters in ``memo`` replaced by theirs, other tensors by the
    copier's copies. ``modules`` maps each original module's id to its copy (shared modules once)."""
    found = modules.get(id(module))
    if found is not None:
        return found
    cls = _user_class(module)
    new = cls.__new__(cls)
    modules[id(module)] = new
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    skip = {REGISTRY_KEY, STATE_KEY, *_FSDP_ATTRIBUTES, "_parameters", "_buffers", "_modules"}
    rest = {key: value for key, value in vars(module).items() if key not in skip}
    for key, value in rest.items():
        if key.endswith("hooks") and isinstance(value, dict):
            rest[key] = type(value)((k, v) for k, v in value.items() if not _fsdp_hook(v))
    for value in rest.values():
        if isinstance(value, torch.Tensor) and id(value) not in memo:
            copier.tensor(value)  # a tensor attribute (HF's rotary original_inv_freq), copied data-free
    new.__dict__.update(copier.deepcopy(rest, memo))
    new._parameters = type(module._parameters)(
        (name, None if p is None else memo[id(p)] if id(p) in memo else copier.tensor(p))
        for name, p in module._parameters.items()
    )
    new._buffers = type(module._buffers)(
        (name, None if b is None else copier.tensor(b)) for name, b in module._buffers.items()
    )
    new._modules = type(module._modules)(
        (name, None if child is None else _plain_module(child, copier, memo, modules))
        for name, child in module._modules.items()
    )
    return new


def _fsdp_hook(hook: Any) -> bool:
    """Whether a module hook was registered by FSDP2 (its state's methods and closures)."""
    if isinstance(hook, tuple):  # (hook, ...) entries of the with-kwargs dicts
        hook = hook[0]
    while isinstance(hook, functools.partial):
        hook = hook.func
    if isinstance(hook, types.MethodType):
        hook = hook.__func__
    return getattr(hook, "__module__", "").startswith(_FSDP_HOOKS)


# -- DDP ---------------------------------------------------------------------------------------------
def copy_data_parallel(copier: Copier, ddp: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[], None]]:
    """A copy of the DDP wrapper ``ddp`` around a copy of its module, and the function that builds it:
    an object of DDP's class that ``build()`` initialises with the original's arguments (its
    reducer allocates the gradient buckets, so it is called once the estimate's tracker counts)."""
    inner = copier(ddp.module)
    new = type(ddp).__new__(type(ddp))
    arguments = {
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
        "dim": ddp.dim,
        "process_group": _fake_stand_in(ddp.process_group),
        "bucket_cap_mb": ddp.bucket_bytes_cap / (1024 * 1024),
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "mixed_precision": ddp.mixed_precision,
        "init_sync": False,  # the original checked the ranks' parameters and synchronised them
    }
    ignored = list(getattr(ddp, "parameters_to_ignore", ()))
    hooks = list(getattr(ddp, "_comm_hooks", ()))

    def build() -> None:
        if ignored:
            type(ddp)._set_params_and_buffers_to_ignore_for_model(inner, ignored)
        type(ddp).__init__(new, inner, **arguments)
        for hook, state in hooks:
            new.register_comm_hook(state, hook)
        new.reducer = _NoRebuild(new.reducer)

    copier.caveats.append(REBUILD_CAVEAT)
    return new, build


def _fake_stand_in(group: Any) -> Any:
    """The group a DDP copy reduces over: ``group`` if it moves no data
    (:func:`memlab.distributed.fake_group`'s), else a group of the same rank and size that completes
    every collective at once (a real backend's collective on fake tensors gives DDP's communication
    hook no future)."""
    from memlab.distributed.fake import is_fake, standalone_group

    return group if is_fake(group) else standalone_group(group.rank(), group.size())


#: The caveat of an estimate of a DDP model.
REBUILD_CAVEAT = (
    "DDP's bucket rebuild before the second forward was not run (it writes the new bucket order into a "
    "tensor in C++, which a fake tensor cannot hold): the buckets keep their first grouping; a real run "
    "regroups the same gradient bytes and can hold more after it (none or 1,038,336 B more, run to run, "
    "with 1 MiB buckets in memlab's tests)"
)


class _NoRebuild:
    """DDP's reducer, as DDP's Python code calls it, except that the bucket rebuild before the second
    forward is skipped: it sends the new bucket order from rank 0 by writing the indices into a
    tensor in C++, which a fake tensor cannot hold. The rebuilt buckets hold the same gradients in
    gradient-ready order (the buckets built first hold them in reverse parameter order, which that
    usually is), so the bytes are the same; where the grouping differs, so can the reserved bytes."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)
