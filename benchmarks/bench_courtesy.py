"""What Courtesy's safety costs: the CRC-32 of a parked file, the guard on parked tensors, the search
for views at restore.

* ``park`` / ``restore``: ``Courtesy(device="cpu", offload=<dir>)`` parking and restoring one tensor
  of ``--mib`` MiB (default 256), and ``crc32`` alone over as many bytes (it runs once at park over
  the bytes written and once at restore over the bytes read);
* ``view of a parked tensor``: ``w[0]`` on a parked tensor (its guard runs the op again on ``meta``
  tensors to learn where the view sits) against ``w[0]`` on a plain one;
* ``restore sweep``: the ``gc`` walk restore makes to find views taken meanwhile, with ``--tensors``
  other live CPU tensors in the process.

Run: ``PYTHONPATH=. python benchmarks/bench_courtesy.py [--dir DIR]``. Times are wall seconds, best
of ``--runs`` (the disk is part of the park and restore times: use a local disk, ``/tmp`` by default).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import timeit
import zlib
from collections.abc import Callable

import torch

from memlab import Courtesy
from memlab._parked import tensors_on


def best(runs: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def crc_time(mib: int, runs: int) -> float:
    """Seconds ``zlib.crc32`` takes over ``mib`` MiB (of a tensor Courtesy will not see: NumPy
    shares its storage once ``.numpy()`` has handed it out)."""
    raw = memoryview(torch.randn(mib * 2**20 // 4).numpy()).cast("B")
    return best(runs, lambda: zlib.crc32(raw))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    crc = crc_time(args.mib, args.runs)
    data = torch.randn(args.mib * 2**20 // 4)  # parked below
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        courtesy = Courtesy(device="cpu", offload=folder)
        parks, restores = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            courtesy.yield_memory()
            parks.append(time.perf_counter() - start)
            start = time.perf_counter()
            courtesy.restore()
            restores.append(time.perf_counter() - start)
    park, restore = min(parks), min(restores)
    print(f"{args.mib} MiB ({data.numel() * 4} B): park {park:.3f} s, restore {restore:.3f} s")
    print(
        f"crc32 of {args.mib} MiB: {crc:.3f} s = {crc / park:.1%} of a park, {crc / restore:.1%} of a restore"
    )

    plain = torch.zeros(64, 64)
    loop = 2000
    plain_us = min(timeit.repeat(lambda: plain[0], number=loop, repeat=args.runs)) / loop * 1e6
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        parked = torch.zeros(64, 64)
        with Courtesy(device="cpu", offload=folder):
            parked_us = min(timeit.repeat(lambda: parked[0], number=loop, repeat=args.runs)) / loop * 1e6
    print(f"view of a parked tensor: {parked_us:.1f} us (of a plain one: {plain_us:.1f} us)")

    others = [torch.zeros(1) for _ in range(args.tensors)]
    sweep = best(args.runs, lambda: tensors_on({0}))
    print(f"restore sweep with {len(others)} other live tensors: {sweep * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
