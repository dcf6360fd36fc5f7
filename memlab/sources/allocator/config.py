"""The CUDA caching allocator's size arithmetic and its ``PYTORCH_CUDA_ALLOC_CONF`` settings.

Pure functions with the constants and rules of PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` and
``c10/core/AllocatorConfig.cpp``: how a request is rounded, which pool serves it, how big a new
segment (``cudaMalloc``) is, and how an allocator configuration string is read. All sizes are bytes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "MODELLED_OPTIONS",
    "NO_EFFECT_OPTIONS",
    "UNLIMITED",
    "AllocatorConfig",
    "allocation_size",
    "is_small",
    "parse_alloc_conf",
    "pool_name",
    "round_size",
]

K_MIN_BLOCK_SIZE = 512  #: every request is rounded to at least, and a multiple of, 512 B
K_SMALL_SIZE = 1_048_576  #: the largest request served by the small pool (1 MiB)
K_SMALL_BUFFER = 2_097_152  #: small requests are packed into 2 MiB segments
K_LARGE_BUFFER = 20_971_520  #: requests between 1 and 10 MiB get a 20 MiB segment
K_MIN_LARGE_ALLOC = 10_485_760  #: from 10 MiB on, a segment is the request rounded up to 2 MiB
K_ROUND_LARGE = 2_097_152
UNLIMITED = 2**64 - 1  #: ``SIZE_MAX``: the default ``max_split_size`` (reported as -1)

_MIB = 1_048_576
_INTERVALS = 16  # roundup_power2_divisions intervals: [1 MiB, 2 MiB), [2, 4), ... , [32 GiB, inf)
_MAX_REGISTER_THREADS = 128  # pinned_max_register_threads() in CUDAAllocatorConfig

#: Options that change the model's numbers.
MODELLED_OPTIONS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "expandable_segments",
    "garbage_collection_threshold",
    "backend",
)
#: Options PyTorch accepts that do not change device memory accounting (host/pinned memory,
#: locking, CUDA graphs): accepted and ignored.
NO_EFFECT_OPTIONS = (
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
)
# Options of newer PyTorch versions that would change the numbers but are not modelled.
_NOT_MODELLED = {
    "per_process_memory_fraction": "memory fractions are not modelled; pass capacity= instead",
    "throw_on_cudamalloc_oom": "the OOM preemption policy is not modelled",
    "large_segment_size_mb": "a large segment size other than 20 MiB is not modelled",
}
_BOOL_OPTIONS = (
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
)
_TOKEN_RE = re.compile(r"[,:\[\]]|[^,:\[\]]+")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings the model honours (PyTorch's defaults unless configured).

    ``max_split_size`` and ``max_non_split_rounding_size`` are bytes (``UNLIMITED`` means no
    limit); ``roundup_power2_divisions`` holds one division count per size interval
    ``[1 MiB, 2 MiB), [2 MiB, 4 MiB), … [32 GiB, ∞)`` (the first also covers requests below
    1 MiB; 0 means plain 512 B rounding). ``garbage_collection_threshold`` is kept but has no
    effect: PyTorch only collects when a per-process memory fraction is set, which the model
    does not have. ``source`` is the string the settings were read from.
    """

    max_split_size: int = UNLIMITED
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    source: str = ""

    @property
    def reported_max_split_size(self) -> int:
        """``max_split_size`` as ``torch.cuda.memory_stats()`` reports it: -1 when unlimited."""
        return -1 if self.max_split_size == UNLIMITED else self.max_split_size


DEFAULT_CONFIG = AllocatorConfig()


