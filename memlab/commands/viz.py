"""``memlab viz``: render a memory snapshot pickle as PyTorch's "Active Memory Timeline" (or its
"Allocator State History") in one HTML file, through ``torch.cuda._memory_viz``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from memlab._outputs import check_output_path, write_text
from memlab.commands._command import CommandError
from memlab.history.export import read_snapshot as _read_snapshot

__all__ = ["VizCommand", "read_snapshot"]


def read_snapshot(path: str) -> dict[str, Any]:
    """The ``torch.cuda.memory._snapshot()`` dict pickled at ``path`` (``memlab run --snapshot``,
    :func:`memlab.dump_snapshot` or PyTorch's own; see :func:`memlab.history.export.read_snapshot`).
    Raises :class:`CommandError` when there is no such file or it holds no memory snapshot."""
    try:
        return _read_snapshot(path, name="snapshot")
    except (OSError, ValueError) as error:
        raise CommandError(str(error)) from None


class VizCommand:
    """``memlab viz snapshot.pickle [-o out.html] [--segments]``."""

    help = "render a memory snapshot (memlab run --snapshot) as PyTorch's Active Memory Timeline, in HTML"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Write an HTML page of a memory snapshot pickle (memlab run --snapshot, %%mlrun --snapshot, "
            "memlab.dump_snapshot or torch.cuda.memory._dump_snapshot) through torch.cuda._memory_viz: "
            "the Active Memory Timeline (trace_plot), or with --segments the Allocator State History "
            "(segment_plot). The page embeds the snapshot but loads PyTorch's viewer script "
            "(MemoryViz.js) from the web, from cdn.jsdelivr.net (a mirror of PyTorch's GitHub "
            "repository), so it needs an internet connection to display."
        )
        parser.add_argument("snapshot", help="the snapshot pickle to render")
        parser.add_argument(
            "-o",
            "--output",
            metavar="FILE",
            help="the HTML file to write (default: the snapshot's name, .html)",
        )
        parser.add_argument(
            "--segments",
            action="store_true",
            help="render the Allocator State History (segments and blocks over time) instead",
        )

    def run(self, args: argparse.Namespace) -> int:
        output, name = _output(args.snapshot, args.output)
        try:
            check_output_path(output, name, (".html", ".htm"))
        except ValueError as error:
            raise CommandError(str(error) + ("" if args.output is not None else _CHOOSE)) from None
        if _same_file(output, args.snapshot):
            raise CommandError(f"{name} {output} is the snapshot itself: name another file with -o FILE")
        data = read_snapshot(args.snapshot)
        from torch.cuda import _memory_viz

        html = _memory_viz.segment_plot(data) if args.segments else _memory_viz.trace_plot(data)
        try:
            write_text(output, html)
        except OSError as error:  # checked before, so the disk filled up or the folder went away
            print(f"memlab viz: could not write {name} {output}: {error}", file=sys.stderr)
            return 1
        return 0


#: Added to an error about the default output, which the user did not name.
_CHOOSE = " (the snapshot's name with .html; choose another with -o FILE)"


def _same_file(first: str, second: str) -> bool:
    """Whether both paths name one existing file (through links and ``..``)."""
    try:
        return os.path.samefile(first, second)
    except OSError:  # either is missing
        return False


def _output(snapshot: str, output: str | None) -> tuple[str, str]:
    """The page to write and how messages name it: ``-o FILE`` as given, else the snapshot's
    path with ``.html`` for its extension, named ``the default output``."""
    if output is not None:
        return output, "-o"
    return os.path.splitext(snapshot)[0] + ".html", "default output"
