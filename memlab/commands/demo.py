"""``memlab demo``: the packaged example training script under the line profiler.

The same as ``memlab run -f train_step <memlab>/examples/train.py``: it prints ``train_step`` line by
line on the default device (on a machine without a GPU, the numbers a CUDA GPU would show), then what
the model itself takes (parameters, gradients, optimizer state). Without a GPU the numbers include
the cuBLAS workspaces of the GPU modelled (the table's first line says how many and their bytes);
``CUBLAS_WORKSPACE_CONFIG=:0:0`` in the environment turns them off, as it does in PyTorch.
"""

from __future__ import annotations

import argparse
import os

import torch

from memlab._arguments import COLUMN_OPTION, NO_DEFAULT_COLUMNS_OPTION, OUTPUT_OPTION, columns_shown
from memlab._devices import default_device, default_device_as, parse_device, require_usable
from memlab.commands._command import CommandError
from memlab.commands._footprint import ModelFootprint
from memlab.commands._program import MainProgram
from memlab.commands.run import profile_program

__all__ = ["EXAMPLE", "EXAMPLE_FUNCTION", "DemoCommand"]

#: The packaged example script and the function the demo profiles.
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train.py")
EXAMPLE_FUNCTION = "train_step"


class DemoCommand:
    """``memlab demo [--epochs N] [--device DEVICE] [-c COL]... [-D] [-o FILE]``."""

    help = "profile the packaged example training step, line by line, on the default device"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            f"Run memlab's example training script ({EXAMPLE}) and print the memory of each line of "
            f"its {EXAMPLE_FUNCTION}() function: the same as memlab run -f {EXAMPLE_FUNCTION} on it; then "
            "what the model itself takes (parameters, gradients, optimizer state). Without a GPU the "
            "numbers include the cuBLAS workspaces of the GPU modelled, as the first line says; "
            "CUBLAS_WORKSPACE_CONFIG=:0:0 in the environment turns them off, as in PyTorch."
        )
        parser.add_argument(
            "--epochs", type=_epochs, help="epochs the example trains for, at least 1 (default: its own)"
        )
        parser.add_argument(
            "--device",
            help="make this torch's default device while the example runs, and measure it: cpu, a CUDA "
            "device or another device this torch can use, not meta (default: the GPU if there is one, "
            "else torch's default device)",
        )
        parser.add_argument("-c", "--column", **COLUMN_OPTION)
        parser.add_argument("-D", "--no-default-columns", **NO_DEFAULT_COLUMNS_OPTION)
        parser.add_argument("-o", "--output", **OUTPUT_OPTION)

    def run(self, args: argparse.Namespace) -> int:
        try:
            columns = columns_shown(args.no_default_columns, args.column)
        except ValueError as error:
            raise CommandError(str(error)) from None
        if not os.path.isfile(EXAMPLE):
            raise CommandError(f"the packaged example {EXAMPLE} is missing; reinstall memlab")
        device = _device(args.device)
        program = MainProgram(EXAMPLE, [] if args.epochs is None else ["--epochs", str(args.epochs)])
        # Without --device, measure what memlab run measures by default (its target 0: the GPU,
        # or without one the default device set here), so that both say the same first line.
        target = None if args.device is None else device
        footprint = ModelFootprint()
        with default_device_as(device), footprint.watching():
            status = profile_program(program, [EXAMPLE_FUNCTION], columns, target, args.output)
        line = footprint.line()
        if line is not None:
            print(f"\n{line}")
        return status


def _epochs(text: str) -> int:
    """``--epochs`` checked: a whole number of at least 1 (the example refuses fewer)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def _device(text: str | None) -> torch.device:
    """``--device`` checked: a device this torch can use here, not ``meta`` (the example reads its
    loss with ``loss.item()``, which meta tensors do not have)."""
    if text is None:
        return torch.device("cuda") if torch.cuda.is_available() else default_device()
    try:
        device = parse_device(text, name="--device")
        if device.type != "meta":
            return require_usable(device, name="--device")
    except ValueError as error:
        raise CommandError(str(error)) from None
    raise CommandError("--device meta: the example reads its loss values, which meta tensors do not have")
