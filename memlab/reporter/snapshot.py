"""What :class:`memlab.MemReporter` records, and two renderers of it: the text report and DataFrames.

A :class:`TensorSnapshot` is plain data (names, shapes, byte counts), captured once and holding no
tensor; the text report, ``to_dataframe()`` and :mod:`memlab.reporter.diff` all read the same records.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import operator
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TextIO

from memlab._devices import DeviceLike, parse_device
from memlab._outputs import check_stream
from memlab._units import format_size
from memlab.history import categories

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CATEGORIES",
    "TensorRecord",
    "TensorSnapshot",
    "device_key",
    "device_matches",
    "device_order",
    "format_shape",
    "paused_gc",
    "sizes_line",
]

#: The categories a row can have: the history's names (:mod:`memlab.history.categories`);
#: ``activation`` and ``input`` only where a tracker with a history knows them.
CATEGORIES = (
    categories.PARAMETER,
    categories.BUFFER,
    categories.GRADIENT,
    categories.OPTIMIZER_STATE,
    categories.ACTIVATION,
    categories.INPUT,
    categories.UNKNOWN,
)

RULE = "-" * 79
# TensorRecord fields, read in C
_NAME, _DEVICE, _SHAPE, _MEMORY, _SHARES_WITH, _ALLOCATED_AT = (
    operator.itemgetter(i) for i in (0, 2, 3, 6, 7, 8)
)
NAME_WIDTH = 40
SIZE_WIDTH = 20
_MEM_WIDTH = 10


class TensorRecord(NamedTuple):
    """One tensor (or one storage-holding part of a sparse or wrapper tensor) seen by the reporter.

    ``storage_bytes`` is the exact ``nbytes`` of the storage the tensor uses; ``memory`` is what the
    report counts for this row: the storage's bytes (rounded up to the CUDA allocator's 512 B blocks
    on CUDA devices, and on every device with ``device_model="cuda"``) for the row that owns the
    storage, ``0`` for a row that shares a storage owned by the row named in ``shares_with``. Both
    are ``None`` when the size is symbolic or the storage cannot be read. ``shape`` holds strings
    for symbolic sizes and is ``None`` for tensors without a single shape (nested tensors) or
    refusing to give one (an uninitialized lazy parameter). ``allocated_at`` is ``file:line``
    of the innermost user frame that allocated the storage, where a :class:`memlab.TensorTracker`
    with a history counted it (else ``None``).
    """

    name: str
    category: str
    device: str
    shape: tuple[int | str, ...] | None
    dtype: str
    storage_bytes: int | None
    memory: int | None
    shares_with: str | None = None
    allocated_at: str | None = None

    @property
    def numel(self) -> int | None:
        """Elements in the tensor; ``None`` for nested tensors and symbolic sizes."""
        try:
            return math.prod(self.shape)  # type: ignore[arg-type]
        except TypeError:  # None, or symbolic sizes kept as strings
            return None

    @property
    def size_text(self) -> str:
        """The shape as the report prints it: ``(1024, 1024)``, ``(1024,)``, ``()``, ``?``."""
        return format_shape(self.shape)


def format_shape(shape: tuple[int | str, ...] | None) -> str:
    """``(1024, 1024)``, ``(1024,)``, ``()``, ``(s0, 4)`` for symbolic sizes, ``?`` for no shape."""
    if shape is None:
        return "?"
    return tuple.__repr__(shape).replace("'", "")  # symbolic sizes print bare: (s0, 4)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause cyclic garbage collection: walks over every live tensor create many small objects, and
    collections triggered meanwhile would traverse every tensor again and again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def device_key(device: DeviceLike | None) -> str | None:
    """``device`` as records name devices (read by :func:`memlab._devices.parse_device`): ``"cuda"``
    without an index selects every CUDA device, ``None`` every device."""
    return None if device is None else str(parse_device(device))


def device_matches(device: str, wanted: str | None) -> bool:
    """Whether a record's ``device`` (``"cuda:0"``) is selected by ``wanted`` (``"cuda"`` = any index)."""
    if wanted is None:
        return True
    return device == wanted or (":" not in wanted and device.split(":", 1)[0] == wanted)


def sizes_line(device_model: str | None, devices: Iterable[str]) -> str:
    """The one line that says where the byte counts of a report showing ``devices`` come from.

    ``device_model="cuda"``: modelled from the devices that are not CUDA devices, as the CUDA
    caching allocator would round them; ``None``: storage bytes, in 512 B blocks on CUDA devices.
    """
    kinds = sorted({device.partition(":")[0] for device in devices})
    if device_model == "cuda":
        modelled = " and ".join(kind for kind in kinds if kind != "cuda")
        if modelled:
            return f"sizes: as the CUDA caching allocator would round them (modelled from {modelled} tensors)"
        return "sizes: as the CUDA caching allocator rounds them (memlab.MemReporter)"
    if "cuda" in kinds:
        return "sizes: storage bytes found through gc, in 512 B blocks on cuda (memlab.MemReporter)"
    return "sizes: storage bytes found through gc (memlab.MemReporter)"