def _divisions_for(size: int, divisions: tuple[int, ...]) -> int:
    index = min(max(size.bit_length() - 1 - 20, 0), _INTERVALS - 1)
    return divisions[index]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """The block size the caching allocator grants for a request of ``nbytes`` bytes.

    Below 512 B the answer is 512 B; otherwise ``nbytes`` rounded up to a multiple of 512 B,
    unless ``roundup_power2_divisions`` gives the request's size interval ``d > 1`` divisions and
    ``nbytes > 512 * d``: then it is rounded up to the next of ``d`` equal steps between the
    surrounding powers of two (1200 B with 4 divisions → 1280 B), as ``round_size`` in
    ``CUDACachingAllocator.cpp`` does.
    """
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if config is not None:
        divisions = _divisions_for(nbytes, config.roundup_power2_divisions)
        if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(nbytes, divisions)
    return (nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def is_small(size: int) -> bool:
    """Whether a rounded block size is served by the small pool (at most 1 MiB)."""
    return size <= K_SMALL_SIZE


def pool_name(size: int) -> str:
    """``"small_pool"`` for a rounded size of at most 1 MiB, else ``"large_pool"``."""
    return "small_pool" if size <= K_SMALL_SIZE else "large_pool"


def allocation_size(size: int) -> int:
    """Bytes of the new segment (``cudaMalloc``) made for a rounded request of ``size`` bytes.

    2 MiB for small-pool sizes (≤ 1 MiB), 20 MiB below 10 MiB, otherwise ``size`` rounded up
    to a multiple of 2 MiB (``get_allocation_size``).
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def _valid_options() -> str:
    return ", ".join(sorted(MODELLED_OPTIONS + NO_EFFECT_OPTIONS))


def _config_error(text: str, message: str) -> ValueError:
    return ValueError(f"allocator config {text!r}: {message}")


def _to_int(text: str, key: str, value: str) -> int:
    if not value.isdigit():
        raise _config_error(text, f"{key} expects a non-negative integer, got {value!r}")
    return int(value)


def _megabytes_at_least_20(text: str, key: str, value: str) -> int:
    megabytes = _to_int(text, key, value)
    minimum = K_LARGE_BUFFER // _MIB
    if megabytes < minimum:
        raise _config_error(text, f"{key} too small, must be >= {minimum}, got {megabytes}")
    return min(megabytes * _MIB, UNLIMITED // _MIB * _MIB)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _register_threads(text: str, key: str, value: str) -> int:
    threads = _to_int(text, key, value)
    if not (_is_power_of_two(threads) and threads <= _MAX_REGISTER_THREADS):
        raise _config_error(
            text, f"{key} must be a power of 2 from 1 to {_MAX_REGISTER_THREADS}, got {value!r}"
        )
    return threads


def _power_of_two_divisions(text: str, value: str, allow_zero: bool) -> int:
    divisions = _to_int(text, "roundup_power2_divisions", value)
    if not _is_power_of_two(divisions) and not (allow_zero and divisions == 0):
        raise _config_error(
            text,
            f"roundup_power2_divisions must be a power of 2{' or 0' if allow_zero else ''}, got {value!r}",
        )
    return divisions


def _parse_divisions(text: str, tokens: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """Parse the value of ``roundup_power2_divisions`` starting at ``tokens[i]``; return the
    table and the index of the value's last token."""
    if tokens[i] != "[":
        return (_power_of_two_divisions(text, tokens[i], allow_zero=False),) * _INTERVALS, i
    table = [0] * _INTERVALS
    first = True
    last_index = 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        interval = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise _config_error(text, "roundup_power2_divisions list entries look like 256:2 or >:4")
        divisions = _power_of_two_divisions(text, tokens[i + 2], allow_zero=True)
        if interval == ">":
            table[last_index:] = [divisions] * (_INTERVALS - last_index)
        else:
            megabytes = _to_int(text, "roundup_power2_divisions interval", interval)
            if not _is_power_of_two(megabytes):
                raise _config_error(
                    text, f"roundup_power2_divisions intervals must be powers of 2 (MB), got {interval}"
                )
            index = min(megabytes.bit_length() - 1, _INTERVALS - 1)
            if first:
                table[:index] = [divisions] * index
                first = False
            table[index] = divisions
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise _config_error(text, "roundup_power2_divisions list is missing its closing ']'")
    return tuple(table), i


def parse_alloc_conf(text: str | None = None) -> AllocatorConfig:
    """Read a ``PYTORCH_CUDA_ALLOC_CONF``-style string such as
    ``"max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:False"``.

    ``None`` reads the environment like PyTorch: ``PYTORCH_CUDA_ALLOC_CONF``, else
    ``PYTORCH_ALLOC_CONF``, else the defaults. Modelled options: ``max_split_size_mb`` and
    ``max_non_split_rounding_mb`` (MB, at least 20), ``roundup_power2_divisions`` (a power of 2,
    or a list of ``interval_mb:divisions`` with ``>`` for the rest), ``expandable_segments``
    (``True``/``False``), ``garbage_collection_threshold`` (in (0, 1); no effect without a memory
    fraction, as in PyTorch) and ``backend:native``. Options that only concern pinned host memory,
    locking or CUDA graphs are checked as PyTorch checks them (``pinned_num_register_threads``: a
    power of 2 up to 128) and ignored. Raises ``ValueError`` for an unknown option
    (listing the valid ones), a bad value, ``backend:cudaMallocAsync`` and options whose effect is
    not modelled.
    """
    if text is None:
        text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        if text is None:
            text = os.environ.get("PYTORCH_ALLOC_CONF", "")
    if not isinstance(text, str):
        raise TypeError(
            f"config must be a string such as 'max_split_size_mb:128' or None, got {type(text).__name__}"
        )
    tokens = [t for t in (m.group(0).strip() for m in _TOKEN_RE.finditer(text)) if t]
    settings: dict[str, object] = {"source": text}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in _NOT_MODELLED:
            raise _config_error(text, f"option {key!r} is not modelled: {_NOT_MODELLED[key]}")
        if key not in MODELLED_OPTIONS and key not in NO_EFFECT_OPTIONS:
            raise _config_error(text, f"unknown option {key!r}; valid options are: {_valid_options()}")
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise _config_error(text, f"expected '{key}:<value>'")
        i += 2
        value = tokens[i]
        if key in _BOOL_OPTIONS:
            if value not in ("True", "False"):
                raise _config_error(text, f"expected True or False for {key}, got {value!r}")
            if key == "expandable_segments":
                settings["expandable_segments"] = value == "True"
        elif key == "max_split_size_mb":
            settings["max_split_size"] = _megabytes_at_least_20(text, key, value)
        elif key == "max_non_split_rounding_mb":
            settings["max_non_split_rounding_size"] = _megabytes_at_least_20(text, key, value)
        elif key == "roundup_power2_divisions":
            settings["roundup_power2_divisions"], i = _parse_divisions(text, tokens, i)
        elif key == "garbage_collection_threshold":
            try:
                threshold = float(value)
            except ValueError:
                threshold = -1.0
            if not 0.0 < threshold < 1.0:
                raise _config_error(
                    text, f"garbage_collection_threshold must be in (0.0, 1.0), got {value!r}"
                )
            settings["garbage_collection_threshold"] = threshold
        elif key == "backend":
            if value == "cudaMallocAsync":
                raise _config_error(
                    text,
                    "backend:cudaMallocAsync is not modelled; memlab models the native caching allocator",
                )
            if value != "native":
                raise _config_error(
                    text, f"unknown allocator backend {value!r}; options are native and cudaMallocAsync"
                )
        elif key == "pinned_num_register_threads":
            _register_threads(text, key, value)
        else:
            _to_int(text, key, value)
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise _config_error(text, f"expected ',' after the value of {key!r}, got {tokens[i]!r}")
            i += 1
    return AllocatorConfig(**settings)  # type: ignore[arg-type]
