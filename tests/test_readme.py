"""README.md is true as written: its code blocks run as shown, pasted as a new user would.

Every fenced block is one of these, and a block that is none of them fails
``test_every_block_is_run_or_marked_not_run``:

- a ```` ```python ```` block runs as a script in a fresh interpreter; a ```` ```text ```` block right
  after it is exactly what it prints, and without one it prints nothing;
- a ```` ```python ```` block whose first line is ``# NAME.py`` is that file, written into the
  directory of every ```` ```console ```` block, one of which must run it;
- consecutive ```` ```ipython ```` blocks are the cells of one IPython session;
- each line of a ```` ```bash ```` block is a command run in a directory holding the example
  (``memlab/examples/train.py``); of an install chain (``python3 -m venv ... && X``) the test runs
  ``X``: installing is what ``.ci/run`` does with the test command, which is not run here again;
- a ```` ```console ```` block is a terminal session, its commands run in order in one directory
  holding the repository's ``memlab/`` and ``tests/`` (so ``tests/data/configs/...`` resolves) and the
  README's files: each ``$ `` line is a command (with the lines of its here-document, ``<<'EOF'``), and
  the lines after it, up to the next ``$ ``, are exactly what it prints (stdout and stderr as a terminal
  shows them, in the order written; the one thing not compared is pytest's run time, ``in 6.02s``);
  it exits 0, or 2 where what it prints is a one-line ``error:`` (a command that fails otherwise
  shows its status: ``; echo "exit $?"``);
- a block right after a line ``*Not run by the tests: REASON.*`` is not run, and the set of those
  blocks is exactly ``NOT_RUN`` below, so that a new example cannot go unchecked unnoticed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memlab._torch_version import torch_at_least

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
TEST_COMMAND = "<!-- test-command -->"
NOT_RUN_MARK = re.compile(r"^\*Not run by the tests: (.+)\.\*$")
FILE_NAME = re.compile(r"^# (\w+\.py)$")
RUN_TIME = re.compile(r" in \d+\.\d+s\b")
# What torch's own C++ prints on stdout on some releases and the README does not show: torch 2.8's
# gloo reports each rank's connections ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number
# of connected peer ranks is : 1"), written in pieces, so that the lines of two worker processes
# interleave (gloo/transport/tcp/context.cc).
GLOO_PIECES = (
    "[Gloo] Rank ",
    " is connected to ",
    " peer ranks. ",
    "Expected number of connected peer ranks is : ",
)


def without_torchs_own_output(printed: str) -> str:
    """``printed`` without gloo's connection reports (``GLOO_PIECES``): their words, then the ranks'
    numbers they leave before the first line of the program's own output (gloo connects when the
    process group starts, before anything the README's examples print)."""
    if GLOO_PIECES[0] not in printed:
        return printed
    for piece in GLOO_PIECES:
        printed = printed.replace(piece, "")
    return re.sub(r"\A[\d\s]*(?=\S)", "", printed)


# Lines the README shows (torch 2.13's output) that the installed torch prints otherwise, each as the
# README says under the example: torch 2.8's FSDP2 runs its reduce-scatter path at world size 1,
# where later releases copy the gradients.
RELEASE_LINES = (
    {
        "1 GPUs: 360.1 MiB per GPU at batch 512; 3072 fit in 512 MiB\n": (
            "1 GPUs: 368.1 MiB per GPU at batch 512; 2816 fit in 512 MiB\n"
        )
    }
    if not torch_at_least(2, 9)
    else {}
)


def as_this_torch_prints(expected: str) -> str:
    """``expected`` (README output) with the lines this torch prints otherwise (RELEASE_LINES)."""
    for shown, printed in RELEASE_LINES.items():
        expected = expected.replace(shown, printed)
    return expected


# The first line of each block the README marks as not run (what the tests cannot do is said there).
NOT_RUN = {
    "# loop.py",  # loops until it is killed
    '$ memlab run -o out.txt loop.py; echo "exit $?"     # and, from another shell: kill -TERM <its pid>',
    "256 MiB (268435456 B): park 0.134 s, restore 0.204 s",  # timings
    # timings
    "RESULT eor_nn --stack category: page 85 KiB, 1,647 of 3,861 events drawn, 0.06 s "
    "(memlab viz, best of 3)",
    "case         step metric            gpu   gpu_tracker   cpu_tracker      estimate",  # an H100
    '$ memlab run -o out.json --snapshot run.pickle --plot run.png train.py >/dev/null; echo "exit $?"',
    "$ torchrun --standalone --nproc-per-node 2 -m memlab run -f step -o out.json --gather train.py",
}


def all_blocks() -> list[tuple[str, str, int, str | None]]:
    """``(language, code, line, why it is not run or None)`` of every fenced block but the test command's."""
    text = README.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip()
        if before.endswith(TEST_COMMAND):
            continue
        mark = NOT_RUN_MARK.match(before.rsplit("\n", 1)[-1])
        line = text.count("\n", 0, match.start()) + 1
        found.append((match.group(1), match.group(2), line, mark.group(1) if mark else None))
    return found


