"""The installed torch's version, the range memlab supports, and the check at ``import memlab``.

memlab reads PyTorch's private machinery (fake tensors, dispatch modes, the allocator's rules, FSDP2's
internals), and PyTorch changes those between releases. Every table that follows one PyTorch release
(autocast op lists, SDPA backend rules, cuBLAS workspace defaults, optimizer defaults) is keyed with
:func:`torch_at_least` and names the release its entries come from, so one memlab serves every
supported torch with that torch's numbers.

The version is read from the installed distribution's metadata (``importlib.metadata``), which costs
no ``import torch``: ``import memlab`` stays free of torch (the pytest plugin loads memlab in every
pytest run).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import warnings

__all__ = [
    "NEWEST_TESTED",
    "OLDEST_SUPPORTED",
    "TESTED",
    "UnsupportedTorchError",
    "check_supported",
    "parse_version",
    "torch_at_least",
    "torch_version",
]

#: The oldest torch memlab runs on: the first with everything memlab's estimates need from
#: PyTorch's fake tensors and dispatch (``torch.get_default_device``, ``tree_leaves`` in
#: ``torch.utils._pytree``, ``unset_fake_temporarily``, FSDP2's ``fully_shard`` in
#: ``torch.distributed.fsdp``).
OLDEST_SUPPORTED = (2, 8)
#: The newest (major, minor) the test suite runs on in CI; a newer torch warns once at import.
NEWEST_TESTED = (2, 14)
#: The releases CI runs the whole test suite on (``.ci/run``).
TESTED = ("2.8.0", "2.11.0", "2.13.0", "2.14.1")

_LEADING = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


class UnsupportedTorchError(ImportError):
    """The installed torch is older than memlab supports (or none is installed)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a torch version string: ``"2.13.0+cpu"`` and ``"2.12.0a0+git1234"``
    read as their release numbers. ``ValueError`` for a string that does not start with one."""
    match = _LEADING.match(text)
    if match is None:
        raise ValueError(f"not a torch version: {text!r}; valid: a release such as '2.13.0' or '2.13.0+cpu'")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _installed() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def torch_version() -> tuple[int, int, int]:
    """The installed torch's (major, minor, patch), from its distribution metadata; ``torch.__version__``
    where torch is importable without metadata (a source checkout on ``sys.path``). Read once per
    process (reading the metadata scans ``sys.path``: about 2 ms), since the tables that ask
    (:func:`torch_at_least`) are consulted per op."""
    text = _installed()
    if text is None:
        import torch

        text = torch.__version__
    return parse_version(text)


def torch_at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed torch is at least ``major.minor.patch``: the key of every table that
    follows one PyTorch release."""
    return torch_version() >= (major, minor, patch)


def check_supported() -> None:
    """Raise :class:`UnsupportedTorchError` (one line: what is installed, what is supported, how to
    get it) for a torch older than :data:`OLDEST_SUPPORTED` or none at all; warn once for one newer
    than :data:`NEWEST_TESTED`. Costs no ``import torch``."""
    text = _installed()
    if text is None:
        try:
            import torch
        except ImportError:
            raise UnsupportedTorchError(_message("no torch is installed")) from None
        text = torch.__version__
    version = parse_version(text)
    if version[:2] < OLDEST_SUPPORTED:
        raise UnsupportedTorchError(_message(f"torch {text} is installed"))
    if version[:2] > NEWEST_TESTED:
        newest = ".".join(map(str, NEWEST_TESTED))
        warnings.warn(
            f"memlab is tested with torch {', '.join(TESTED)}; torch {text} is newer than {newest}: "
            "numbers that follow PyTorch's internals (autocast lists, SDPA backends, workspaces) "
            "are those of the newest tested release",
            UserWarning,
            stacklevel=3,
        )


def _message(installed: str) -> str:
    oldest = ".".join(map(str, OLDEST_SUPPORTED))
    return (
        f"memlab needs torch {oldest} or newer (tested: {', '.join(TESTED)}), but {installed}; "
        f"install a supported one first, e.g. pip install 'torch>={oldest}'"
    )
