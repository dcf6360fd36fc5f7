"""``memlab viz``: render a memory snapshot pickle as PyTorch's "Active Memory Timeline" (or its
"Allocator State History") in one HTML file, through ``torch.cuda._memory_viz``."""

from __future__ import annotations

import argparse
import os
import pickle
from typing import Any

from memlab.commands._command import CommandError

__all__ = ["VizCommand", "read_snapshot"]


def read_snapshot(path: str) -> dict[str, Any]:
    """The ``torch.cuda.memory._snapshot()`` dict pickled at ``path`` (``memlab run --snapshot``,
    :func:`memlab.dump_snapshot` or PyTorch's own). Raises :class:`CommandError` when there is no
    such file or it holds no memory snapshot."""
    try:
        with open(path, "rb") as file:
            data = pickle.load(file)
    except FileNotFoundError:
        raise CommandError(f"no such snapshot: {path!r}") from None
    except IsADirectoryError:
        raise CommandError(f"{path!r} is a folder, not a snapshot pickle") from None
    except Exception:  # anything unpickling can raise: the file is not a pickle we can read
        data = None
    if not isinstance(data, dict) or not {"segments", "device_traces"} <= data.keys():
        raise CommandError(
            f"{path!r} is not a memory snapshot pickle (write one with memlab run --snapshot FILE, "
            "memlab.dump_snapshot or torch.cuda.memory._dump_snapshot)"
        )
    return data


class VizCommand:
    """``memlab viz snapshot.pickle [-o out.html] [--segments]``."""

    help = "render a memory snapshot (memlab run --snapshot) as PyTorch's Active Memory Timeline, in HTML"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Write an HTML page of a memory snapshot pickle (memlab run --snapshot, %%mlrun --snapshot, "
            "memlab.dump_snapshot or torch.cuda.memory._dump_snapshot) through torch.cuda._memory_viz: "
            "the Active Memory Timeline (trace_plot), or with --segments the Allocator State History "
            "(segment_plot). The page embeds the snapshot but loads PyTorch's viewer script from the "
            "web (pytorch.org), so it needs an internet connection to display."
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
        output = args.output or os.path.splitext(args.snapshot)[0] + ".html"
        if os.path.splitext(output)[1].lower() not in (".html", ".htm"):
            raise CommandError(f"-o {output}: write to a file ending in .html, .htm")
        folder = os.path.dirname(output)
        if folder and not os.path.isdir(folder):
            raise CommandError(f"-o {output}: no such folder {folder!r}")
        data = read_snapshot(args.snapshot)
        from torch.cuda import _memory_viz

        html = _memory_viz.segment_plot(data) if args.segments else _memory_viz.trace_plot(data)
        with open(output, "w", encoding="utf-8") as file:
            file.write(html)
        return 0
