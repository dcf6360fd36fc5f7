"""Any world size from one process: :func:`fake_group`, a default process group that moves no data.

Inside ``with memlab.distributed.fake_group(8):`` this process is rank 0 of an 8-process job as far
as ``torch.distributed`` can tell: a user builds the model, shards it (``fully_shard``, DDP, a
``DeviceMesh`` and DTensors), and calls :func:`memlab.estimate` or :func:`memlab.max_batch_size` for
that rank without starting the other seven. PyTorch's own fake backend (``"fake"``, with its
``FakeStore``) does the same for FSDP2 and plain collectives, but its ``Work`` carries no future and
DDP's backward fails on it (``comm.cpp``: "expected the hook result is either a Tensor or a
TensorList found None"). The group here is a Python ``ProcessGroup`` (as PyTorch's multi-threaded
test group is) whose every collective returns a completed ``Work`` whose future holds its output
tensors: no data moves between ranks (an all-gather fills each rank's slot with this rank's input,
in place, and so does a gather on its root), no byte is allocated beyond what the caller allocated
for the output (as NCCL's collectives, in place on the caller's buffers, do), and DDP, FSDP2,
DTensor redistribution and plain collectives all run. Object collectives give this rank what a real
group would where this process holds it, and raise :class:`FakeCollectiveError` where only another
rank's process would (:mod:`memlab.distributed.objects`).

What it cannot see: the other ranks. Every rank's tensors are taken to be shaped as this rank's,
which holds for data parallelism (FSDP, DDP, HSDP) but not for uneven splits of a pipeline.
Values are not reduced: a loss all-reduced inside a fake group is this rank's loss.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import Any

import torch

from memlab._tensors import disown
from memlab._units import check_count
from memlab.distributed.objects import FakeCollectiveError, object_collectives

__all__ = ["FakeCollectiveError", "FakeGroupError", "fake_group", "is_fake", "standalone_group"]

BACKEND = "memlab_fake"


class FakeGroupError(RuntimeError):
    """:func:`fake_group` cannot start here (a process group is initialised already)."""


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[Any]:
    """Make this process rank ``rank`` of a job of ``world_size`` processes, for the ``with`` block.

    Initialises ``torch.distributed``'s default process group with a group that completes every
    collective at once and moves no data (see the module docstring), over a
    ``torch.distributed.HashStore``; yields that group. On exit, also when the block raises or the
    user presses Ctrl-C, the group and every group made from it (``new_group``, a ``DeviceMesh``'s
    sub-groups) are destroyed, leaving ``torch.distributed`` uninitialised as before.

    Models sharded inside the block keep references to its groups: use them (estimate them) inside
    it (an estimate of an FSDP2 model after the block is an ``EstimateError`` saying so). Object
    collectives: :mod:`memlab.distributed.objects` (a :class:`FakeCollectiveError` where this rank
    would be handed another rank's Python objects). A process group that is initialised already (a
    real job's) is a :class:`FakeGroupError`: estimate with it directly, or call ``fake_group``
    outside the job.
    """
    world_size = check_count(world_size, "world_size", 1)
    rank = check_count(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    import torch.distributed as dist

    if not dist.is_available():
        raise FakeGroupError("fake_group needs torch.distributed, which this build of torch lacks")
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        raise FakeGroupError(
            f"fake_group needs torch.distributed uninitialised, but a default process group is "
            f"initialised ({dist.get_backend(default)}, world size {default.size()}); call fake_group "
            f"before init_process_group or after destroy_process_group"
        )
    _register_backend()
    before = {id(mesh) for mesh in _live_meshes()}
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        with object_collectives(is_fake):
            yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()
        _forget_meshes()
        _disown_meshes(before)


def _forget_meshes() -> None:
    """Clear PyTorch's caches of DTensor sharding and redistribution decisions, which keep the
    device meshes made inside the group alive after it, each with its tensor of ranks: tensors left
    behind in the user's process, which a profiler that counts the tensors alive would count. The
    caches are ``functools`` caches in ``torch.distributed.tensor`` (module functions and class
    methods) and its dispatcher's (cleared as PyTorch's debug helpers clear them); they fill again
    on the next DTensor op."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    clears: list[Any] = []
    with contextlib.suppress(ImportError, AttributeError):  # private helpers: ones that moved are skipped
        from torch.distributed.tensor import _redistribute, debug

        clears += [
            debug._clear_python_sharding_prop_cache,
            debug._clear_fast_path_sharding_prop_cache,
            _redistribute.clear_redistribute_planner_cache,
        ]
    prefixes = ("torch.distributed.tensor", "torch.distributed.device_mesh")
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for value in list(vars(module).values()):
            held = [value, *vars(value).values()] if isinstance(value, type) else [value]
            held = [getattr(h, "__func__", h) for h in held]  # a static method's function
            clears += [h.cache_clear for h in held if callable(getattr(h, "cache_clear", None))]
    for clear in clears:
        with contextlib.suppress(Exception):  # private helpers: one that moved or refuses is skipped
            clear()


def _live_meshes() -> list[Any]:
    """The ``DeviceMesh`` objects alive now (none where ``torch.distributed.device_mesh`` was never
    imported: no mesh can exist)."""
    module = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(module, "DeviceMesh", None)
    if not isinstance(mesh_class, type):
        return []
    return [obj for obj in gc.get_objects() if issubclass(type(obj), mesh_class)]  # no __class__ lookups


