"""What a ``memlab`` subcommand is: a class with ``prepare_parser()`` and ``run()``."""

from __future__ import annotations

import argparse
from typing import Protocol

__all__ = ["Command", "CommandError"]


class CommandError(Exception):
    """A usage error found while a command runs: printed as one line, exit status 2."""


class Command(Protocol):
    """One subcommand: ``prepare_parser`` adds its arguments, ``run`` returns the exit status."""

    help: str

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...
