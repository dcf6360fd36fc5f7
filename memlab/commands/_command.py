"""What a ``memlab`` subcommand is: a class with ``prepare_parser()`` and ``run()``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Protocol

__all__ = ["Command", "CommandError", "whole_number"]


class CommandError(Exception):
    """A usage error found while a command runs: printed as one line, exit status 2."""


class Command(Protocol):
    """One subcommand: ``prepare_parser`` adds its arguments, ``run`` returns the exit status."""

    help: str

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number of at least ``minimum``: a one-line usage error
    (``must be a whole number of at least 1, got 'x'``) otherwise."""

    def check(text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}, got {text!r}")
        return int(text)

    return check