def _disown_meshes(before: set[int]) -> None:
    """Disown (:func:`memlab._tensors.disown`) the tensors of the device meshes made inside the
    group that outlive it (their rank tables: ``_rank_map``, ``mesh``). Clearing the caches
    (:func:`_forget_meshes`) frees them on torch 2.13; torch 2.8's and 2.11's DTensor sharding code
    keeps references to the argument tuples of the operator schemas it has seen, which hold
    ``DTensorSpec`` objects and their meshes, out of reach of any cache clear. They describe a
    process group that no longer exists and are no one's data: a profile after the block must not
    count them as the user's tensors that existed before profiling. ``before``: the ``id`` of each
    mesh alive when the group started (a mesh of the user's from before is left counted). Objects
    frozen by ``gc.freeze()`` are out of ``gc.get_objects()``: a mesh frozen then is not found
    (memlab's own estimates unfreeze before the group ends)."""
    gc.collect()  # meshes held only by reference cycles go first
    for mesh in _live_meshes():
        if id(mesh) in before:
            continue
        held = list(vars(mesh).values())
        with contextlib.suppress(Exception):  # a property that refuses on a torn-down mesh
            held.append(mesh.mesh)
        disown(value for value in held if isinstance(value, torch.Tensor))


def standalone_group(rank: int, world_size: int) -> Any:
    """A group like :func:`fake_group`'s, registered nowhere: a data-free copy's stand-in for a real
    job's group (DDP's communication hook needs a future, which a collective on fake tensors
    through a real backend does not give)."""
    return _group_class()(rank, world_size)


def is_fake(group: Any) -> bool:
    """Whether ``group`` is one of this module's groups."""
    return _GROUP is not None and isinstance(group, _GROUP)


def _register_backend() -> None:
    import torch.distributed as dist

    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu", "cuda"])


def _create_group(store: Any, rank: int, world_size: int, timeout: Any) -> Any:
    return _group_class()(rank, world_size)


def _done(result: Any) -> Any:
    """A ``Work`` that is complete, whose future holds ``result``."""
    from torch._C._distributed_c10d import _create_work_from_future

    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


_GROUP: type | None = None


def _group_class() -> type:
    """The group's class, made on first use (``torch.distributed`` is imported only then)."""
    global _GROUP
    if _GROUP is not None:
        return _GROUP
    import torch.distributed as dist

    class FakeGroup(dist.ProcessGroup):
        """Rank ``rank`` of ``world_size``; every collective completes at once with its outputs
        as they are."""

        def __init__(self, rank: int, world_size: int) -> None:
            super().__init__(rank, world_size)
            self._rank, self._world_size = rank, world_size

        def rank(self) -> int:
            return self._rank

        def size(self) -> int:
            return self._world_size

        @property
        def group_name(self) -> str:
            # a group made by standalone_group is registered nowhere
            return dist.distributed_c10d._world.pg_names.get(
                self, f"{BACKEND}_{self._rank}_of_{self._world_size}"
            )

        def getBackendName(self) -> str:
            return BACKEND

        def __repr__(self) -> str:
            return f"memlab fake group: rank {self._rank} of {self._world_size}"

        # What each returns is the value a real backend's future holds: the output tensors.
        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            return _done(tensors)

        def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            return _done(tensors)

        def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            return _done(tensors)

        def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            return _done(tensors)

        def barrier(self, opts: Any = None) -> Any:
            return _done(None)

        # Every rank holds what this one holds: an all-gather fills each rank's slot with this
        # rank's input (in place, allocating nothing), so that checks across ranks pass (DDP's
        # comparison of parameter shapes).
        def allgather(
            self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
        ) -> Any:
            for slots, tensor in zip(outputs, inputs, strict=True):
                for slot in slots:
                    slot.copy_(tensor)
            return _done(outputs)

        def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
            for slot in output.chunk(self._world_size):
                slot.copy_(input.view_as(slot))
            return _done([output])

        def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            for output, tensor in zip(outputs, inputs, strict=True):
                self.all_gather_single(output, tensor)
            return _done(outputs)

        def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return _done(outputs)

        def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
            return _done([output])

        def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return _done(outputs)

        def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return _done(outputs)

        def all_to_all_single(self, output: Any, input: Any, *rest: Any) -> Any:
            return _done([output])

        # On the root (the only rank with the list of every rank's slots): a gather fills each
        # slot with this rank's input, as an all-gather does; a scatter gives this rank its own
        # slot. gather_object and scatter_object_list read what they write.
        def gather(
            self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
        ) -> Any:
            for slots, tensor in zip(outputs, inputs, strict=False):  # no slots off the root
                for slot in slots:
                    slot.copy_(tensor)
            return _done(outputs)

        def scatter(
            self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
        ) -> Any:
            for output, slots in zip(outputs, inputs, strict=False):  # no inputs off the root
                output.copy_(slots[self._rank])
            return _done(outputs)

        def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
            return _done(None)

        def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
            return _done(tensors)

    # The older names that PyTorch's Python bindings still call on some paths.
    FakeGroup.allgather_into_tensor_coalesced = FakeGroup.all_gather_single_coalesced
    FakeGroup._allgather_base = FakeGroup.all_gather_single
    FakeGroup._reduce_scatter_base = FakeGroup.reduce_scatter_single
    FakeGroup.reduce_scatter_tensor_coalesced = FakeGroup.reduce_scatter_single_coalesced
    FakeGroup.alltoall_base = FakeGroup.all_to_all_single
    _GROUP = FakeGroup
    return FakeGroup
