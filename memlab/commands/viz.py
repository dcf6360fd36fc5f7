"""``memlab viz``: a memory snapshot pickle as one HTML file. By default memlab draws it
(:func:`memlab.history.page.memory_page`: the timeline as inline SVG and the largest allocations
at the peak with their stacks; no network); ``--viewer pytorch`` writes PyTorch's "Active Memory
Timeline" (or "Allocator State History") through ``torch.cuda._memory_viz``, which loads its
script from the web."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from memlab._outputs import check_output_path, write_text
from memlab.commands._command import CommandError, whole_number
from memlab.history.export import read_snapshot as _read_snapshot
from memlab.history.page import BANDS, STACKS, memory_page

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
    """``memlab viz snapshot.pickle [-o out.html] [--viewer memlab|pytorch] [--stack category|largest]
    [--points N] [--top N] [--device N] [--segments]``."""

    help = "render a memory snapshot (memlab run --snapshot) as one HTML page that opens offline"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Write an HTML page of a memory snapshot pickle (memlab run --snapshot, %%mlrun --snapshot, "
            "memlab.dump_snapshot or torch.cuda.memory._dump_snapshot). By default memlab draws it: "
            "allocated bytes over allocator events, stacked by category (or the largest allocations), "
            "reserved bytes, the peak, and the largest allocations alive at the peak with their stacks, "
            "in one self-contained file that references nothing outside itself (it opens offline, on "
            "a cluster node). With --viewer pytorch it writes PyTorch's own page through "
            "torch.cuda._memory_viz: the Active Memory Timeline (trace_plot), or with --segments the "
            "Allocator State History (segment_plot; --segments alone means --viewer pytorch). That page "
            "embeds the snapshot but loads PyTorch's viewer script (MemoryViz.js) from the web, from "
            "cdn.jsdelivr.net (a mirror of PyTorch's GitHub repository), so it needs an internet "
            "connection to display."
        )
        parser.add_argument("snapshot", help="the snapshot pickle to render")
        parser.add_argument(
            "-o",
            "--output",
            metavar="FILE",
            help="the HTML file to write (default: the snapshot's name, .html)",
        )
        parser.add_argument(
            "--viewer",
            choices=("memlab", "pytorch"),
            help="memlab: drawn by memlab, offline (the default); pytorch: PyTorch's viewer, which needs "
            "network to display (the default with --segments)",
        )
        parser.add_argument(
            "--stack",
            choices=STACKS,
            default="category",
            help=f"stack allocated bytes by category (default) or show the {BANDS} largest allocations "
            "each as a band over the rest (memlab viewer)",
        )
        parser.add_argument(
            "--points",
            type=whole_number(16),
            default=2000,
            metavar="N",
            help="draw at most N events, keeping every run's peaks (default 2000; memlab viewer)",
        )
        parser.add_argument(
            "--top",
            type=whole_number(1),
            default=20,
            metavar="N",
            help="list the N largest allocations alive at the peak (default 20; memlab viewer)",
        )
        parser.add_argument(
            "--device",
            type=whole_number(0),
            metavar="N",
            help="the device whose trace to draw, when the snapshot has several (memlab viewer)",
        )
        parser.add_argument(
            "--segments",
            action="store_true",
            help="render PyTorch's Allocator State History (segments and blocks over time) with PyTorch's "
            "viewer, which needs network to display",
        )

    def run(self, args: argparse.Namespace) -> int:
        output, name = _output(args.snapshot, args.output)
        viewer = args.viewer or ("pytorch" if args.segments else "memlab")
        if args.segments and viewer != "pytorch":
            raise CommandError(
                "--segments draws PyTorch's Allocator State History, which only --viewer pytorch draws "
                "(its page loads PyTorch's viewer from the web); memlab's page draws the timeline"
            )
        try:
            check_output_path(output, name, (".html", ".htm"))
        except ValueError as error:
            raise CommandError(str(error) + ("" if args.output is not None else _CHOOSE)) from None
        if _same_file(output, args.snapshot):
            raise CommandError(f"{name} {output} is the snapshot itself: name another file with -o FILE")
        data = read_snapshot(args.snapshot)
        if viewer == "pytorch":
            from torch.cuda import _memory_viz

            html = _memory_viz.segment_plot(data) if args.segments else _memory_viz.trace_plot(data)
        else:
            try:
                html = memory_page(
                    data,
                    device=args.device,
                    stack=args.stack,
                    points=args.points,
                    top=args.top,
                    title=os.path.basename(args.snapshot),
                )
            except ValueError as error:
                hint = "; its segments alone: --viewer pytorch --segments" if data["segments"] else ""
                raise CommandError(f"snapshot {args.snapshot}: {error}{hint}") from None
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
