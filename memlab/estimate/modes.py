"""What the estimate's own dispatch modes share: no ``torch._disable_dynamo`` wrapper per op."""

from __future__ import annotations

__all__ = ["UnwrappedDispatch"]


class UnwrappedDispatch:
    """Mixed into a ``TorchDispatchMode`` subclass an estimate runs (before the mode class in the
    bases): PyTorch then leaves its ``__torch_dispatch__`` unwrapped (``TorchDispatchMode.
    __init_subclass__`` wraps it in ``torch._disable_dynamo`` unless ``_should_skip_dynamo()`` is
    False). Dynamo compiles no frame while a dispatch mode is on the stack
    (``torch/_dynamo/convert_frame.py``), and an estimate always runs under its fake mode and
    tracker, so the wrapper only costs a Python call per op and mode: 0.2 s of the 5.3 s that
    ``memlab estimate`` takes for a Llama-3-8B step (benchmarks/bench_estimate_command.py)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
