"""``memlab run`` stopped by SIGTERM or SIGHUP (a cluster's time limit, a preemption), or by the
program's own ``os._exit(n)``, still prints its table and writes ``-o``, and exits as the program
would have: 143, 129, n. Each run is a real ``python -m memlab`` process, signalled by PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memlab.cli import main
from memlab.line_profiler import decorators

ROOT = Path(__file__).resolve().parents[2]  # python -m memlab imports this checkout's memlab

LOOP = """\
import torch
import memlab


@memlab.profile
def step(x):
    y = x * 2
    return y.sum()


x = torch.ones(1000)
step(x)
print("ready", flush=True)
while True:
    step(x)
"""

# step's table ({script}: the script's absolute path), from the CUDA caching allocator's rules (what
# a GPU would show): x, 4000 B of float32, is one 4096 B block at entry; y another; the sum's 4 B
# take a 512 B block.
STEP_TABLE = """\
modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); \
counted from the program's first line

## step  ({script}:6)

active_bytes reserved_bytes line  code
         all            all
        peak           peak
                               5  @memlab.profile
       4.00K          2.00M    6  def step(x):
       8.00K          2.00M    7      y = x * 2
       8.50K          2.00M    8      return y.sum()
"""


def start(tmp_path: Path, source: str, *options: str) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(source, encoding="utf-8")
    command = [sys.executable, "-m", "memlab", "run", *options, str(script)]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    return process, script


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def signalled(tmp_path: Path, signum: int) -> tuple[int, str, str, Path, Path]:
    """Run the looping script under ``memlab run -o out.txt``, send ``signum`` to the process by
    PID once the script printed ``ready``, and return (status, stdout, stderr, -o file, script)."""
    output = tmp_path / "out.txt"
    process, script = start(tmp_path, LOOP, "-o", str(output))
    assert process.stdout is not None
    first = process.stdout.readline()
    assert first == "ready\n", process.stderr.read() if process.stderr else first
    os.kill(process.pid, signum)
    rest, err = process.communicate(timeout=120)
    return process.returncode, first + rest, err, output, script


@pytest.mark.parametrize(
    ("signum", "status", "name"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGHUP, 129, "SIGHUP")]
)
def test_a_signal_a_cluster_sends_prints_the_table_writes_o_and_exits_128_plus_signum(
    tmp_path, signum, status, name
):
    returncode, out, err, output, script = signalled(tmp_path, signum)
    assert returncode == status, err
    assert out == "ready\n" + STEP_TABLE.format(script=script)
    assert output.read_text(encoding="utf-8") == STEP_TABLE.format(script=script)
    # The line the program was running: in step, or in the loop that calls it (from "ready" on).
    assert re.fullmatch(
        rf"memlab run: {name} received at {re.escape(str(script))}:(6|7|8|13|14|15) \(in (step|<module>)\): "
        r"the program stopped there\n",
        err,
    ), err


def test_os_exit_in_the_program_prints_the_table_and_writes_its_files_first(tmp_path):
    output, snapshot = tmp_path / "out.txt", tmp_path / "run.pickle"
    source = LOOP.replace(
        'print("ready", flush=True)\nwhile True:\n    step(x)\n', "import os\nos._exit(3)\n"
    )
    process, script = start(tmp_path, source, "-o", str(output), "--snapshot", str(snapshot))
    out, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (3, "")
    assert out == STEP_TABLE.format(script=script)
    assert output.read_text(encoding="utf-8") == STEP_TABLE.format(script=script)
    import pickle

    with open(snapshot, "rb") as file:  # written by this test's own memlab run, not a stranger's file
        recorded = pickle.load(file)
    blocks = [
        (block["size"], block["state"]) for segment in recorded["segments"] for block in segment["blocks"]
    ]
    # x (4000 B -> 4096) still alive in the 2 MiB small-pool segment when the program exited
    assert blocks == [(4096, "active_allocated"), (2 * 2**20 - 4096, "inactive")]


def test_os_exit_in_another_thread_says_why_there_is_no_table(tmp_path):
    source = LOOP.replace(
        'print("ready", flush=True)\nwhile True:\n    step(x)\n',
        "import os, threading, time\n"
        "threading.Thread(target=os._exit, args=(4,), name='closer').start()\n"
        "time.sleep(60)\n",
    )
    process, _ = start(tmp_path, source)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 4
    assert out == ""
    assert err == (
        "memlab run: no table: os._exit(4) was called in thread 'closer', not the main thread that runs "
        "the program\n"
    )


def test_a_sigterm_handler_the_program_installs_runs_instead(tmp_path):
    source = LOOP.replace(
        'print("ready", flush=True)\nwhile True:\n    step(x)\n',
        "import signal\n"
        "stop = []\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))\n"
        'print("ready", flush=True)\n'
        "while not stop:\n"
        "    step(x)\n"
        'print("checkpoint saved", flush=True)\n',
    )
    output = tmp_path / "out.txt"
    process, script = start(tmp_path, source, "-o", str(output))
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    os.kill(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (0, "")  # the program's handler decided: it finished
    assert out == "checkpoint saved\n" + STEP_TABLE.format(script=script)
    assert output.read_text(encoding="utf-8") == STEP_TABLE.format(script=script)


@pytest.fixture
def fresh_global_profiler(monkeypatch: Any) -> None:
    monkeypatch.setattr(decorators, "_global", None)


def test_the_handlers_and_os_exit_are_memlab_s_only_while_the_program_runs(
    tmp_path, capsys, fresh_global_profiler
):
    script = tmp_path / "show.py"
    script.write_text(
        "import os, signal\n"
        "print(signal.getsignal(signal.SIGTERM).__name__, signal.getsignal(signal.SIGHUP), "
        "os._exit.__name__)\n",
        encoding="utf-8",
    )
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    real_exit = os._exit
    try:
        assert main(["run", str(script)]) == 0
        assert capsys.readouterr().out == "terminate 1 reported_exit\n"  # SIGHUP stays ignored (SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert os._exit is real_exit
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_program_s_finally_blocks_run_to_their_end_after_sigterm(tmp_path):
    """The exception is raised once: a checkpoint saved in a ``finally`` block (here 1.5 s) is
    never interrupted by memlab again."""
    source = LOOP.replace(
        'print("ready", flush=True)\nwhile True:\n    step(x)\n',
        "import time\n"
        "try:\n"  # "ready" inside the try: a SIGTERM right after it finds the finally block armed
        '    print("ready", flush=True)\n'
        "    while True:\n"
        "        step(x)\n"
        "finally:\n"
        "    time.sleep(1.5)\n"
        '    print("checkpoint saved", flush=True)\n',
    )
    process, script = start(tmp_path, source)
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    os.kill(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert out == "checkpoint saved\n" + STEP_TABLE.format(script=script)


def test_os_exit_inside_a_profiled_function_shows_what_its_last_line_held(tmp_path):
    source = LOOP.replace("    return y.sum()\n", "    import os\n    os._exit(5)\n").replace(
        'print("ready", flush=True)\nwhile True:\n    step(x)\n', ""
    )
    process, _ = start(tmp_path, source)
    out, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (5, "")
    # x and y (4096 B blocks) are alive on the line that exits, as on the line before
    assert out.splitlines()[-3:] == [
        "       8.00K          2.00M    7      y = x * 2",
        "       8.00K          2.00M    8      import os",
        "       8.00K          2.00M    9      os._exit(5)",
    ]
