"""Benchmark: ``MemReporter.report()`` with many live tensors, memlab against pytorch_memlab.

Both reporters walk ``gc`` and print a report of the same live tensors in the same process; the
output goes to an in-memory stream. pytorch_memlab is optional (``pip install --no-deps
pytorch_memlab calmsize``); without it only memlab's time is printed.

    python benchmarks/bench_reporter.py [--tensors 100000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from memlab import MemReporter


def make_tensors(count: int) -> list[torch.Tensor]:
    """``count`` live CPU tensors: 9 in 10 own a small storage, 1 in 10 is a view of another."""
    tensors: list[torch.Tensor] = []
    for i in range(count):
        if i % 10 == 9:
            tensors.append(tensors[i - 1][: 1 + i % 3])
        else:
            tensors.append(torch.empty(1 + i % 7, 1 + i % 5))
    return tensors


def time_once(report: Callable[[], object]) -> float:
    """Seconds for one call of ``report`` (stdout captured), after a full collection."""
    gc.collect()
    sink = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        report()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tensors", type=int, default=100_000, help="live tensors to report (default 100000)"
    )
    parser.add_argument("--repeat", type=int, default=7, help="timed report() calls per reporter (default 7)")
    args = parser.parse_args()

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
    tensors = make_tensors(args.tensors)
    setup = f"{len(tensors)} live tensors + a 2-layer model; {args.repeat} reports each"
    print(f"torch {torch.__version__}; {setup}")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # pytorch_memlab prints at import
            from pytorch_memlab import MemReporter as OriginalMemReporter
    except ImportError:
        OriginalMemReporter = None
        print("pytorch_memlab not installed (pip install --no-deps pytorch_memlab calmsize): memlab only")

    ours = MemReporter(model)
    theirs = None if OriginalMemReporter is None else OriginalMemReporter(model)
    times: dict[str, list[float]] = {"memlab": [], "pytorch_memlab": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pytorch_memlab's isinstance() walk trips deprecation warnings
        for _ in range(args.repeat):  # alternate, so both see the same machine load
            times["memlab"].append(time_once(lambda: ours.report(stream=io.StringIO())))
            if theirs is not None:
                times["pytorch_memlab"].append(time_once(theirs.report))
    for name, values in times.items():
        if values:
            print(f"{name:<15} report(): best {min(values):.3f} s, median {statistics.median(values):.3f} s")
    if theirs is not None:
        best = min(times["pytorch_memlab"]) / min(times["memlab"])
        median = statistics.median(times["pytorch_memlab"]) / statistics.median(times["memlab"])
        print(f"speed-up: {best:.2f}x best-of-{args.repeat}, {median:.2f}x median (target: at least 2x)")
    del tensors


if __name__ == "__main__":
    main()
