"""The ``memlab`` command (also ``python -m memlab``): a thin shell over the public API."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

import memlab
from memlab._units import format_size

__all__ = ["main"]

_DEMO_ROWS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")


def _demo(args: argparse.Namespace) -> int:
    import torch

    from memlab.sources.cuda import CudaSource, cuda_device_exists

    device = torch.device(args.device) if args.device else torch.get_default_device()
    if device.type == "cuda" and not cuda_device_exists(device):
        print(f"memlab demo: {device} is not available on this machine", file=sys.stderr)
        return 2
    if device.type == "cuda":
        source, name = CudaSource(device), "CudaSource (torch.cuda.memory_stats of the real GPU)"
        torch.cuda.reset_peak_memory_stats(device)
        context = contextlib.nullcontext()
    else:
        source = context = memlab.TensorTracker()
        name = "TensorTracker + CachingAllocatorModel (what a CUDA GPU would report)"
    with context, torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(args.steps):
            inputs, targets = torch.randn(64, 256), torch.randint(0, 10, (64,))
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
    stats = source.memory_stats(device)
    print(
        f"memlab demo: {args.steps} training step(s) of Linear(256, 512) -> ReLU -> Linear(512, 10), "
        f"batch 64, AdamW, on {device}"
    )
    print(f"source: {name}")
    print(f"{'statistic':<18}{'current':>10}{'peak':>10}")
    for row in _DEMO_ROWS:
        current, peak = stats[f"{row}.all.current"], stats[f"{row}.all.peak"]
        print(f"{row:<18}{format_size(current):>10}{format_size(peak):>10}")
    print(f"{'segments':<18}{stats['segment.all.current']:>10}{stats['segment.all.peak']:>10}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``memlab`` command."""
    parser = argparse.ArgumentParser(
        prog="memlab",
        description="Where does my PyTorch memory go, line by line, and will it fit?",
    )
    parser.add_argument("--version", action="version", version=f"memlab {memlab.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser("demo", help="measure a small training step on the default device")
    demo.add_argument("--device", help="device to run on (default: torch's default device)")
    demo.add_argument("--steps", type=int, default=1, help="training steps to run (default: 1)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``memlab`` command with ``argv`` (default: ``sys.argv[1:]``); return its exit code."""
    args = build_parser().parse_args(argv)
    return args.handler(args)
