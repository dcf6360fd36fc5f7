"""The counters behind ``memory_stats()``: the key set of ``torch.cuda.memory_stats()`` and cheap updates.

Every memory source reports the same flat keys as ``torch.cuda.memory_stats()`` on a GPU with the
native allocator (``"allocated_bytes.all.peak"``, ``"segment.small_pool.current"``, ``"num_ooms"``…).
A :class:`StatTable` holds them for one modelled device. Each statistic is a plain list
``[current, peak, allocated, freed, window_peak]`` so the allocator's hot path updates it without
method calls; ``window_peak`` is the highest value since the last :meth:`StatTable.sampler` call and
is what gives the line profiler per-line peaks without touching the user-visible ``peak``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence, Sized

__all__ = [
    "COUNTERS",
    "METRICS",
    "POOLED_STATS",
    "POOLS",
    "STAT_KEYS",
    "UNPOOLED_STATS",
    "StatTable",
    "decrease",
    "increase",
]

POOLS = ("all", "small_pool", "large_pool")
METRICS = ("current", "peak", "allocated", "freed")
POOLED_STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
UNPOOLED_STATS = ("oversize_allocations", "oversize_segments")
COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_oom_rejections",
    "max_split_size",
)
_RESETTABLE_COUNTERS = COUNTERS[:-1]  # max_split_size is configuration, not an event count

CURRENT, PEAK, ALLOCATED, FREED, WINDOW_PEAK = range(5)
_METRIC_INDEX = {"current": CURRENT, "peak": PEAK, "allocated": ALLOCATED, "freed": FREED}


def _all_keys() -> tuple[str, ...]:
    keys = [f"{s}.{p}.{m}" for s in POOLED_STATS for p in POOLS for m in METRICS]
    keys += [f"{s}.{m}" for s in UNPOOLED_STATS for m in METRICS]
    keys += list(COUNTERS)
    return tuple(sorted(keys))


#: Every key a memlab memory source reports, sorted as ``torch.cuda.memory_stats()`` sorts them.
STAT_KEYS = _all_keys()


def increase(stat: list[int], amount: int) -> None:
    """Add ``amount`` to a statistic's current value, its ``allocated`` total and its peaks."""
    current = stat[CURRENT] + amount
    stat[CURRENT] = current
    stat[ALLOCATED] += amount
    if current > stat[PEAK]:
        stat[PEAK] = current
    if current > stat[WINDOW_PEAK]:
        stat[WINDOW_PEAK] = current


def decrease(stat: list[int], amount: int) -> None:
    """Subtract ``amount`` from a statistic's current value and add it to its ``freed`` total."""
    stat[CURRENT] -= amount
    stat[FREED] += amount


class StatTable:
    """All statistics of one modelled device, in ``torch.cuda.memory_stats()`` form.

    ``stats["allocated_bytes.small_pool"]`` (pooled) or ``stats["oversize_segments"]`` (unpooled)
    is the list ``[current, peak, allocated, freed, window_peak]``; ``counters`` holds the
    ``num_*`` event counts and ``max_split_size``. Two names may share one list where the model
    makes them equal (``active`` and ``allocation`` when no stream keeps a freed block busy).
    """

    def __init__(self, aliases: dict[str, str] | None = None) -> None:
        self.stats: dict[str, list[int]] = {}
        for name in POOLED_STATS:
            for pool in POOLS:
                self.stats[f"{name}.{pool}"] = [0, 0, 0, 0, 0]
        for name in UNPOOLED_STATS:
            self.stats[name] = [0, 0, 0, 0, 0]
        for alias, target in (aliases or {}).items():
            for pool in POOLS:
                self.stats[f"{alias}.{pool}"] = self.stats[f"{target}.{pool}"]
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def pools(self, name: str) -> tuple[list[int], list[int], list[int]]:
        """The ``all``, ``small_pool`` and ``large_pool`` lists of a pooled statistic."""
        stats = self.stats
        return stats[f"{name}.all"], stats[f"{name}.small_pool"], stats[f"{name}.large_pool"]

    def as_dict(self) -> OrderedDict[str, int]:
        """A snapshot with exactly the keys of ``torch.cuda.memory_stats()``, sorted."""
        out: dict[str, int] = dict(self.counters)
        for base, stat in self.stats.items():
            for metric, index in _METRIC_INDEX.items():
                out[f"{base}.{metric}"] = stat[index]
        return OrderedDict(sorted(out.items()))

    def _distinct_stats(self) -> list[list[int]]:
        return list({id(s): s for s in self.stats.values()}.values())

    def reset_peaks(self) -> None:
        """Set every ``peak`` to its ``current`` value, as ``torch.cuda.reset_peak_memory_stats``."""
        for stat in self._distinct_stats():
            stat[PEAK] = stat[CURRENT]

    def reset_accumulated(self) -> None:
        """Zero every ``allocated``/``freed`` total and the event counters, as
        ``torch.cuda.reset_accumulated_memory_stats``; ``current``, ``peak`` and ``max_split_size``
        stay."""
        for stat in self._distinct_stats():
            stat[ALLOCATED] = 0
            stat[FREED] = 0
        for name in _RESETTABLE_COUNTERS:
            self.counters[name] = 0

    def sampler(
        self, keys: Sequence[str], pending: Sized = (), flush: Callable[[], object] | None = None
    ) -> Callable[[], tuple[int, ...]]:
        """Return a function that reads ``keys`` and then starts a new sampling window.

        Each call returns one value per key, in order. For a ``*.peak`` key the value is the
        highest reached since the previous call of the same sampler (the window), not the
        user-visible peak, which is left untouched. Other keys read as in :meth:`as_dict`.
        ``flush`` is called first whenever ``pending`` is non-empty (a tracker's queued frees).
        Raises ``ValueError`` naming the valid keys for an unknown key. Two samplers of one
        table share the window, so run one line profiler at a time per table.

        The function is generated with its reads unrolled: the line profiler calls it on every
        line event, so it must cost little more than building the tuple.
        """
        names: dict[str, object] = {"counters": self.counters, "pending": pending, "flush": flush}
        reads: list[str] = []
        resets: list[str] = []
        for key in keys:
            if key not in STAT_KEYS:
                raise ValueError(f"unknown statistic {key!r}; valid keys are: {', '.join(STAT_KEYS)}")
            if key in self.counters:
                reads.append(f"counters[{key!r}]")
                continue
            base, metric = key.rsplit(".", 1)
            stat = self.stats[base]
            name = f"s{len(names)}"
            names[name] = stat
            if metric == "peak":
                stat[WINDOW_PEAK] = stat[CURRENT]
                reads.append(f"{name}[{WINDOW_PEAK}]")
                resets.append(f"    {name}[{WINDOW_PEAK}] = {name}[{CURRENT}]\n")
            else:
                reads.append(f"{name}[{_METRIC_INDEX[metric]}]")
        source = (
            "def sample():\n"
            + ("    if pending:\n        flush()\n" if flush is not None else "")
            + f"    values = ({', '.join(reads)}{',' if len(reads) == 1 else ''})\n"
            + "".join(resets)
            + "    return values\n"
        )
        exec(source, names)
        return names["sample"]  # type: ignore[return-value]
