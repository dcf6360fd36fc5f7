"""``torch.amp.GradScaler("cuda")`` in a data-free run on a machine without CUDA.

PyTorch without CUDA disables a ``GradScaler("cuda")`` when it is made (``torch/amp/grad_scaler.py``:
``GradScaler.__init__`` warns "CUDA is not available" and sets ``_enabled = False``), so ``scale``,
``unscale_`` and ``update`` do nothing and ``step`` only calls ``optimizer.step()``. On a GPU the
enabled scaler allocates, on the device of the first output it scales: its scale (float32) and
growth tracker (int32) at the first ``scale`` (``_lazy_init_scale_growth_tracker``), kept for its
life; the scaled output (``outputs * scale``); in ``unscale_`` (or ``step`` without it) the inverse
scale (``scale.double().reciprocal().float()``, a temporary) and a float32 found-inf flag per device
(``_unscale_grads_``: a copy made by ``_MultiDeviceReplicator.get``), kept until ``update()``, which
updates the scale in place (``torch._amp_update_scale_``). Each is a one-element tensor: one 512 B
block. :class:`CudaGradScalers` runs PyTorch's own enabled code on the run's data-free tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["CudaGradScalers"]

# The entry points a user calls; each reads ``_enabled`` first (grad_scaler.py).
_ENTRY_POINTS = ("scale", "unscale_", "step", "update", "is_enabled")


def _data_free(tensor: Any) -> bool:
    return isinstance(tensor, FakeTensor) or (isinstance(tensor, torch.Tensor) and tensor.is_meta)


class CudaGradScalers:
    """While entered, ``GradScaler("cuda")`` objects behave in a data-free run (``data_free=True``)
    as enabled ones do on a GPU (``count("grad_scaler")`` for each one modelled), and a real CPU run
    (``data_free=False``) names through ``caveat`` each one it used disabled.

    Data-free: a scaler made while entered is made as on a GPU (enabled unless ``enabled=False``).
    One made before, which PyTorch disabled when it was made (its ``enabled`` request is lost, and
    so are its settings), is modelled as an enabled ``GradScaler("cuda")`` with PyTorch's defaults,
    with a caveat; the user's object is left as it is (a twin made for the run takes its calls). The
    found-inf flags have no values here: ``step`` takes them as finite and runs ``optimizer.step()``,
    as on a GPU in a step without overflow (a skipped step would allocate less: no optimizer state
    on a first step). ``get_scale()`` and ``state_dict()`` read values, which a data-free run does not
    have (the estimate then runs on CPU copies). Process-wide while entered: ``GradScaler``'s methods
    are wrapped for every thread.
    """

    def __init__(self, data_free: bool, caveat: Callable[[str], None], count: Callable[[str], None]) -> None:
        self.data_free = data_free
        self._caveat = caveat
        self._count = count
        self._asked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._twins: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> CudaGradScalers:
        cls = torch.amp.GradScaler
        names = ("__init__", *_ENTRY_POINTS, "_maybe_opt_step") if self.data_free else ("__init__", "scale")
        self._originals = {name: cls.__dict__[name] for name in names}
        for name in names:
            if name == "__init__":
                setattr(cls, name, self._wrapped_init())
            elif name == "_maybe_opt_step":
                setattr(cls, name, _assume_finite(self._originals[name]))
            else:
                setattr(cls, name, self._wrapped_entry_point(name))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for name, function in self._originals.items():
            setattr(torch.amp.GradScaler, name, function)
        self._originals = {}
        self._twins.clear()

    # -- wrappers ---------------------------------------------------------------------------
    def _wrapped_init(self) -> Callable[..., None]:
        original = self._originals["__init__"]
        asked = self._asked
        data_free = self.data_free
        count = self._count

        def __init__(scaler: Any, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
            # GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
            enabled = kwargs.get("enabled", args[4] if len(args) > 4 else True)
            if device == "cuda" and data_free and not torch.cuda.is_available():
                _enabled_init(original, scaler, device, *args, **kwargs)
                if scaler._enabled:
                    count("grad_scaler")
            else:
                original(scaler, device, *args, **kwargs)
            asked[scaler] = bool(enabled)

        return __init__

    def _wrapped_entry_point(self, name: str) -> Callable[..., Any]:
        original = self._originals[name]
        resolve = self._resolve

        def entry_point(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            return original(resolve(scaler), *args, **kwargs)

        entry_point.__name__ = name
        return entry_point

    def _resolve(self, scaler: Any) -> Any:
        """The scaler that takes ``scaler``'s calls: itself, or in a data-free run the enabled twin
        of a ``GradScaler("cuda")`` made before, which PyTorch disabled for lack of CUDA."""
        if scaler._enabled or scaler._device != "cuda" or torch.cuda.is_available():
            return scaler
        asked = self._asked.get(scaler)
        if asked is False:
            return scaler
        if not self.data_free:
            self._caveat(
                "GradScaler('cuda') ran disabled: PyTorch without CUDA disables it, so this run neither "
                "scaled the loss nor allocated the scaler's tensors (its scale and growth tracker, 512 B "
                "each; a 512 B found-inf flag per optimizer until update(); the scaled loss); values "
                "matter here (data_free=False), so it was not modelled."
            )
            return scaler
        twin = self._twins.get(scaler)
        if twin is None:
            self._caveat(
                "a GradScaler('cuda') made before the run: PyTorch without CUDA disabled it when it was "
                "made, and whether enabled=True was asked is lost; modelled as an enabled "
                "GradScaler('cuda') with PyTorch's defaults (make it inside the estimated call to have "
                "it modelled as made)."
            )
            twin = torch.amp.GradScaler.__new__(torch.amp.GradScaler)
            _enabled_init(self._originals["__init__"], twin, "cuda")
            self._twins[scaler] = twin
            self._count("grad_scaler")
        return twin


def _assume_finite(original: Callable[..., Any]) -> Callable[..., Any]:
    """grad_scaler.py ``_maybe_opt_step`` reads the found-inf flags (``.item()``); a data-free run
    has no values: the step runs, as on a GPU in a step without overflow."""

    def _maybe_opt_step(
        scaler: Any, optimizer: Any, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        if any(_data_free(flag) for flag in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return original(scaler, optimizer, optimizer_state, *args, **kwargs)

    return _maybe_opt_step


def _enabled_init(init: Callable[..., None], scaler: Any, *args: Any, **kwargs: Any) -> None:
    """``GradScaler.__init__`` as on a machine with CUDA: PyTorch's own, with its CUDA check
    (``torch.cuda.amp.common.amp_definitely_not_available``) answering False for the call."""
    common = torch.cuda.amp.common
    check = common.amp_definitely_not_available
    common.amp_definitely_not_available = lambda: False
    try:
        init(scaler, *args, **kwargs)
    finally:
        common.amp_definitely_not_available = check
