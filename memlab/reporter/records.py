"""From tensors to :class:`~memlab.reporter.snapshot.TensorRecord` s: storage identity and bytes.

A storage counts its ``nbytes``, rounded as the CUDA caching allocator rounds requests where it
lives on a CUDA device or where the report models one (``device_model="cuda"``).

Tensors sharing a storage (the ``UntypedStorage`` object, never ``data_ptr``: every ``meta`` tensor
has data pointer 0) are grouped; the first one seen owns the storage's bytes, the others share them.
Sparse tensors count through their indices and values, wrapper subclasses through their inner tensors.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from memlab._tensors import parts
from memlab.history.categories import PARAMETER, UNKNOWN
from memlab.reporter.snapshot import TensorRecord
from memlab.sources.allocator.config import round_size

__all__ = [
    "DEVICE_MODELS",
    "DenseTensors",
    "DeviceTexts",
    "RecordBuilder",
    "build_records",
    "cuda_block_bytes",
]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# Unbound C methods and getters, so that a map() over every tensor runs without a Python frame.
_UNTYPED_STORAGE, _NBYTES = torch.Tensor.untyped_storage, torch.UntypedStorage.nbytes
_FIELDS = operator.attrgetter("shape", "is_cpu", "dtype", "requires_grad")
_FIRST, _SECOND, _THIRD, _FOURTH = (operator.itemgetter(index) for index in range(4))
_CHUNK = 256  # tensors read at a time: see DenseTensors.read


#: The values of ``device_model``: ``None`` (each device as it is) and the devices that can be modelled.
DEVICE_MODELS = (None, "cuda")


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a ``nbytes`` storage.

    Requests round up to a multiple of 512 B (so 1..512 B take 512 B); an empty storage takes
    nothing. Whole-block hand-outs and ``roundup_power2_divisions`` are not modelled here.
    """
    return round_size(nbytes) if nbytes else 0


class DenseTensors(NamedTuple):
    """What the records need of plain dense tensors, one entry per tensor, read in bulk.

    ``fields`` holds each tensor's ``(shape, is_cpu, dtype, requires_grad)``; ``storages`` keeps the
    storages alive so that their ``id`` stays unique while the records are built.
    """

    storages: list[torch.UntypedStorage]
    storage_bytes: list[int]
    fields: list[tuple[torch.Size, bool, torch.dtype, bool]]

    @classmethod
    def read(cls, tensors: list[torch.Tensor]) -> DenseTensors | None:
        """``tensors`` read in bulk; ``None`` when one is a subclass, sparse or nested (see
        :class:`RecordBuilder`)."""
        if not set(map(type, tensors)) <= set(_PLAIN_TYPES):
            return None
        dense = cls([], [], [])
        # Reading a tensor costs mostly the cache misses on its objects (the Python object, the C++
        # TensorImpl and StorageImpl). Several passes over one chunk, while it is still in the CPU
        # cache, are about twice as fast as one pass per column over 100,000 tensors; and one
        # getter of four attributes costs about as much as a getter of one.
        try:
            for start in range(0, len(tensors), _CHUNK):
                chunk = tensors[start : start + _CHUNK]
                storages = list(map(_UNTYPED_STORAGE, chunk))
                dense.storages.extend(storages)
                dense.storage_bytes.extend(map(_NBYTES, storages))
                dense.fields.extend(map(_FIELDS, chunk))
        except RuntimeError:  # sparse layouts, nested tensors
            return None
        return dense

    @property
    def requires_grad(self) -> Iterator[bool]:
        return map(_FOURTH, self.fields)

    def take(self, indices: Sequence[int]) -> DenseTensors:
        """The entries at ``indices``, in that order."""
        return DenseTensors(*(list(map(column.__getitem__, indices)) for column in self))

    def followed_by(self, other: DenseTensors) -> DenseTensors:
        """These entries, then ``other``'s."""
        return DenseTensors(*(mine + theirs for mine, theirs in zip(self, other, strict=True)))