def device_order(device: str) -> tuple[str, int]:
    """Sort key for device strings: by type, then index (``cpu``, ``cuda:0``, ``cuda:1``, ``meta``)."""
    kind, _, index = device.partition(":")
    return kind, int(index) if index.isdigit() else -1


@dataclass(frozen=True)
class TensorSnapshot:
    """The tensors ``gc`` could reach at one moment, named and grouped by storage; no tensor is held.

    ``records`` are in report order (parameters each followed by their gradient, buffers, optimizer
    state, then other tensors by their ``TensorN`` number). ``allocated`` maps a device to the bytes a
    memory source reported as allocated there at the same moment and the source's name (only for
    devices where one knows it: ``torch.cuda`` on CUDA devices, a :class:`memlab.TensorTracker` or
    the ``source`` passed to the reporter elsewhere). ``device_model`` is the reporter's: ``"cuda"``
    when every storage was counted as the CUDA caching allocator would round it.
    """

    records: tuple[TensorRecord, ...]
    allocated: dict[str, tuple[int, str]] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.time)
    device_model: str | None = None

    @property
    def devices(self) -> list[str]:
        """Devices with at least one record, in report order (``cpu``, ``cuda:0``, ``cuda:1``, ``meta``)."""
        return sorted(set(map(_DEVICE, self.records)), key=device_order)

    def select(self, device: DeviceLike | None = None, verbose: bool = True) -> list[TensorRecord]:
        """Records on ``device`` (``None`` = all, ``"cuda"`` = every CUDA device); with
        ``verbose=False`` only the rows that own a storage (rows sharing one are left out)."""
        records: Iterable[TensorRecord] = self.records
        wanted = device_key(device)
        if wanted is not None:
            records = [r for r in records if device_matches(r.device, wanted)]
        if verbose:
            return list(records)
        return list(itertools.compress(records, map(operator.not_, map(_SHARES_WITH, records))))

    def used_memory(self, device: DeviceLike) -> int:
        """Bytes counted on ``device`` (``"cuda"``: every CUDA device): each storage once, as
        :attr:`TensorRecord.memory` counts it; storages of unknown size are left out."""
        return sum(filter(None, map(_MEMORY, self.select(device, verbose=False))))

    def report(
        self, verbose: bool = False, device: DeviceLike | None = None, stream: TextIO | None = None
    ) -> None:
        """Write the pytorch_memlab-style text report to ``stream`` (default: ``sys.stdout`` now)."""
        check_stream(stream)
        with paused_gc():
            text = self.render(verbose=verbose, device=device)
        print(text, file=sys.stdout if stream is None else stream)

    def render(self, verbose: bool = False, device: DeviceLike | None = None) -> str:
        """The text report: a header, one block per device, totals and the allocator's view, and
        the line that says where the sizes come from (:func:`sizes_line`).

        With ``verbose=False`` a storage shared by several tensors appears once, under its owner's
        name; with ``verbose=True`` every sharer is listed too, as ``name(->owner)`` with ``0.00B``.
        """
        device = device_key(device)
        records = self.select(device, verbose)
        # Sizes and byte counts repeat: format each distinct one once (C-level passes over the rows).
        shapes, memories = list(map(_SHAPE, records)), list(map(_MEMORY, records))
        size_texts = {shape: format_shape(shape) for shape in set(shapes)}
        memory_texts = {memory: _memory_text(memory) for memory in set(memories)}
        if verbose:
            labels = [r.name if r.shares_with is None else f"{r.name}(->{r.shares_with})" for r in records]
        else:
            labels = list(map(_NAME, records))
        width = max(NAME_WIDTH, max(map(len, labels), default=0) + 2)
        size_width = max(SIZE_WIDTH, max(map(len, size_texts.values()), default=0) + 2)
        template = f"%-{width}s%{size_width}s%{_MEM_WIDTH}s"
        # A row is its padded label then its size and bytes, each distinct one padded once.
        size_cells = {shape: text.rjust(size_width) for shape, text in size_texts.items()}
        memory_cells = {memory: text.rjust(_MEM_WIDTH) for memory, text in memory_texts.items()}
        size_column = map(size_cells.__getitem__, shapes)
        cells = map(operator.add, size_column, map(memory_cells.__getitem__, memories))
        lines = list(map(operator.add, map(str.ljust, labels, itertools.repeat(width)), cells))
        rule = "-" * max(len(RULE), width + size_width + _MEM_WIDTH)
        out = [template % ("Element type", "Size", "Used MEM")]
        if any(map(_ALLOCATED_AT, records)):  # a tracker's history says where each was allocated
            lines = [
                f"{line}  {r.allocated_at or ''}".rstrip() for line, r in zip(lines, records, strict=True)
            ]
            out[0] += "  Allocated at"
        # Every device with a record also has a row owning a storage, so ``records`` spans them all.
        shown = [dev for dev in self.devices if device_matches(dev, device)]
        one_device = len(shown) == 1
        for dev in shown:
            out += [rule, f"Storage on {dev}"]
            if one_device:
                out += lines
            else:
                out += [line for line, d in zip(lines, map(_DEVICE, records), strict=True) if d == dev]
            owners = records if one_device and not verbose else self.select(dev, verbose=False)
            out += [rule, *_device_footer(self, dev, owners), rule]
        if len(out) == 1:
            out += [rule, "No tensors" + ("" if device is None else f" on {device}"), rule]
        out.append(sizes_line(self.device_model, shown))
        return "\n".join(out)

    def to_dataframe(self, verbose: bool = False, device: DeviceLike | None = None) -> pd.DataFrame:
        """The report's rows as a DataFrame, one row per listed tensor.

        Columns: ``device``, ``name``, ``category`` (one of :data:`CATEGORIES`), ``shape`` (a
        tuple, ``None`` without a single shape), ``dtype``, ``numel``, ``memory`` (bytes counted, as in
        the report), ``storage_bytes`` (exact bytes of the storage) and ``shares_with`` (the
        owner's name for rows sharing its storage, else ``None``). Byte and element counts are
        nullable integers (``Int64``): unknown sizes are ``<NA>``. ``frame.attrs["sizes"]`` holds
        the report's line saying where the sizes come from. ``allocated_at`` (``file:line``, or
        ``None``) is there when some row has one: see :meth:`memlab.MemReporter.snapshot`.
        """
        import pandas as pd

        columns = ["device", "name", "category", "shape", "dtype", "numel", "memory", "storage_bytes"]
        data = [
            [
                r.device,
                r.name,
                r.category,
                r.shape,
                r.dtype,
                r.numel,
                r.memory,
                r.storage_bytes,
                r.shares_with,
            ]
            for r in self.select(device, verbose)
        ]
        frame = pd.DataFrame(data, columns=[*columns, "shares_with"])
        if any(r.allocated_at for r in self.records):
            frame["allocated_at"] = [r.allocated_at for r in self.select(device, verbose)]
        # Nullable integers: bytes stay exact integers, unknown sizes are <NA> (never NaN floats).
        frame = frame.astype({"numel": "Int64", "memory": "Int64", "storage_bytes": "Int64"})
        frame.attrs["sizes"] = sizes_line(self.device_model, set(frame["device"]))
        return frame


