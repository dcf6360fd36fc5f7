"""The counters behind ``memory_stats()``: the key set of ``torch.cuda.memory_stats()`` and cheap updates.

Every memory source reports the same flat keys as ``torch.cuda.memory_stats()`` on a GPU with the
native allocator (``"allocated_bytes.all.peak"``, ``"segment.small_pool.current"``, ``"num_ooms"``…).
A :class:`StatTable` holds them for one modelled device. Each statistic is a plain list
``[current, peak, allocated, freed, window_peak]`` so the allocator's hot path updates it without
method calls; ``window_peak`` is the highest value since the last :meth:`StatTable.sampler` call and
is what gives the line profiler per-line peaks without touching the user-visible ``peak``.
"""

from __future__ import annotations

import weakref
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
        self._windows = _Windows()
        #: Bumped by the allocator after every change to a statistic (``malloc``, ``free``, ...):
        #: a line profiler skips the sample at a line event where it did not move.
        self.changes = 0

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
        highest reached since the previous call of the same sampler (its window), not the
        user-visible peak, which is left untouched. Other keys read as in :meth:`as_dict`.
        ``flush`` is called first whenever ``pending`` is non-empty (a tracker's queued frees).
        Raises ``ValueError`` naming the valid keys for an unknown key.

        Several samplers of one table (two line profilers on one tracker) keep separate windows:
        while more than one sampler with peak keys is alive, a call folds the shared running
        window into the other samplers' own before starting a new one.

        The function is generated with its reads unrolled: the line profiler calls it on every
        line event, so it must cost little more than building the tuple. The shared-window path
        is a plain Python function, taken only while several samplers are alive.
        """
        names: dict[str, object] = {"counters": self.counters, "pending": pending, "flush": flush}
        reads: list[str] = []
        resets: list[str] = []
        slow_reads: list[tuple[list[int] | dict[str, int], int | str, bool]] = []
        window = _Window()
        self._windows.fold(None)  # a new sampler starts a new running window: keep the others'
        for key in keys:
            if key not in STAT_KEYS:
                raise ValueError(f"unknown statistic {key!r}; valid keys are: {', '.join(STAT_KEYS)}")
            if key in self.counters:
                reads.append(f"counters[{key!r}]")
                slow_reads.append((self.counters, key, False))
                continue
            base, metric = key.rsplit(".", 1)
            stat = self.stats[base]
            name = f"s{len(names)}"
            names[name] = stat
            if metric == "peak":
                stat[WINDOW_PEAK] = stat[CURRENT]
                reads.append(f"{name}[{WINDOW_PEAK}]")
                resets.append(f"    {name}[{WINDOW_PEAK}] = {name}[{CURRENT}]\n")
                slow_reads.append((stat, len(window.stats), True))
                window.stats.append(stat)
                window.carry.append(0)
            else:
                reads.append(f"{name}[{_METRIC_INDEX[metric]}]")
                slow_reads.append((stat, _METRIC_INDEX[metric], False))
        shared = ""
        if window.stats:
            # The peak of this table's running window must be folded into the other samplers'
            # own windows before this one resets it.
            self._windows.register(window)
            window.slow_reads = slow_reads
            names.update(shared_flag=self._windows.shared, shared_sample=self._windows.sample, window=window)
            shared = "    if shared_flag[0]:\n        return shared_sample(window)\n"
        # Every name is a default argument: a local read costs less than a global one, which
        # pays for the shared-window check.
        parameters = ", ".join(f"{name}={name}" for name in names)
        source = (
            f"def sample({parameters}):\n"
            + ("    if pending:\n        flush()\n" if flush is not None else "")
            + shared
            + f"    values = ({', '.join(reads)}{',' if len(reads) == 1 else ''})\n"
            + "".join(resets)
            + "    return values\n"
        )
        exec(source, names)
        # Not kept in its own globals, so that the function and its window die with the last
        # reference to it (no reference cycle waiting for gc).
        sample = names.pop("sample")
        # what a line profiler reads to skip the sample where nothing moved (line_profiler/local_tracer.py)
        sample.memlab_changes, sample.memlab_pending, sample.memlab_flush = self, pending, flush
        return sample  # type: ignore[no-any-return]


class _Window:
    """One sampler's own window: the statistics behind its peak keys and the highest value each
    reached since the sampler's last call while other samplers reset the table's window."""

    __slots__ = ("__weakref__", "carry", "slow_reads", "stats")

    def __init__(self) -> None:
        self.stats: list[list[int]] = []
        self.carry: list[int] = []
        self.slow_reads: list[tuple[list[int] | dict[str, int], int | str, bool]] = []


class _Windows:
    """The live samplers (with peak keys) of one table; ``shared[0]`` says whether there are
    several, which sends every sampler down :meth:`sample`."""

    def __init__(self) -> None:
        self.shared = [False]
        self._live: dict[int, weakref.ref[_Window]] = {}

    def register(self, window: _Window) -> None:
        key = id(window)
        self._live[key] = weakref.ref(window, lambda _, key=key: self._forget(key))
        self.shared[0] = len(self._live) > 1

    def _forget(self, key: int) -> None:
        self._live.pop(key, None)
        self.shared[0] = len(self._live) > 1

    def fold(self, me: _Window | None) -> None:
        """Fold the running window into every live sampler's own window except ``me``."""
        for ref in list(self._live.values()):
            other = ref()
            if other is None or other is me:
                continue
            carry = other.carry
            for j, stat in enumerate(other.stats):
                if stat[WINDOW_PEAK] > carry[j]:
                    carry[j] = stat[WINDOW_PEAK]

    def sample(self, me: _Window) -> tuple[int, ...]:
        """Read ``me``'s keys: peaks are the highest of the running window and what other
        samplers' resets folded into ``me``; then fold the running window into the others and
        start a new one."""
        values = []
        for container, index, peak in me.slow_reads:
            if peak:
                value = container[WINDOW_PEAK]  # type: ignore[index]
                carried = me.carry[index]  # type: ignore[index]
                values.append(carried if carried > value else value)
            else:
                values.append(container[index])  # type: ignore[index]
        self.fold(me)
        for j, stat in enumerate(me.stats):
            me.carry[j] = 0
            stat[WINDOW_PEAK] = stat[CURRENT]
        return tuple(values)
