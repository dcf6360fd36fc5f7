"""The ``memlab`` subcommands, one module each, in the style of memray's ``commands`` package:
a class with ``help``, ``prepare_parser(parser)`` and ``run(args) -> exit status``."""

from __future__ import annotations

from memlab.commands._command import Command, CommandError
from memlab.commands.demo import DemoCommand
from memlab.commands.estimate import EstimateCommand, PlanCommand
from memlab.commands.run import RunCommand
from memlab.commands.viz import VizCommand

__all__ = ["COMMANDS", "Command", "CommandError"]

#: Subcommand name -> command class, in the order ``memlab --help`` lists them.
COMMANDS: dict[str, type[Command]] = {
    "run": RunCommand,
    "estimate": EstimateCommand,
    "plan": PlanCommand,
    "viz": VizCommand,
    "demo": DemoCommand,
}