def _memory_text(memory: int | None) -> str:
    return "?" if memory is None else format_size(memory)


def _device_footer(snapshot: TensorSnapshot, device: str, owners: list[TensorRecord]) -> list[str]:
    """Totals over ``owners`` (the records owning a storage on ``device``) and the allocator's view."""
    memories = list(map(_MEMORY, owners))
    unknown = memories.count(None)
    used = sum(filter(None, memories))
    try:
        numel = sum(map(math.prod, map(_SHAPE, owners)))
    except TypeError:  # nested or symbolic shapes: count the others
        numel = sum(r.numel or 0 for r in owners if r.memory is not None)
    lines = [f"Total Tensors: {numel}  Used Memory: {format_size(used)}"]
    if unknown:
        lines.append(
            f"{unknown} tensor(s) of unknown size (symbolic shapes, or no readable storage) "
            "are listed with '?' and not counted"
        )
    if device in snapshot.allocated:
        allocated, source = snapshot.allocated[device]
        lines.append(f"The allocated memory on {device}: {format_size(allocated)}")
        if allocated != used:
            lines.append(_explain_difference(device, allocated, used, source, snapshot.device_model))
    return lines


def _explain_difference(device: str, allocated: int, used: int, source: str, device_model: str | None) -> str:
    gap = format_size(abs(allocated - used))
    if allocated > used:
        why = "memory gc cannot see (autograd's saved tensors, C++-held buffers, kernel workspaces)"
        if device.startswith("cuda") or source != "torch.cuda":
            why += " or allocator blocks larger than the requests"
        return f"{source} reports {gap} more than the tensors above: {why}"
    why = "it does not count storages that existed before it started or were allocated outside it"
    if device_model == "cuda" and not device.startswith("cuda"):
        why += ", or counts exact bytes where the sizes above are modelled"
    return f"{source} reports {gap} less than the tensors above: {why}"
