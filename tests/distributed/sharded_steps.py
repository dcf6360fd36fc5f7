"""What each rank runs in the sharded-training tests (imported by the spawned processes): two
training steps of a small MLP under FSDP2 (``fully_shard``), then two under DDP, each inside a
memlab ``TensorTracker(allocator=None)`` and PyTorch's ``MemTracker`` at once."""

from __future__ import annotations

import json
import os
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

import memlab
from memlab._torch_version import torch_at_least

CPU = torch.device("cpu")


class PropagationSkippingMemTracker(MemTracker):
    """PyTorch's ``MemTracker`` with torch 2.13's fix, for a torch before it: DTensor's sharding
    propagation runs ops on fake tensors under a nested ``FakeTensorMode`` (no memory), and torch
    2.11's ``MemTracker.__torch_dispatch__`` counts their outputs (FSDP2 here: a peak 22,776 B above
    the real one on each rank); 2.13's skips every op run under a fake mode other than the one
    active at its entry (none in these eager runs: torch/distributed/_tools/mem_tracker.py)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        if any(t == DTensor for t in types) or active_fake_mode() is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def make_memtracker() -> MemTracker:
    """PyTorch's ``MemTracker`` as of torch 2.13 (:class:`PropagationSkippingMemTracker` before)."""
    return MemTracker() if torch_at_least(2, 13) else PropagationSkippingMemTracker()


class InPlaceReduceScatter:
    """FSDP2's reduce-scatter as NCCL does it, in place: all-reduce FSDP's own reduce-scatter
    input, then copy this rank's chunk out. gloo's own reduce-scatter clones its input in C++
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), below every dispatch mode: no tracker
    sees that clone allocated, ``MemTracker`` counts it from the moment a view of it shows up in
    ``Work.wait()``, and when it is freed races with gloo's worker thread (``MemTracker`` alone
    then reads different peaks on identical runs). The duck type of FSDP2's ``ReduceScatter``."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        # gloo's worker thread drops its reference to the tensors of a collective a moment after
        # the collective completes (ProcessGroupGloo::runLoop): the last reduce-scatter input
        # could outlive FSDP's own reference and be read as allocated after the step, on a loaded
        # machine only. NCCL keeps nothing: hand gloo a view and wait until gloo has let it go
        # (its Python object lives as long as any C++ reference to it does).
        view = input_tensor.view(-1)
        released = threading.Event()
        weakref.finalize(view, released.set)
        dist.all_reduce(view, op=op, group=group)
        del view
        if not released.wait(timeout=60):
            raise RuntimeError("gloo still holds a reduce-scatter input 60 s after the collective")
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


class _DistWithInPlaceReduceScatter:
    """``torch.distributed`` with :class:`InPlaceReduceScatter` as its ``reduce_scatter_tensor``:
    what torch 2.8's FSDP2 (which has no ``set_custom_reduce_scatter``) calls it through."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None, op: Any = None):
        InPlaceReduceScatter()(output, input, group, op)


def fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        state = fully_shard(layer)
        if hasattr(state, "set_custom_reduce_scatter"):
            state.set_custom_reduce_scatter(InPlaceReduceScatter())
        else:  # torch 2.8: FSDP2's foreach_reduce calls dist.reduce_scatter_tensor of its module
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives

            _fsdp_collectives.dist = _DistWithInPlaceReduceScatter()
    return fully_shard(model)


def ddp(model: torch.nn.Module) -> torch.nn.Module:
    # 30 KiB buckets: the 64 KiB weights get one each, the biases share one
    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=30 / 1024)


def measure(wrap: Any) -> dict[str, int]:
    """Build, wrap and train for two steps inside both trackers: peaks and what is allocated after."""
    with memlab.TensorTracker(allocator=None) as tracker:
        memtracker = make_memtracker()  # made inside: it wraps UntypedStorage.resize_ as the tracker left it
        with memtracker:
            model = wrap(make_model())
            optimizer = torch.optim.Adam(model.parameters())
            for _ in range(2):
                model(torch.randn(32, 64)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                memtracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
            now = memtracker.get_tracker_snapshot("current")[CPU]["Total"]
            allocated = tracker.memory_allocated()
    return {
        "peak": tracker.max_memory_allocated(),
        "memtracker_peak": memtracker.get_tracker_snapshot("peak")[CPU]["Total"],
        "allocated": allocated,
        "memtracker_allocated": now,
    }


def run_rank(rank: int, world: int, out: str) -> None:
    """Measure an FSDP2 then a DDP training step on this rank; write ``out``/rank{rank}.json."""
    store = f"file://{os.path.join(out, 'store')}"
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        results = {"fsdp2": measure(fsdp2), "ddp": measure(ddp)}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(results, file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo can abort a process at interpreter exit (see workers.run_rank): leave now.
    os._exit(0)
