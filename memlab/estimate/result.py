"""What an estimate found: :class:`Estimate`, its numbers and its text and HTML renderings.

:func:`memlab.estimate.estimate.run_estimate` builds one from the tracker that counted a data-free
run; this module only reads that tracker (statistics, categories) and renders them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from memlab._gpus import GPU
from memlab._units import format_size, parse_size
from memlab.estimate.capped import completes_under
from memlab.history import categories
from memlab.sources.tracker import TensorTracker
from memlab.sources.workspace_note import ModelledWorkspaces, tracker_workspaces, with_note

if TYPE_CHECKING:
    import pandas as pd

    from memlab.sources.module_table import ModuleTable

__all__ = ["CANNOT_SEE", "HOW", "RERUN", "Estimate", "EstimateError"]


class EstimateError(ValueError):
    """The call cannot be estimated as given (the message says why and what to change)."""


HOW = {
    "fake": "fake tensors",
    "meta": "meta tensors",
    "cpu": "a real run on CPU copies",
}  # each method, said
#: The caveat of an estimate that ran its step twice (fake tensors, given up; then CPU copies).
RERUN = (
    "fn ran twice, first on fake tensors until it needed a value they do not have (forced_by), then "
    "for real on CPU copies (method 'cpu'): what it does besides computing on the objects an estimate "
    "copies (printing, logging, writing files, counting its calls) happened in both runs"
)
_AT = ("peak", "end")
CANNOT_SEE = (
    "cuDNN workspaces and temporaries inside one kernel, the CUDA context, NCCL buffers, memory "
    "allocated outside PyTorch's dispatcher, and device-specific kernel choices other than those "
    "listed in memlab.estimate.kernels.DIFFERENCES"
)


class Estimate:
    """The memory a call takes, from a data-free run (see :func:`estimate`).

    Bytes are those the CUDA caching allocator model reports for the run (``memory_stats`` keys:
    512 B blocks, 2 MiB / 20 MiB segments, caching), counting the tensors the arguments held
    before the call (parameters, gradients, optimizer state, inputs) from the start.

    ``peak_allocated``, ``peak_active``, ``peak_reserved``: the highest values during the call (bytes).
    ``stats``: the full ``torch.cuda.memory_stats()``-style dict at the end of the call (the
    result still alive). ``method``: ``"fake"`` (fake tensors), ``"meta"`` (``meta`` tensors) or
    ``"cpu"`` (a real run on CPU copies, when ``forced_by`` names the op fake tensors could not
    run). ``device``: whose kernels were mimicked. ``gpu``: the :class:`~memlab._gpus.GPU` whose
    allocator and cuBLAS workspaces were modelled. ``caveats``: what this run hit that the estimate
    does not model (one sentence each). ``substituted``: CUDA kernel substitutions made (name ->
    count). ``tracker``: the :class:`~memlab.sources.tracker.TensorTracker` that counted (its
    ``snapshot()`` is the run's memory snapshot, for ``memlab viz`` or ``plot_memory``).
    ``steps``: how many times the call ran in a row on the same copies (peaks are over all of
    them); ``peak_step``: the step (1-based) in which the peak reserved bytes were first reached.
    ``modules``: memory per module of the copied models (:meth:`by_module`; ``None`` when the call
    used no ``torch.nn.Module``).

    The cuBLAS/cuBLASLt workspaces the GPU's first matmul of each thread and stream allocates are
    counted (category ``workspace``; :mod:`memlab.sources.workspaces`), as a tracker counts them;
    :attr:`workspaces` and the first line of the text say how many and their bytes, and
    ``CUBLAS_WORKSPACE_CONFIG=:0:0`` in the environment (PyTorch's switch) turns them off.
    What an estimate cannot see: cuDNN workspaces (convolutions: named in ``caveats``) and
    temporaries inside one kernel, the CUDA context (hundreds of MiB per process on a GPU), NCCL
    buffers, memory
    allocated outside PyTorch's dispatcher, and device-specific kernel choices other than those
    listed in :data:`memlab.estimate.kernels.DIFFERENCES`; reserved bytes assume an allocator that
    starts empty (a real process may have cached blocks already).
    """

    def __init__(
        self,
        *,
        name: str,
        method: str,
        device: torch.device,
        tracker: TensorTracker,
        stats_device: torch.device,
        caveats: list[str],
        substituted: dict[str, int],
        forced_by: str | None,
        rerun: Callable[[Any, int | None], Estimate],
        function: Callable[..., Any],
        steps: int = 1,
        peak_step: int = 1,
        gpu: GPU | None = None,
        capacity: int | None = None,
    ) -> None:
        self.name = name
        self._capacity = capacity
        self.gpu = gpu
        self.steps = steps
        self.peak_step = peak_step
        self._function = function
        self.method = method
        self.device = device
        self.tracker = tracker
        self.stats = tracker.memory_stats(stats_device)
        self.caveats = caveats
        self.substituted = substituted
        self.forced_by = forced_by
        self._stats_device = stats_device
        self._rerun = rerun
        self._by_category = {
            "peak": tracker.by_category(stats_device, at="peak"),
            "end": tracker.by_category(stats_device, at="now"),
        }
        self.modules: ModuleTable | None = None
        if tracker.models:  # named after the device whose kernels ran, not the meta storages of fake tensors
            self.modules = dataclasses.replace(tracker.module_table(stats_device), device=device.type)

    @property
    def peak_allocated(self) -> int:
        """Highest bytes allocated to tensors during the call (``allocated_bytes.all.peak``)."""
        return self.stats["allocated_bytes.all.peak"]

    @property
    def peak_active(self) -> int:
        """Highest bytes in active blocks during the call (``active_bytes.all.peak``)."""
        return self.stats["active_bytes.all.peak"]

    @property
    def peak_reserved(self) -> int:
        """Highest bytes the modelled allocator held from the device (``reserved_bytes.all.peak``):
        what must fit in the GPU's memory."""
        return self.stats["reserved_bytes.all.peak"]

    def by_category(self, at: str = "peak") -> dict[str, int]:
        """Bytes per category (:data:`memlab.history.categories.CATEGORIES`: parameter, buffer,
        gradient, optimizer_state, activation, input, workspace, temporary, unknown) at the peak of allocated
        bytes (``at="peak"``; ``temporary`` holds blocks freed without another category) or at the
        end of the call (``at="end"``). Block sizes as the allocator model counts them."""
        if at not in _AT:
            raise ValueError(f"at must be one of {', '.join(map(repr, _AT))}; got {at!r}")
        return dict(self._by_category[at])

    def by_module(self) -> pd.DataFrame:
        """Memory per module of the estimated call, as :meth:`TensorTracker.by_module` gives it for
        a real run (the same columns, bytes as the allocator model counts blocks): paths in the
        first model the call uses (the root ``""``; a module passed as ``fn``, else the first among
        the arguments and the names ``fn`` uses), further models' after their class name; peaks
        over every step, ``parameter`` / ``gradient`` / ``optimizer_state`` at the end of the call.
        ``ValueError`` when the call used no ``torch.nn.Module``."""
        if self.modules is None:
            raise ValueError(
                f"by_module: the estimated call {self.name} used no torch.nn.Module (none among its "
                "arguments or the names it uses)"
            )
        return self.modules.to_dataframe()

    def fits(self, budget: int | str, headroom: int | str = 0) -> bool:
        """Whether the call completes under a CUDA caching allocator capped at ``budget`` minus
        ``headroom`` (bytes or sizes such as ``"16 GiB"``), as a GPU of that much memory (or a
        ``TensorTracker(capacity=...)`` run) would run it: the allocator's retry path included,
        which frees cached segments before it gives up, so a call can fit below its
        :attr:`peak_reserved` (that of an allocator that never had to free its cache). The same
        question :func:`memlab.max_batch_size`, :func:`memlab.autobatch` and the OOM remedies ask
        (:func:`memlab.estimate.capped.completes_under`). Where the peak reserved bytes are within
        the budget and the run never hit a cap, that is the answer; otherwise the call is estimated
        again under the cap (the cost of a second estimate)."""
        capacity = parse_size(budget, name="budget") - parse_size(headroom, name="headroom")
        if capacity < 0:
            return False
        return self.under(capacity) is not None

    def under(self, capacity: int) -> Estimate | None:
        """The estimate of the same call under a CUDA caching allocator capped at ``capacity`` bytes
        (retry path included), or ``None`` where the call does not complete there: this estimate
        itself where it never reached the cap, else a new run of the call (the question
        :meth:`fits` asks, :func:`memlab.estimate.capped.completes_under`)."""
        return completes_under(lambda cap: self._rerun(None, cap), capacity, known=self)

    def line_profile(self, *functions: Callable[..., Any], columns: Sequence[str] | None = None) -> Any:
        """A :class:`memlab.LineProfiler` of ``functions`` (default: the estimated function) over
        a new data-free run of the same call: the table ``LineProfiler`` gives for a real run
        (``print_stats()``, ``display()``, ``to_dataframe()``), computed without allocating tensor
        data. ``columns``: the statistics to record (default :data:`memlab.DEFAULT_COLUMNS`). The
        call runs again (on new copies), so its cost is that of a second estimate."""
        from memlab.line_profiler import DEFAULT_COLUMNS, LineProfiler

        if not functions:
            fn = self._function
            fn = type(fn).forward if isinstance(fn, torch.nn.Module) else getattr(fn, "func", fn)
            functions = (fn,)
        profiler = LineProfiler(
            *functions, target_gpu=self._stats_device, columns=DEFAULT_COLUMNS if columns is None else columns
        )
        self._rerun(profiler, self._capacity)
        return profiler

    def _rows(self) -> list[tuple[str, str, str]]:
        peak, end = self._by_category["peak"], self._by_category["end"]
        return [(name, format_size(peak[name]), format_size(end[name])) for name in categories.CATEGORIES]

    def _header(self) -> str:
        how = HOW[self.method]
        ran = "1 step" if self.steps == 1 else f"{self.steps} steps, peak reserved in step {self.peak_step}"
        gpu = "a GPU" if self.gpu is None else self.gpu.name
        if self.gpu is not None and self.gpu.name != self.gpu.sm:
            gpu += f" ({self.gpu.sm})"
        header = (
            f"memlab estimate of {self.name} on {self.device.type} ({how}; {gpu} modelled: CUDA caching "
            f"allocator, cuBLAS workspaces; {ran})"
        )
        return with_note(header, self.workspaces)

    @property
    def workspaces(self) -> ModelledWorkspaces | None:
        """The cuBLAS/cuBLASLt workspaces the estimate's numbers include (their count, bytes and
        GPU), which the first line of its text names; ``None`` where none was modelled (no matmul,
        or ``CUBLAS_WORKSPACE_CONFIG=:0:0`` in the environment, PyTorch's switch that makes them 0
        bytes)."""
        return tracker_workspaces(self.tracker, self._stats_device)

    def __repr__(self) -> str:
        stats = self.stats
        lines = [
            self._header(),
            f"peak allocated {format_size(self.peak_allocated)}, active {format_size(self.peak_active)}, "
            f"reserved {format_size(self.peak_reserved)}",
            f"at the end: allocated {format_size(stats['allocated_bytes.all.current'])}, "
            f"reserved {format_size(stats['reserved_bytes.all.current'])}",
            f"{'category':<16}{'at peak':>10}{'at end':>10}",
        ]
        lines += [f"{name:<16}{peak:>10}{end:>10}" for name, peak, end in self._rows()]
        return "\n".join(lines + self._notes())

    def _notes(self) -> list[str]:
        notes = []
        if self.substituted:
            done = ", ".join(f"{name} x{count}" for name, count in self.substituted.items())
            notes.append(f"CUDA's kernels substituted: {done}")
        if self.forced_by:
            notes.append(f"ran on CPU copies because fake tensors cannot run {self.forced_by}")
        notes += [f"caveat: {caveat}" for caveat in self.caveats]
        return [*notes, f"not seen: {CANNOT_SEE}"]

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><td>{name}</td><td>{peak}</td><td>{end}</td></tr>" for name, peak, end in self._rows()
        )
        return (
            f"<p>{html.escape(self._header())}</p>"
            f"<p>peak allocated <b>{format_size(self.peak_allocated)}</b>, active "
            f"<b>{format_size(self.peak_active)}</b>, reserved <b>{format_size(self.peak_reserved)}</b></p>"
            f"<table><tr><th>category</th><th>at peak</th><th>at end</th></tr>{rows}</table>"
            + "".join(f"<p>{html.escape(note)}</p>" for note in self._notes())
        )
