"""README.md is true as written: its code blocks run as shown, pasted as a new user would.

- a ```` ```python ```` block runs as a script in a fresh interpreter; a ```` ```text ```` block right
  after it is exactly what it prints;
- consecutive ```` ```ipython ```` blocks are the cells of one IPython session;
- each line of a ```` ```bash ```` block is a command run in a directory holding the example
  (``memlab/examples/train.py``); of an install chain (``python3 -m venv ... && X``) the test runs
  ``X``: installing is what ``.ci/run`` does with the test command, which is not run here again;
- a ```` ```console ```` block is a terminal session: each ``$ `` line is a command run in a directory
  holding the repository's ``memlab/`` and ``tests/`` (so ``tests/data/configs/...`` resolves), and the
  lines after it, up to the next ``$ ``, are exactly what it prints (stdout, then stderr); it exits 0,
  or 2 where what it prints is a one-line ``error:``; a ```` ```shellsession ```` block (rendered alike)
  is an illustration with elided output or timings, and is not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
TEST_COMMAND = "<!-- test-command -->"


def blocks() -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of every fenced block, in order; the test command's is left out."""
    text = README.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip()
        if before.endswith(TEST_COMMAND):
            continue
        found.append((match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1))
    return found


def python_blocks() -> list[tuple[str, str | None, int]]:
    """``(code, expected output or None, line)`` of each python block."""
    found, listed = [], blocks()
    for i, (language, code, line) in enumerate(listed):
        if language == "python":
            following = listed[i + 1] if i + 1 < len(listed) else None
            expected = following[1] if following is not None and following[0] == "text" else None
            found.append((code, expected, line))
    return found


def command_blocks() -> list[tuple[list[str], int]]:
    """The commands of each bash block, in order (a block's commands share a directory)."""
    found = []
    for language, code, line in blocks():
        if language != "bash":
            continue
        commands = []
        for text in code.splitlines():
            command = text.split(" #", 1)[0].strip()
            if command.startswith("python3 -m venv"):
                command = command.rsplit(" && ", 1)[1]
            if command:
                commands.append(command)
        found.append((commands, line))
    return found


def console_sessions() -> list[tuple[str, str, int]]:
    """``(command, expected output, line)`` of every ``$ `` line of the console blocks."""
    found = []
    for language, code, line in blocks():
        if language != "console":
            continue
        for chunk in re.split(r"^\$ ", code, flags=re.MULTILINE)[1:]:
            command, _, output = chunk.partition("\n")
            found.append((command, output, line))
    return found


def run(command: list[str] | str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in ``cwd`` with the test's interpreter first on PATH (its ``memlab``)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        command, shell=isinstance(command, str), cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_readme_has_blocks_of_every_kind():
    languages = {language for language, _, _ in blocks()}
    assert {"python", "text", "ipython", "bash", "console"} <= languages
    assert len(python_blocks()) >= 4 and sum(len(commands) for commands, _ in command_blocks()) >= 4


@pytest.mark.parametrize(("code", "expected", "line"), python_blocks(), ids=lambda v: str(v)[:0])
def test_python_block_runs_and_prints_what_the_readme_shows(code, expected, line, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    result = run([sys.executable, str(script)], tmp_path)
    assert result.returncode == 0, f"README.md line {line}:\n{result.stderr}"
    if expected is not None:
        assert result.stdout == expected, f"README.md line {line}"


def test_ipython_blocks_run_as_cells_of_one_session(tmp_path):
    cells = [code for language, code, _ in blocks() if language == "ipython"]
    driver = (
        "import sys\n"
        "from IPython.testing.globalipapp import start_ipython\n"
        "shell = start_ipython()\n"
        f"for cell in {cells!r}:\n"
        "    shell.run_cell(cell).raise_error()\n"
    )
    result = run([sys.executable, "-c", driver], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "## work" in result.stdout


@pytest.mark.parametrize(("commands", "line"), command_blocks(), ids=lambda v: str(v)[:0])
def test_commands_run_as_shown(commands, line, tmp_path):
    (tmp_path / "memlab").symlink_to(ROOT / "memlab", target_is_directory=True)
    for command in commands:
        result = run(command, tmp_path)
        assert result.returncode == 0, f"README.md line {line}: {command}\n{result.stderr}"
        if command.startswith(("memlab run", "memlab demo")):
            source = r"^modelled.*: CUDA caching allocator replayed from cpu tensors"
            assert re.search(source, result.stdout, re.M), command
            assert "\n## train_step" in result.stdout, command


@pytest.mark.parametrize(("command", "expected", "line"), console_sessions(), ids=lambda v: str(v)[:0])
def test_console_sessions_print_what_the_readme_shows(command, expected, line, tmp_path):
    for name in ("memlab", "tests"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    result = run(command, tmp_path)
    printed = result.stdout + result.stderr
    assert printed == expected, f"README.md line {line}: {command}"
    assert result.returncode == (2 if ": error: " in printed else 0), f"README.md line {line}: {command}"