def build_records(
    tensors: list[torch.Tensor],
    names: list[str],
    categories: list[str | None],
    dtypes: bool,
    dense: DenseTensors | None = None,
    device_model: str | None = None,
) -> list[TensorRecord]:
    """The records :meth:`RecordBuilder.add_plain` makes of ``zip(tensors, names, categories)``;
    ``device_model="cuda"`` rounds every storage's bytes as the CUDA caching allocator would.

    When every tensor is a dense ``torch.Tensor`` or ``nn.Parameter`` (the common case), they are
    computed column by column, each column one C-level pass over all tensors, from ``dense`` (the
    tensors read already) if given; otherwise the builder takes them one by one.
    """
    if dense is None:
        dense = DenseTensors.read(tensors)
    if dense is None:
        builder = RecordBuilder(dtypes, device_model)
        builder.add_plain(zip(tensors, names, categories, strict=True))
        return builder.records
    storages, storage_bytes, fields = dense
    count = len(tensors)
    keys = list(map(id, storages))  # unique while ``storages`` holds them
    # The first tensor seen on a storage owns it: setdefault returns the first index stored.
    owner_index = list(map({}.setdefault, keys, range(count)))
    memory = storage_bytes.copy()  # a sharer's storage is its owner's: same bytes
    shares_with: list[str | None] = [None] * count
    for index in itertools.compress(range(count), map(operator.ne, owner_index, range(count))):
        memory[index] = 0
        shares_with[index] = names[owner_index[index]]
    modelled = device_model == "cuda"
    if modelled:
        memory = list(map(cuda_block_bytes, memory))
    devices: Iterable[str] = itertools.repeat("cpu", count)
    is_cpu = list(map(_SECOND, fields))
    if not all(is_cpu):
        devices = _devices(storages, is_cpu, None if modelled else memory, DeviceTexts(modelled))
    dtype_texts: Iterable[str] = itertools.repeat("", count)
    if dtypes:
        dtype_objects = list(map(_THIRD, fields))
        texts = {dtype: str(dtype).removeprefix("torch.") for dtype in set(dtype_objects)}
        dtype_texts = map(texts.__getitem__, dtype_objects)
    shapes = map(_FIRST, fields)
    columns = zip(
        names,
        categories,
        devices,
        shapes,
        dtype_texts,
        storage_bytes,
        memory,
        shares_with,
        itertools.repeat(None),  # allocated_at
        strict=False,
    )  # ``devices``, ``dtype_texts`` and ``allocated_at`` may be endless repeats
    return list(map(tuple.__new__, itertools.repeat(TensorRecord), columns))  # NamedTuple._make in C


def _devices(
    storages: list[torch.UntypedStorage], is_cpu: list[bool], memory: list[int] | None, texts: DeviceTexts
) -> list[str]:
    """Device strings of ``storages`` (not all on the CPU); the rows of ``memory``, if given, on
    devices that count in allocator blocks are rounded to them."""
    devices = ["cpu"] * len(storages)
    for index in itertools.compress(range(len(storages)), map(operator.not_, is_cpu)):
        devices[index], rounds = texts[storages[index].device]
        if rounds and memory is not None:
            memory[index] = cuda_block_bytes(memory[index])
    return devices


class DeviceTexts(dict[torch.device, tuple[str, bool]]):
    """``torch.device -> (its text, whether its storages count in CUDA allocator blocks)``, filled
    on first use: every CUDA device does, and every device when the report models one."""

    def __init__(self, modelled: bool) -> None:
        super().__init__()
        self.modelled = modelled

    def __missing__(self, device: torch.device) -> tuple[str, bool]:
        entry = self[device] = (str(device), self.modelled or device.type == "cuda")
        return entry


