"""Object collectives in a :func:`~memlab.distributed.fake_group`: what a real group gives this rank.

``torch.distributed``'s object collectives pickle objects into byte tensors and move them with
tensor collectives, first their sizes, then their bytes. A fake group moves no data, so a rank
that receives another rank's objects would read sizes nobody wrote (a 140 TB allocation from an
unwritten size buffer) and bytes nobody wrote. This process plays every rank, each holding what
this rank holds (as the fake group's all-gather fills every slot with this rank's input):

- ``all_gather_object(object_list, obj)``: ``world_size`` copies of ``obj`` (unpickled, as a real
  group gives them), every rank's slot alike;
- ``gather_object(obj, object_gather_list, dst)``: on ``dst`` the same; elsewhere nothing;
- ``broadcast_object_list(object_list, src)``: on ``src`` the list is left as it is (what a real
  group does there); on another rank :class:`FakeCollectiveError`;
- ``scatter_object_list(output, input, src)``: on ``src`` its own item of ``input``; on another
  rank :class:`FakeCollectiveError`;
- ``recv_object_list``: :class:`FakeCollectiveError` (the objects come from another rank).

A rank other than the source cannot be given the source's objects: they exist only in the source
rank's process, which is not run, and this rank's list holds placeholders as often as the objects
themselves, so taking it for the source's would hand the step ``None`` where a real job has a
value. The error names the collective, the ranks, and what to do instead. The collectives are
replaced in ``torch.distributed`` (and ``torch.distributed.distributed_c10d``) while the fake group
is entered (:func:`object_collectives`), for calls on a fake group only; a function imported by
name before the block (``from torch.distributed import broadcast_object_list``) keeps the original.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FakeCollectiveError", "object_collectives"]

# Collective -> (the argument naming its source, as a global rank; the same as a group rank)
_FROM_ANOTHER_RANK = {
    "broadcast_object_list": ("src", "group_src"),
    "scatter_object_list": ("src", "group_src"),
    "recv_object_list": ("src", "group_src"),
}


class FakeCollectiveError(RuntimeError):
    """An object collective of a :func:`~memlab.distributed.fake_group` that would hand this rank
    Python objects only another rank's process holds (the message names the collective)."""


def _source(name: str, arguments: dict[str, Any], group: Any) -> int | None:
    """The group rank whose objects ``name`` hands out (``None``: any rank, for ``recv_object_list``)."""
    import torch.distributed as dist

    global_name, group_name = _FROM_ANOTHER_RANK[name]
    if arguments.get(group_name) is not None:
        return int(arguments[group_name])
    if arguments.get(global_name) is not None:
        return int(dist.get_group_rank(group, arguments[global_name]))
    return None


def _checked(name: str, original: Callable[..., Any], is_fake: Callable[[Any], bool]) -> Callable[..., Any]:
    """``original``, raising :class:`FakeCollectiveError` first where a fake group would have to
    hand this rank another rank's objects."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        try:
            arguments = signature.bind(*args, **kwargs).arguments
            group = arguments.get("group") or dist.distributed_c10d._get_default_group()
            fake = is_fake(group)
            source = _source(name, arguments, group) if fake else None
        except Exception:  # bad arguments: the original says what is wrong
            return original(*args, **kwargs)
        if not fake or (source == group.rank() and name != "recv_object_list"):
            return original(*args, **kwargs)
        rank, size = group.rank(), group.size()
        which = "any rank" if source is None else f"rank {source}"
        advice = (
            f"estimate rank {source} (fake_group({size}, rank={source})), or give every rank the objects "
            f"and skip the {name}"
            if source is not None
            else f"give this rank the objects and skip the {name}"
        )
        raise FakeCollectiveError(
            f"torch.distributed.{name} from {which} to rank {rank} of a memlab fake_group of {size}: the "
            f"objects exist only in the process of {which}, which a fake group does not run, so this rank "
            f"cannot be given them; {advice}"
        )

    return collective


@contextlib.contextmanager
def object_collectives(is_fake: Callable[[Any], bool]) -> Iterator[None]:
    """While entered: ``torch.distributed``'s object collectives that would hand this rank another
    rank's objects raise :class:`FakeCollectiveError` on a group for which ``is_fake`` is true (the
    others run as PyTorch wrote them, over the fake group's tensor collectives)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    replaced = []
    try:
        for name in _FROM_ANOTHER_RANK:
            original = getattr(distributed_c10d, name)
            checked = _checked(name, original, is_fake)
            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, checked)
                    replaced.append((module, name, original, checked))
        yield
    finally:
        for module, name, original, checked in replaced:
            if getattr(module, name, None) is checked:  # not replaced again by someone else since
                setattr(module, name, original)
