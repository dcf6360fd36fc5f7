"""``memlab run`` inside a ``torchrun`` job: which rank this process is, its own output files, and
the merged table of every rank (``--gather``).

torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in each worker's environment; nothing
here starts or needs ``torch.distributed`` until ``--gather`` asks for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from memlab._outputs import replacing_path, write_text
from memlab.commands._command import CommandError

__all__ = ["GATHER_TIMEOUT", "RankEnvironment", "gather_ranks", "rank_environment", "write_merged"]

#: How long ``--gather`` waits for the other ranks when it opens its own process group.
GATHER_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankEnvironment:
    """This process's place in a torchrun job: ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int
    world_size: int
    local_rank: int

    def path(self, path: str | None) -> str | None:
        """``path`` with this rank in its name: ``out.json`` is ``out.rank1.json`` on rank 1."""
        if path is None:
            return None
        root, extension = os.path.splitext(path)
        return f"{root}.rank{self.rank}{extension}"


def rank_environment(environ: Mapping[str, str] | None = None) -> RankEnvironment | None:
    """The :class:`RankEnvironment` torchrun describes in ``environ`` (default ``os.environ``):
    ``RANK`` and ``WORLD_SIZE`` set (``LOCAL_RANK`` defaults to ``RANK``); ``None`` outside a
    job. Raises :class:`CommandError` for values that are not ranks."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise CommandError(
            f"RANK={environ['RANK']!r}, WORLD_SIZE={environ['WORLD_SIZE']!r}, LOCAL_RANK="
            f"{environ.get('LOCAL_RANK')!r}: torchrun sets them to integers"
        ) from None
    if not 0 <= rank < world or local < 0:
        raise CommandError(f"RANK={rank} is not a rank of WORLD_SIZE={world} (LOCAL_RANK={local})")
    return RankEnvironment(rank, world, local)


def gather_ranks(profiler: Any, functions: list[Any], status: int) -> Any:
    """Gather every rank's line records of ``functions`` on rank 0 (see
    :func:`memlab.distributed.gather`) and return the merged table there, ``None`` elsewhere.

    Uses the program's process group when it is still open (a gloo group beside it when its
    backend is not gloo: the records are Python objects), else opens a gloo group from torchrun's
    environment for the gather and closes it after (waiting at most :data:`GATHER_TIMEOUT`). A
    nonzero exit ``status`` is reported as this rank's error.
    """
    import torch.distributed as dist

    from memlab.distributed import gather

    opened = not dist.is_initialized()
    if opened:
        # torchrun's store, under a prefix of its own: keys of a group the program opened and
        # destroyed would otherwise collide with those of this one
        store, rank, world = next(iter(dist.rendezvous("env://", timeout=GATHER_TIMEOUT)))
        store = dist.PrefixStore("memlab_run_gather", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GATHER_TIMEOUT)
    try:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        error = None if status == 0 else f"the program exited with status {status}"
        return gather(profiler, dst=0, group=group, error=error, func=functions)
    finally:
        if opened:
            dist.destroy_process_group()


def write_merged(merged: Any, path: str) -> None:
    """Write the merged table to ``path`` by its extension: ``.txt`` the text, ``.json`` its plain
    data (:meth:`~memlab.distributed.merge.MergedLines.to_data`), ``.csv`` its DataFrame; whole
    or not at all (:func:`memlab._outputs.replacing_path`)."""
    extension = os.path.splitext(path)[1].lower()
    if extension == ".json":
        write_text(path, json.dumps(merged.to_data()))
    elif extension == ".csv":
        with replacing_path(path) as temporary:
            merged.to_dataframe().to_csv(temporary)
    else:
        write_text(path, merged.render())
