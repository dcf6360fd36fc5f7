"""The limit marks and what they check: their arguments read once, at collection, and one
function per mark that turns a test's :class:`~memlab.pytest_plugin.measure.Measurement` into a
failure message (or ``None`` when the test kept to its limit).

No torch here: reading marks costs nothing for a suite that does not measure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memlab._units import format_size, format_sizes_apart, parse_size

if TYPE_CHECKING:
    from memlab.pytest_plugin.measure import Measurement, Site

__all__ = [
    "LEAKS_MARK",
    "MEMORY_MARK",
    "METRICS",
    "LeakLimit",
    "MemoryLimit",
    "check_leaks",
    "check_memory",
    "leaks_limit",
    "memory_limit",
]

MEMORY_MARK = "limit_tensor_memory"
LEAKS_MARK = "limit_tensor_leaks"
#: What ``metric=`` of ``limit_tensor_memory`` accepts: the peak of tensors' allocated bytes
#: (``allocated_bytes.all.peak``) or of the allocator's reserved bytes (``reserved_bytes.all.peak``).
METRICS = ("allocated", "reserved")
#: The allocation sites a failure message names, at most.
TOP_SITES = 5


@dataclass(frozen=True)
class MemoryLimit:
    """``limit_tensor_memory``: ``limit`` bytes of ``metric`` (one of :data:`METRICS`) on ``device``
    (``None``: the device the test used; see :mod:`memlab.pytest_plugin.measure`)."""

    limit: int
    metric: str = "allocated"
    device: str | None = None


@dataclass(frozen=True)
class LeakLimit:
    """``limit_tensor_leaks``: at most ``limit`` bytes of tensors made by the test still alive at its end."""

    limit: int


def memory_limit(args: tuple[Any, ...], kwargs: dict[str, Any]) -> MemoryLimit:
    """The :class:`MemoryLimit` of ``@pytest.mark.limit_tensor_memory(*args, **kwargs)``.

    Signature: ``limit_tensor_memory(limit, metric="allocated", device=None)``; ``limit`` is bytes
    or a size string (``"64 MiB"``), ``metric`` one of :data:`METRICS`, ``device`` a device string
    (``"cpu"``, ``"cuda:1"``) or CUDA index. Raises ``TypeError``/``ValueError`` naming what is valid.
    """
    usage = f"{MEMORY_MARK}(limit, metric='allocated', device=None)"
    values = _bind(args, kwargs, ("limit", "metric", "device"), usage)
    if "limit" not in values:
        raise TypeError(f"{usage} needs a limit, e.g. {MEMORY_MARK}('64 MiB')")
    metric = values.get("metric", "allocated")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(map(repr, METRICS))}; got {metric!r}")
    device = values.get("device")
    if device is not None:
        device = _device(device)
    return MemoryLimit(parse_size(values["limit"], name="limit"), metric, device)


def leaks_limit(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LeakLimit:
    """The :class:`LeakLimit` of ``@pytest.mark.limit_tensor_leaks(*args, **kwargs)``:
    ``limit_tensor_leaks(limit)``, bytes or a size string (``"1 MiB"``)."""
    usage = f"{LEAKS_MARK}(limit)"
    values = _bind(args, kwargs, ("limit",), usage)
    if "limit" not in values:
        raise TypeError(f"{usage} needs a limit, e.g. {LEAKS_MARK}('1 MiB')")
    return LeakLimit(parse_size(values["limit"], name="limit"))


def _bind(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], usage: str
) -> dict[str, Any]:
    if len(args) > len(names):
        raise TypeError(f"{usage} takes at most {len(names)} arguments, got {len(args)}")
    values = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"{usage} got an unknown argument {key!r}; valid: {', '.join(names)}")
        if key in values:
            raise TypeError(f"{usage} got {key!r} twice")
        values[key] = value
    return values


def _device(device: Any) -> str:
    """``device`` read by :func:`memlab._devices.parse_device` (torch is imported: a test that sets
    a device is measured anyway)."""
    from memlab._devices import parse_device, with_index

    return str(with_index(parse_device(device, name="device")))


def check_memory(limit: MemoryLimit, measurement: Measurement, root: str | None = None) -> str | None:
    """The failure message of a test whose peak of ``limit.metric`` exceeded ``limit.limit``, else
    ``None``: one line with the limit and the peak (and the modelled cuBLAS workspaces the peak
    includes: :func:`memlab.sources.workspace_note.workspaces_note`), then the sites that held the
    most at the peak (``root``: the folder file names are shown relative to)."""
    from memlab.sources.workspace_note import with_note

    peak = measurement.peak(limit.metric)
    if peak <= limit.limit:
        return None
    limited, peaked = format_sizes_apart(limit.limit, peak)
    head = with_note(
        f"Test was limited to {limited} of {limit.metric} tensor memory "
        f"but peaked at {peaked} on {measurement.device}",
        measurement.workspaces,
    )
    return "\n".join([head, *_site_lines(measurement.peak_sites(limit.metric), "held at the peak", root)])


def check_leaks(limit: LeakLimit, measurement: Measurement, root: str | None = None) -> str | None:
    """The failure message of a test whose tensors still alive at its end (after ``gc.collect()``)
    take more than ``limit.limit``, else ``None``: one line with the limit and the bytes, then where
    each surviving tensor was allocated (``root`` as in :func:`check_memory`)."""
    from memlab.sources.workspace_note import with_note

    if measurement.leaked <= limit.limit:
        return None
    limited, leaked = format_sizes_apart(limit.limit, measurement.leaked)
    head = with_note(
        f"Test was limited to {limited} of leaked tensor memory "
        f"but {leaked} was still allocated at its end on {measurement.device}",
        measurement.workspaces,  # allocated for the process's life: they count as left behind
    )
    return "\n".join([head, *_site_lines(measurement.leak_sites(), "still alive", root)])


def _site_lines(sites: list[Site], what: str, root: str | None) -> list[str]:
    if not sites:
        return [f"(no allocation sites {what} were recorded)"]
    lines = [f"Allocations {what}, most bytes first:"]
    for site in sites[:TOP_SITES]:
        tensors = f"{site.tensors} tensor{'s' * (site.tensors != 1)}"
        lines.append(f"  {format_size(site.nbytes):>9} in {tensors:<10} {site.where(root)}  {site.code()}")
    if len(sites) > TOP_SITES:
        rest = sites[TOP_SITES:]
        more = f"{len(rest)} more site{'s' * (len(rest) != 1)}"
        lines.append(f"  {format_size(sum(s.nbytes for s in rest)):>9} at {more}")
    return lines
