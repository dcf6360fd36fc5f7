"""Byte sizes: parse the strings people write ("2 GiB", "512MB") and print sizes like pytorch_memlab;
check counts (steps, world sizes)."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

__all__ = ["check_count", "format_size", "format_sizes_apart", "parse_size"]

_PRINT_UNITS = ("B", "K", "M", "G", "T", "P")

# Binary units (KiB, K, k) are powers of 1024; decimal units (KB, MB, GB) powers of 1000.
_UNIT_FACTORS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
    "p": 1024**5,
    "pib": 1024**5,
    "pb": 1000**5,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def format_size(num_bytes: float) -> str:
    """Format a byte count the way pytorch_memlab prints it.

    1024-based, two decimals, units ``B K M G T P``: ``512.00B``, ``40.00K``, ``2.00M``,
    ``-1.50G`` for negative deltas. NaN (a line that never ran) formats as an empty string.
    """
    if isinstance(num_bytes, float) and math.isnan(num_bytes):
        return ""
    value = float(num_bytes)
    for unit in _PRINT_UNITS[:-1]:
        if abs(value) < 1024.0:
            return f"{value:.2f}{unit}"
        value /= 1024.0
    return f"{value:.2f}{_PRINT_UNITS[-1]}"


def format_sizes_apart(*sizes: int) -> list[str]:
    """:func:`format_size` of each of ``sizes`` (bytes), so that different sizes read different.

    Where two different sizes would print the same (1 MiB and 1 MiB + 4 KiB are both ``1.00M``),
    each of them gets its exact bytes too: ``1.00M (1,048,576 B)``, ``1.00M (1,052,672 B)``.
    """
    texts = [format_size(size) for size in sizes]
    return [
        f"{text} ({size:,} B)"
        if any(other == text and other_size != size for other, other_size in zip(texts, sizes, strict=True))
        else text
        for text, size in zip(texts, sizes, strict=True)
    ]


def parse_size(size: int | str, *, name: str = "size") -> int:
    """Return ``size`` in bytes: an ``int`` as it is, or a string such as ``"2 GiB"``.

    Units are case-insensitive: ``B``; binary ``K``/``KiB``, ``M``/``MiB``, ``G``/``GiB``,
    ``T``/``TiB``, ``P``/``PiB`` (powers of 1024, as memlab prints sizes); decimal ``KB``,
    ``MB``, ``GB``, ``TB``, ``PB`` (powers of 1000). A fractional value is rounded down to
    whole bytes. Raises ``TypeError`` for other types and ``ValueError`` for negative or
    unreadable sizes; ``name`` names the argument in the message.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(
            f"{name} must be an int number of bytes or a string such as '2 GiB', "
            f"got {type(size).__name__} {size!r}"
        )
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {size}")
        return size
    match = _SIZE_RE.match(size)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNIT_FACTORS:
        raise ValueError(
            f"{name} {size!r} is not a size; write a number with an optional unit, "
            "e.g. 1024, '512 B', '64 KiB', '512MB', '2 GiB' "
            "(units: B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB, KB, MB, GB, TB, PB)"
        )
    return int(Decimal(match.group(1)) * _UNIT_FACTORS[unit])


def check_count(value: Any, name: str, minimum: int) -> int:
    """``value`` if it is an int of at least ``minimum``; else a ``TypeError``/``ValueError``
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