class RecordBuilder:
    """Turns tensors into records; the first tensor seen on a storage owns it, later ones share it.

    ``dtypes=False`` leaves ``dtype`` empty (the text report does not print it);
    ``device_model="cuda"`` rounds every storage as the CUDA caching allocator would, whatever its
    device. The builder holds the storages it has seen, so that their ``id`` stays unique: drop it
    when done.
    """

    def __init__(self, dtypes: bool, device_model: str | None = None) -> None:
        self.with_dtypes = dtypes
        self.modelled = device_model == "cuda"
        self.records: list[TensorRecord] = []
        self.owners: dict[int, tuple[torch.UntypedStorage, str, int | None, str]] = {}
        self.devices = DeviceTexts(self.modelled)
        self.dtypes: dict[torch.dtype, str] = {}

    def add_plain(self, tensors: Iterable[tuple[torch.Tensor, str, str | None]]) -> None:
        """The hot loop for ``torch.Tensor`` and ``nn.Parameter``; other tensors go to :meth:`add`."""
        append, make = self.records.append, tuple.__new__  # a record without NamedTuple's overhead
        owners, dtypes, with_dtypes, modelled = self.owners, self.dtypes, self.with_dtypes, self.modelled
        plain_types, record, object_id, kind = _PLAIN_TYPES, TensorRecord, id, type
        for tensor, name, category in tensors:
            if kind(tensor) not in plain_types:
                self.add(tensor, name, category)
                continue
            try:
                storage = tensor.untyped_storage()
                shape = tensor.shape
            except RuntimeError:  # sparse layouts, nested tensors
                self.add(tensor, name, category)
                continue
            dtype = ""
            if with_dtypes:
                dtype = dtypes.get(tensor.dtype)
                if dtype is None:
                    dtype = dtypes[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
            key = object_id(storage)
            owner = owners.get(key)
            if owner is not None:
                append(make(record, (name, category, owner[1], shape, dtype, owner[2], 0, owner[3], None)))
                continue
            nbytes = storage.nbytes()
            if tensor.is_cpu:  # the common case, without hashing a torch.device
                owners[key] = (storage, "cpu", nbytes, name)
                memory = cuda_block_bytes(nbytes) if modelled else nbytes
                append(make(record, (name, category, "cpu", shape, dtype, nbytes, memory, None, None)))
                continue
            device, rounds = self.devices[storage.device]
            owners[key] = (storage, device, nbytes, name)
            memory = cuda_block_bytes(nbytes) if rounds else nbytes
            append(make(record, (name, category, device, shape, dtype, nbytes, memory, None, None)))

    def add(self, top: torch.Tensor, top_name: str, category: str | None) -> None:
        """Any tensor: sparse and wrapper tensors by their parts; symbolic or unreadable sizes as unknown."""
        if category is None:  # an unnamed subclass instance
            category = PARAMETER if isinstance(top, torch.nn.Parameter) else UNKNOWN
        try:
            found = list(parts(top, top_name))
        except Exception:  # a subclass that refuses to be flattened: list it, size unknown
            found = [(top, top_name)]
        for tensor, name in found:
            try:
                dtype = str(tensor.dtype).removeprefix("torch.")
            except RuntimeError:  # an undefined tensor ("unsupported scalarType", torch 2.8): no memory
                continue
            try:
                shape: tuple[int | str, ...] | None = tuple(
                    d if isinstance(d, int) else str(d) for d in tensor.shape
                )
            except Exception:  # nested tensors have no single shape; odd subclasses refuse
                shape = None
            try:
                storage = tensor.untyped_storage()
            except Exception:  # no storage to read (e.g. an uninitialized lazy parameter)
                self.records.append(
                    TensorRecord(name, category, str(tensor.device), shape, dtype, None, None)
                )
                continue
            owner = self.owners.get(id(storage))
            if owner is not None:
                self.records.append(
                    TensorRecord(name, category, owner[1], shape, dtype, owner[2], 0, owner[3])
                )
                continue
            device, rounds = self.devices[storage.device]
            nbytes = storage.nbytes()
            if not isinstance(nbytes, int):  # symbolic
                nbytes = None
            memory = cuda_block_bytes(nbytes) if nbytes is not None and rounds else nbytes
            self.owners[id(storage)] = (storage, device, nbytes, name)
            self.records.append(TensorRecord(name, category, device, shape, dtype, nbytes, memory))
