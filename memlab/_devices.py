"""The one reading of a device argument: ``"cuda:7"``, ``0``, ``"0"``, ``torch.device``, ``"meta"``.

Every memlab entry point that takes a device (``LineProfiler(target_gpu=...)``, ``set_target_gpu``,
``TensorTracker.memory_stats(device)``, ``MemReporter.report(device=...)``, ``Courtesy(device=...)``,
``-g``/``--device``/``-d`` of the command line and the magics) reads it here, so all of them accept
the same forms and fail with the same message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "VALID_FORMS",
    "DeviceLike",
    "cuda_device_exists",
    "default_device",
    "default_device_as",
    "parse_device",
    "require_usable",
    "resolve_device",
    "with_index",
]

DeviceLike = torch.device | str | int
#: The accepted forms, as error messages list them.
VALID_FORMS = "'cpu', 'meta', 'cuda', 'cuda:1', a CUDA index (0, 1, ...) or a torch.device"


def parse_device(device: DeviceLike, *, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device``, checked.

    An ``int`` (or a string of digits, as typed on a command line) is that CUDA device; a string
    or ``torch.device`` is read by ``torch.device``. A device without an index (``"cuda"``) keeps
    none: callers that need one use :func:`with_index`. Raises ``TypeError`` for other types and
    ``ValueError`` for a negative index or a string torch does not read; ``name`` names the
    argument in the message, which lists :data:`VALID_FORMS`.
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{name} must be {VALID_FORMS}; got {type(device).__name__} {device!r}")
    if isinstance(device, str) and device.strip().isdigit():
        device = int(device)
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{name} must be {VALID_FORMS}; got the negative index {device}")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name} {device!r} is not a device; valid: {VALID_FORMS}") from None


def default_device() -> torch.device:
    """torch's default device, ``torch.get_default_device()`` (which honours ``with
    torch.device(...)`` and ``torch.set_default_device``), also where torch 2.8's own raises: after
    ``torch.set_default_device(None)`` its thread-local context is ``None``, which 2.8's
    ``get_default_device`` reads ``.device`` of (``AttributeError``; from 2.9 on it means ``cpu``, as
    it does here)."""
    try:
        return torch.get_default_device()
    except AttributeError:
        if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", True) is not None:
            raise
        return torch.device("cpu")


@contextlib.contextmanager
def default_device_as(device: torch.device) -> Iterator[None]:
    """``torch.set_default_device(device)`` for the body (this thread), then the default device
    exactly as it was: where none had been set, none, rather than ``set_default_device(None)``,
    after which torch 2.8's ``get_default_device`` raises (:func:`default_device`) in the user's
    code too."""
    local = torch._GLOBAL_DEVICE_CONTEXT
    had = hasattr(local, "device_context")
    previous = getattr(local, "device_context", None)
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None if previous is None else previous.device)
        if not had:
            del local.device_context


def with_index(device: torch.device) -> torch.device:
    """``device`` with an index where torch's allocators key by one: ``cuda`` is ``cuda:0``;
    ``cpu`` and ``meta`` stay as they are."""
    if device.index is None and device.type not in ("cpu", "meta"):
        return torch.device(device.type, 0)
    return device


def resolve_device(device: DeviceLike | None, *, name: str = "device") -> torch.device:
    """The device statistics are keyed by: ``None`` is torch's default device
    (``torch.get_default_device()``, which honours ``with torch.device(...)``), anything else is
    :func:`parse_device` with an index (:func:`with_index`)."""
    if device is None:
        return with_index(default_device())
    return with_index(parse_device(device, name=name))


def cuda_device_exists(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device present on this machine. Never initialises CUDA on a
    machine without one (``torch.cuda.is_available`` and ``device_count`` do not create a context)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return (device.index or 0) < torch.cuda.device_count()


def require_usable(device: torch.device, *, name: str = "device") -> torch.device:
    """``device`` if this torch can allocate tensors on it here, else ``ValueError`` saying why
    (``cpu`` and ``meta`` always can; ``cuda:N`` when that GPU exists; ``mps``, ``xpu``... when this
    torch build and machine support them)."""
    if device.type in ("cpu", "meta"):
        return device
    if device.type == "cuda":
        if cuda_device_exists(device):
            return device
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        where = "this machine has no CUDA GPU" if not have else f"this machine has cuda:0 to cuda:{have - 1}"
        raise ValueError(f"{name} {device}: no such GPU ({where}); use 'cpu' or 'meta' to model one")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        text = str(error).strip()
        reason = text.splitlines()[0].split(". ")[0] if text else type(error).__name__
        raise ValueError(f"{name} {device}: this torch cannot use it here ({reason}); use 'cpu'") from None
    return device