def blocks() -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of every block that is run (or compared), in order."""
    return [(language, code, line) for language, code, line, why in all_blocks() if why is None]


def readme_files() -> dict[str, str]:
    """The files the README shows (python blocks that start with ``# NAME.py``), by name."""
    return {
        match.group(1): code
        for language, code, _ in blocks()
        if language == "python" and (match := FILE_NAME.match(code.split("\n", 1)[0]))
    }


def python_blocks() -> list[tuple[str, str, int]]:
    """``(code, expected output, line)`` of each python block that is a script ("" when none is shown)."""
    found, listed = [], blocks()
    for i, (language, code, line) in enumerate(listed):
        if language == "python" and not FILE_NAME.match(code.split("\n", 1)[0]):
            following = listed[i + 1] if i + 1 < len(listed) else None
            expected = following[1] if following is not None and following[0] == "text" else ""
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


def console_sessions() -> list[tuple[list[tuple[str, str]], int]]:
    """``([(command, expected output), ...], line)`` of every console block."""
    found = []
    for language, code, line in blocks():
        if language != "console":
            continue
        session, lines = [], code.splitlines(keepends=True)
        while lines:
            text = lines.pop(0)
            assert text.startswith("$ "), f"README.md line {line}: output before any command: {text!r}"
            command = text[2:]
            heredoc = re.search(r"<<-?'?(\w+)'?", command)
            while heredoc and lines:
                body = lines.pop(0)
                command += body
                if body.strip() == heredoc.group(1):
                    break
            output = []
            while lines and not lines[0].startswith("$ "):
                output.append(lines.pop(0))
            session.append((command.rstrip("\n"), "".join(output)))
        found.append((session, line))
    return found


def run(command: list[str] | str, cwd: Path, terminal: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in ``cwd`` with the test's interpreter first on PATH (its ``memlab``), 80 columns.

    ``terminal``: stdout and stderr in one stream, in the order they were written (Python unbuffered),
    as a terminal shows them.
    """
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "80"}
    # as a user's terminal: pytest shortens its summary lines to the width unless CI or BUILD_NUMBER is
    # set (_pytest.terminal.running_on_ci), as it is when .ci/run runs under CI=true
    for variable in ("CI", "BUILD_NUMBER"):
        env.pop(variable, None)
    if terminal:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        command,
        shell=isinstance(command, str),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if terminal else subprocess.PIPE,
        text=True,
        timeout=300,
    )


def test_the_readme_has_blocks_of_every_kind():
    languages = {language for language, _, _ in blocks()}
    assert {"python", "text", "ipython", "bash", "console"} <= languages
    assert len(python_blocks()) >= 4 and sum(len(commands) for commands, _ in command_blocks()) >= 4


def test_every_block_is_run_or_marked_not_run():
    listed = all_blocks()
    unchecked = []
    for i, (language, code, line, why) in enumerate(listed):
        after_python = i > 0 and listed[i - 1][0] == "python" and listed[i - 1][3] is None
        after_python = after_python and not FILE_NAME.match(listed[i - 1][1].split("\n", 1)[0])
        if why is None and not (
            language in {"python", "bash", "console", "ipython"} or (language == "text" and after_python)
        ):
            unchecked.append(f"line {line}: ```{language} {code.splitlines()[0]!r}")
    assert unchecked == [], "blocks neither run nor marked *Not run by the tests: REASON.*"
    marked = {code.split("\n", 1)[0] for _, code, _, why in listed if why is not None}
    assert marked == NOT_RUN


def test_every_file_the_readme_shows_is_run():
    commands = " ".join(command for session, _ in console_sessions() for command, _ in session)
    assert readme_files(), "the README shows no file for its terminal sessions"
    for name in readme_files():
        assert re.search(rf"\b{re.escape(name)}\b", commands), f"no console command runs {name}"


@pytest.mark.parametrize(("code", "expected", "line"), python_blocks(), ids=lambda v: str(v)[:0])
def test_python_block_runs_and_prints_what_the_readme_shows(code, expected, line, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    result = run([sys.executable, str(script)], tmp_path)
    assert result.returncode == 0, f"README.md line {line}:\n{result.stderr}"
    printed = without_torchs_own_output(result.stdout)
    assert printed == as_this_torch_prints(expected), f"README.md line {line}"


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


@pytest.mark.parametrize(("session", "line"), console_sessions(), ids=lambda v: str(v)[:0])
def test_console_sessions_print_what_the_readme_shows(session, line, tmp_path):
    for name in ("memlab", "tests"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    for name, code in readme_files().items():
        (tmp_path / name).write_text(code, encoding="utf-8")
    for command, expected in session:
        result = run(command, tmp_path, terminal=True)
        printed = without_torchs_own_output(result.stdout)
        assert RUN_TIME.sub(" in TIME", printed) == RUN_TIME.sub(" in TIME", expected), (
            f"README.md line {line}: {command}"
        )
        status = 2 if ": error: " in printed else 0
        assert result.returncode == status, f"README.md line {line}: {command}\n{printed}"


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` ``_`` dropped, spaces ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_inside_the_readme_names_a_heading():
    text = FENCE.sub("", README.read_text(encoding="utf-8"))
    anchors = {anchor(title) for title in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 10, "the table of contents and the task table link to sections"
    assert sorted(set(links) - anchors) == []


def test_the_table_of_contents_lists_every_section():
    text = FENCE.sub("", README.read_text(encoding="utf-8"))
    sections = [title for title in re.findall(r"^###? (.+)$", text, re.MULTILINE) if title != "Contents"]
    contents = text.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^ *- \[(.+)\]\(#", contents, re.MULTILINE) == sections
