"""The ``memlab`` command (also ``python -m memlab``): a thin shell over the subcommands in
:mod:`memlab.commands`."""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from typing import NoReturn

import memlab
from memlab.commands import COMMANDS, CommandError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``memlab`` command, one subparser per command."""
    parser = _Parser(
        prog="memlab",
        description="Where does my PyTorch memory go, line by line, and will it fit?",
    )
    parser.add_argument("--version", action="version", version=f"memlab {memlab.__version__}")
    # Not required=True: argparse would then report a missing COMMAND before an unknown option
    # (memlab --bogus); main() asks for the command itself once the options were read.
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command_class in COMMANDS.items():
        command = command_class()
        subparser = commands.add_parser(name, help=command.help, description=command.help)
        command.prepare_parser(subparser)
        subparser.set_defaults(handler=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``memlab`` command with ``argv`` (default: ``sys.argv[1:]``); return its exit status.

    A usage error (a missing script, a bad column, a function that never appears) is one line on
    stderr and status 2; otherwise the status is the command's (``memlab run``: the script's).

    When it returns, the program it ran in this process (``memlab run``, ``memlab demo``) is let go
    as at the end of a process: what its namespace's reference cycles (a function and the module
    globals it reads) kept alive, its models and tensors, is collected (``gc.collect()``) rather
    than left for a later profile to count as tensors that existed before it.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"name a COMMAND: {', '.join(COMMANDS)}")
    try:
        return int(args.handler.run(args))
    except CommandError as error:
        print(f"memlab {args.command}: error: {error}", file=sys.stderr)
        return 2
    finally:
        gc.collect()
