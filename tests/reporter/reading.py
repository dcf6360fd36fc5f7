"""Reading reports back in the reporter tests: a report's text, the rows of a device block, a tied model."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap

from torch import nn

from memlab import MemReporter

RULE = "-" * 79
_ROW = re.compile(r"^(?P<name>\S+)\s+(?P<size>\(.*?\)|\?)\s+(?P<mem>\S+)$")


def report_text(reporter: MemReporter, **kwargs) -> str:
    stream = io.StringIO()
    reporter.report(stream=stream, **kwargs)
    return stream.getvalue()


def rows(text: str, device: str = "cpu") -> list[tuple[str, str, str]]:
    """(name, size, used memory) of each row in the ``Storage on <device>`` block."""
    lines = text.splitlines()
    start = lines.index(f"Storage on {device}") + 1
    block = []
    for line in lines[start:]:
        if line.startswith("---"):
            break
        match = _ROW.match(line)
        assert match, line
        block.append((match["name"], match["size"], match["mem"]))
    return block


def named_rows(text: str, device: str = "cpu") -> list[tuple[str, str, str]]:
    """Rows of the block except anonymous tensors (other tests may leave some alive)."""
    return [
        row for row in rows(text, device) if not re.fullmatch(r"[A-Za-z]*(?:Tensor|Parameter)\d+", row[0])
    ]


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight


def fresh_report(script: str) -> list[str]:
    """The lines ``script`` prints when run in a fresh interpreter, where only its tensors live."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, check=True
    )
    return run.stdout.splitlines()
