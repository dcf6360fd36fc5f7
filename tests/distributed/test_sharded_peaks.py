"""Sharded training under a tracker: two real gloo ranks on CPU, spawned once for the module.

Each rank trains a 64-256-64 MLP for two steps under FSDP2, then under DDP, inside a memlab
``TensorTracker(allocator=None)`` and PyTorch's ``MemTracker`` at once (``sharded_steps``). FSDP2
frees and re-gathers its parameters with ``UntypedStorage.resize_``; DDP copies gradients into its
buckets. The tracker must read PyTorch's numbers to the byte.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.sharded_steps import run_rank
from tests.distributed.test_gather import spawn_ranks

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded")
    spawn_ranks(run_rank, (WORLD, str(out)), WORLD)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("wrapping", ["fsdp2", "ddp"])
def test_the_peak_is_memtrackers_on_every_rank(ranks, wrapping):
    for rank in ranks:
        measured = rank[wrapping]
        assert measured["peak"] == measured["memtracker_peak"]
        assert measured["allocated"] == measured["memtracker_allocated"]


def test_fsdp2_keeps_only_the_shards_between_steps(ranks):
    # after zero_grad: each rank's half of the parameters (whole rows) and Adam's two states for
    # them, Adam's four float32 step counters, and the two int32 rank lists of FSDP2's device mesh
    # (made inside the tracker: 8 B each); the gathered parameters were resized to 0
    shards = 4 * (128 * 64 + 128 + 32 * 256 + 32)
    for rank in ranks:
        assert rank["fsdp2"]["allocated"] == 3 * shards + 4 * 4 + 2 * 8
