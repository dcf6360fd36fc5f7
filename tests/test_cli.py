"""The ``memlab`` command: ``memlab run`` (kernprof-style), ``memlab demo``, ``--version``, errors.

Most runs call ``memlab.cli.main`` in this process (fast); one runs ``python -m memlab`` in a
subprocess to check the real process's exit status. On CPU the profiler measures through a
TensorTracker with the CUDA allocator model: ``torch.empty(n, 1024)`` is ``4n`` KiB, rounded to
512 B, and a first large block reserves a 20 MiB segment, a first small one (<= 1 MiB) 2 MiB.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import memlab as memlab_package
from memlab._units import format_size, parse_size
from memlab.cli import build_parser, main
from memlab.line_profiler import DEFAULT_COLUMNS, decorators, read_csv, read_json

SCRIPT = """\
import argparse, sys
import torch
import memlab

class Net:
    def forward(self, n):
        return torch.empty(n, 1024)

def work(n):
    a = torch.empty(n, 1024)
    b = torch.empty(n, 1024)
    return a + b

@memlab.profile
def decorated():
    return torch.empty(256)

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=1024)
parser.add_argument("--exit", type=int, default=0)
parser.add_argument("--raise", dest="fail", action="store_true")
args = parser.parse_args()
print("argv", sys.argv[1:], __name__, __file__.endswith("script.py"))
work(args.rows)
Net().forward(256)
decorated()
if args.fail:
    raise RuntimeError("boom")
sys.exit(args.exit)
"""
# The first line of every table memlab run prints on CPU: its tracker is entered before the script.
SOURCE_LINE = (
    "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); "
    "counted from the program's first line"
)
#: The same line for the example, whose matmuls take the two cuBLAS workspaces of the H100 modelled
#: (the forward's thread's and the autograd engine's: 32 MiB each on sm90, CublasHandlePool.cpp).
EXAMPLE_SOURCE_LINE = f"{SOURCE_LINE}; includes 2 modelled cuBLAS workspaces of the H100: 64.00M"
# (active_bytes.all.peak, reserved_bytes.all.peak, line, code) of work(1024) on CPU.
WORK_ROWS = [
    ("0.00B", "0.00B", "9", "def work(n):"),
    ("4.00M", "20.00M", "10", "a = torch.empty(n, 1024)"),
    ("8.00M", "20.00M", "11", "b = torch.empty(n, 1024)"),
    ("12.00M", "20.00M", "12", "return a + b"),
]


@pytest.fixture(autouse=True)
def fresh_global_profiler(monkeypatch: Any) -> None:
    """Each in-process run gets its own decorators' profiler (and tracker), as a new process would."""
    monkeypatch.setattr(decorators, "_global", None)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return path


def tables(text: str) -> dict[str, list[tuple[str, ...]]]:
    """``{function: [(*values, line, code), ...]}`` from printed tables (two value columns); each
    heading ``## function  (file:line)`` names where the function is defined."""
    out: dict[str, list[tuple[str, ...]]] = {}
    rows: list[tuple[str, ...]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            name, _, where = line[3:].partition("  (")
            assert re.fullmatch(r".+\.py:\d+\)", where), line
            rows = out.setdefault(name, [])
            continue
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2].isdigit():
            rows.append(tuple(parts))
    return out


def memlab(*argv: Any) -> int:
    return main([str(arg) for arg in argv])


def test_run_profiles_named_and_decorated_functions(script: Path, capsys: Any) -> None:
    assert memlab("run", "-f", "work", "-f", "Net.forward", script, "--rows", 1024) == 0
    out = capsys.readouterr().out
    assert out.startswith("argv ['--rows', '1024'] __main__ True\n")
    found = tables(out)
    assert list(found) == ["work", "Net.forward", "decorated"]
    assert found["work"] == WORK_ROWS
    # The 20 MiB segment stays cached; the 1 MiB tensor opens a 2 MiB small-pool segment.
    assert found["Net.forward"] == [
        ("0.00B", "20.00M", "6", "def forward(self, n):"),
        ("1.00M", "22.00M", "7", "return torch.empty(n, 1024)"),
    ]
    assert found["decorated"] == [
        ("0.00B", "22.00M", "15", "def decorated():"),
        ("1.00K", "22.00M", "16", "return torch.empty(256)"),
    ]


EARLY_TENSOR_SCRIPT = """\
import torch
import memlab

early = torch.empty(262144)  # 1 MiB of float32, created before anything is profiled

@memlab.profile
def step():
    return torch.empty(256)

def main():
    held = torch.empty(1000)  # 4000 B, a 4096 B block
    step()

main()
"""


@pytest.mark.parametrize("named", [[], ["-f", "step"]])
def test_run_counts_tensors_from_the_first_line_of_the_script(
    named: list[str], tmp_path: Path, capsys: Any
) -> None:
    path = tmp_path / "early.py"
    path.write_text(EARLY_TENSOR_SCRIPT, encoding="utf-8")
    out = tmp_path / "early.json"
    assert memlab("run", "-o", out, *named, path) == 0
    at_entry = 2**20 + 4096  # early + held: a 1 MiB block and a 4 KiB one, both in the small pool
    assert tables(capsys.readouterr().out) == {
        "step": [("1.00M", "2.00M", "7", "def step():"), ("1.00M", "2.00M", "8", "return torch.empty(256)")]
    }
    frame = read_json(out).loc["step"]
    assert frame["active_bytes.all.peak"].tolist()[1:] == [at_entry, at_entry + 1024]
    assert frame["reserved_bytes.all.peak"].tolist()[1:] == [2 * 2**20, 2 * 2**20]


def test_run_forwards_arguments_and_the_exit_status(script: Path, capsys: Any) -> None:
    assert memlab("run", "-f", "work", script, "--rows", 512, "--exit", 3) == 3
    out = capsys.readouterr().out
    assert "argv ['--rows', '512', '--exit', '3']" in out
    assert tables(out)["work"][-1] == ("6.00M", "20.00M", "12", "return a + b")


def test_run_prints_the_table_when_the_script_raises(script: Path, capsys: Any) -> None:
    assert memlab("run", "-f", "work", script, "--raise") == 1
    captured = capsys.readouterr()
    assert tables(captured.out)["work"] == WORK_ROWS
    assert captured.err.splitlines()[-1] == "RuntimeError: boom"
    assert f'File "{script}", line 28, in <module>' in captured.err
    assert "memlab" not in captured.err.replace(str(script), "")


def test_run_on_an_explicit_device_measures_the_same_on_cpu(script: Path, capsys: Any) -> None:
    assert memlab("run", "-g", "cpu", "-f", "work", script) == 0
    assert tables(capsys.readouterr().out)["work"] == WORK_ROWS


def test_run_columns(script: Path, capsys: Any) -> None:
    assert memlab("run", "-D", "-c", "allocated_bytes.all.current", "-c", "hits", "-f", "work", script) == 0
    out = capsys.readouterr().out
    assert f"## decorated  ({script}:15)\n" in out
    work = out.split(f"## work  ({script}:9)\n")[1].split("\n\n\n")[0]
    assert work.splitlines()[1].split() == ["allocated_bytes", "hits", "line", "code"]
    assert [line.split()[:2] for line in work.splitlines()[4:]] == [
        ["0.00B", "1"],
        ["4.00M", "1"],
        ["8.00M", "1"],
        ["12.00M", "1"],
    ]


def test_run_output_files(script: Path, tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    frames = []
    for extension in ("json", "csv", "txt"):
        monkeypatch.setattr(decorators, "_global", None)
        out = tmp_path / f"profile.{extension}"
        assert memlab("run", "-f", "work", "-o", out, script) == 0
        printed = capsys.readouterr().out
        frames.append(out)
    text = frames[2].read_text(encoding="utf-8")
    assert printed.endswith(text) and text.startswith(f"{SOURCE_LINE}\n\n## work  ({script}:9)\n")
    frame = read_json(frames[0])
    pd.testing.assert_frame_equal(frame, read_csv(frames[1]))
    assert json.loads(frames[0].read_text(encoding="utf-8"))["columns"] == [
        "active_bytes.all.peak",
        "reserved_bytes.all.peak",
    ]
    work = frame.loc["work"]
    assert work.index.tolist() == [9, 10, 11, 12]
    assert work["active_bytes.all.peak"].tolist() == [0, 4 * 2**20, 8 * 2**20, 12 * 2**20]
    assert work["reserved_bytes.all.peak"].tolist() == [0, 20 * 2**20, 20 * 2**20, 20 * 2**20]
    assert frame.loc["decorated"]["active_bytes.all.peak"].tolist()[1:] == [0, 1024]


def test_run_module_with_names_resolved_when_they_appear(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    package = tmp_path / "runpkg"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "helpers.py").write_text(
        "import torch\n\ndef make():\n    return torch.empty(256)\n\n"
        "def build():\n    return torch.empty(512)\n",
        encoding="utf-8",
    )
    (package / "__main__.py").write_text(
        textwrap.dedent(
            """\
            import sys
            def main():
                from runpkg import helpers
                from runpkg.helpers import build
                helpers.make(); build()
                return len(sys.argv)
            sys.exit(main())
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    imports, path, main_module = builtins.__import__, sys.path[:], sys.modules["__main__"]
    status = memlab("run", "-f", "runpkg.helpers:make", "-f", "build", "-m", "runpkg", "a", "b")
    assert status == 3
    assert (builtins.__import__, sys.path, sys.modules["__main__"]) == (imports, path, main_module)
    found = tables(capsys.readouterr().out)
    assert found == {
        "make": [("0.00B", "0.00B", "3", "def make():"), ("1.00K", "2.00M", "4", "return torch.empty(256)")],
        "build": [
            ("0.00B", "2.00M", "6", "def build():"),
            ("2.00K", "2.00M", "7", "return torch.empty(512)"),
        ],
    }
    monkeypatch.delitem(sys.modules, "runpkg.helpers")
    monkeypatch.delitem(sys.modules, "runpkg")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["run", "missing.py"], "missing.py"),
        (["run", "-f", "nope", "{script}"], "nope"),
        (["run", "-c", "active_bytes.all.peek", "-f", "work", "{script}"], "active_bytes.all.peak"),
        (["run", "-o", "out.xlsx", "{script}"], "out.xlsx"),
        (["run", "-g", "tpu:x", "-f", "work", "{script}"], "tpu:x"),
        (["run", "-f", "a-b", "{script}"], "a-b"),
        (["run", "-f", "sys", "{script}"], "-f sys"),
        (["run", "-m", "no_such_module_here"], "no_such_module_here"),
        (["run"], "script"),
        (["run", "--bogus", "{script}"], "--bogus"),
        (["nope"], "nope"),
        (["demo", "--device", "cuda:99"], "cuda:99"),
        (["demo", "--device", "meta"], "meta"),
        (["demo", "--device", "mps"], "--device mps: this torch cannot use it here ("),
        (["demo", "--epochs", "0"], "argument --epochs: must be a whole number of at least 1, got '0'"),
        (["run", "-g", "mps", "{script}"], "-g mps: this torch cannot use it here ("),
        (["--bogus"], "memlab: error: unrecognized arguments: --bogus (see memlab --help)"),
        (["--bogus", "run", "{script}"], "memlab: error: unrecognized arguments: --bogus (see memlab"),
        ([], "memlab: error: name a COMMAND: run, estimate, plan, viz, demo (see memlab --help)"),
        (
            ["run", "{folder}"],
            "memlab run: error: '{folder}' is a directory, not a script: name a .py file in it, or run a "
            "package with -m package",
        ),
    ],
)
def test_errors_are_one_line_with_status_2(argv: list[str], named: str, script: Path, capsys: Any) -> None:
    argv = [arg.format(script=script, folder=script.parent) for arg in argv]
    named = named.format(folder=script.parent)
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memlab") and named in err


TIME = re.compile(r"\d+ns|\d+\.\d\d(us|ms|s)")


def test_run_shows_a_time_column(script: Path, capsys: Any) -> None:
    assert memlab("run", "-D", "-c", "time", "-c", "active_bytes.all.peak", "-f", "work", script) == 0
    work = capsys.readouterr().out.split(f"## work  ({script}:9)\n\n")[1].split("\n\n")[0].splitlines()
    assert work[0].split() == ["time", "active_bytes", "line", "code"]
    rows = [tuple(line.split(None, 3)) for line in work[3:]]
    assert [row[1:] for row in rows] == [row[:1] + row[2:] for row in WORK_ROWS]
    assert all(TIME.fullmatch(row[0]) for row in rows)


def test_demo_shows_a_time_column(capsys: Any) -> None:
    assert memlab("demo", "--epochs", 1, "-D", "-c", "time") == 0
    out = capsys.readouterr().out
    train_step = (
        out.split("## train_step  (memlab/examples/train.py:38)\n\n")[1].split("\n\n")[0].splitlines()
    )
    assert train_step[0].split() == ["time", "line", "code"]  # one header line: "time" has one part
    assert train_step[1].split(None, 1) == ["37", "@memlab.profile"]  # no blank header lines
    rows = [line.split(None, 2) for line in train_step[2:]]
    assert [row[1] for row in rows] == [row[2] for row in TRAIN_STEP_ROWS]
    assert all(TIME.fullmatch(row[0]) for row in rows)


def test_options_go_before_the_script_and_the_rest_is_the_programs() -> None:
    parser = build_parser()
    readme = parser.parse_args(
        ["run", "-c", "allocated_bytes.all.allocated", "-o", "p.json", "-m", "pkg.train"]
    )
    assert (readme.column, readme.output, readme.as_module, readme.script, readme.args) == (
        ["allocated_bytes.all.allocated"],
        "p.json",
        True,
        "pkg.train",
        [],
    )
    after = parser.parse_args(["run", "-m", "pkg.train", "-c", "time", "-o", "p.json"])
    assert (after.column, after.output, after.args) == ([], None, ["-c", "time", "-o", "p.json"])


def test_version_and_help(capsys: Any) -> None:
    from memlab import __version__

    for argv, text in (
        (["--version"], f"memlab {__version__}"),
        (["--help"], "run"),
        (["run", "--help"], "-f FUNC"),
        (["run", "--help"], "(script.py | -m module) [args...]"),
        (["run", "--help"], "memlab's options go before the script (or -m module): everything after it is"),
    ):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 0 and text in " ".join(capsys.readouterr().out.split())


def test_python_dash_m_memlab_propagates_the_exit_status(script: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "memlab",
        "run",
        "-f",
        "work",
        str(script),
        "--rows",
        "256",
        "--exit",
        "7",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 7, done.stderr
    assert done.stdout.count("## decorated") == 1  # printed by memlab run, not again at exit
    assert tables(done.stdout)["work"] == [
        ("0.00B", "0.00B", "9", "def work(n):"),
        ("1.00M", "2.00M", "10", "a = torch.empty(n, 1024)"),
        ("2.00M", "2.00M", "11", "b = torch.empty(n, 1024)"),
        ("3.00M", "4.00M", "12", "return a + b"),  # a + b opens a second 2 MiB segment
    ]


# -- the packaged example: memlab/examples/train.py ------------------------------------------------
EXAMPLE = os.path.join(os.path.dirname(memlab_package.__file__), "examples", "train.py")
# train_step of the example, one epoch on CPU: weights, gradients and both AdamW moments are alive
# at entry once a step has run, and the modelled H100's two 32 MiB cuBLAS workspaces (the forward's
# thread's and the autograd thread's); AdamW's temporaries make optimizer.step() the peak.
TRAIN_STEP_ROWS = [
    (
        "88.69M",
        "106.00M",
        "38",
        "def train_step(model: nn.Module, optimizer: Optimizer, inputs: Tensor, targets: Tensor) -> float:",
    ),
    ("88.69M", "106.00M", "39", "optimizer.zero_grad(set_to_none=True)"),
    ("83.40M", "106.00M", "40", "logits = model(inputs)"),
    ("83.15M", "106.00M", "41", "loss = nn.functional.cross_entropy(logits, targets)"),
    ("88.95M", "106.00M", "42", "loss.backward()"),
    ("96.70M", "106.00M", "43", "optimizer.step()"),
    ("88.70M", "106.00M", "44", "return loss.item()"),
]


def test_memlab_run_on_the_example_script(tmp_path: Path) -> None:
    """The acceptance run, as a user types it, in a subprocess through the installed command."""
    out = tmp_path / "out.json"
    installed = Path(sys.executable).with_name("memlab")
    command = [str(installed)] if installed.exists() else [sys.executable, "-m", "memlab"]
    command += ["run", "-f", "train_step", "-o", str(out), EXAMPLE, "--epochs", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("epoch 1: loss ") and not lines[1].startswith("epoch 2")  # --epochs 1
    assert tables(done.stdout) == {"train_step": TRAIN_STEP_ROWS}
    frame = read_json(out)
    peak = 34289664 + 64 * 2**20  # 96.70M
    assert frame.loc[("train_step", 43)].tolist() == [peak, 106 * 2**20, "    optimizer.step()"]


def test_run_output_loads_back_into_the_profilers_dataframe(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out.json"
    assert memlab("run", "-f", "train_step", "-o", out, EXAMPLE, "--epochs", 1) == 0
    assert tables(capsys.readouterr().out) == {"train_step": TRAIN_STEP_ROWS}
    expected = decorators.global_line_profiler().to_dataframe("train_step", DEFAULT_COLUMNS)
    pd.testing.assert_frame_equal(read_json(out), expected)
    assert expected["active_bytes.all.peak"].max() == 34289664 + 64 * 2**20  # 96.70M


def test_run_propagates_the_scripts_own_usage_error(capsys: Any) -> None:
    assert memlab("run", "-f", "train_step", EXAMPLE, "--epochs", 0) == 2
    captured = capsys.readouterr()
    assert "--epochs must be at least 1, got 0" in captured.err
    assert "## train_step  (memlab/examples/train.py:38)\n\nregistered, but never called while profiling" in (
        captured.out
    )


def test_demo_profiles_the_example(capsys: Any) -> None:
    assert memlab("demo", "--epochs", 1) == 0
    assert tables(capsys.readouterr().out) == {"train_step": TRAIN_STEP_ROWS}


def test_demo_and_run_say_where_the_numbers_come_from_in_the_same_words(
    capsys: Any, monkeypatch: Any
) -> None:
    assert memlab("demo", "--epochs", 1) == 0
    demo = capsys.readouterr().out.splitlines()
    monkeypatch.setattr(decorators, "_global", None)
    assert memlab("run", "-f", "train_step", EXAMPLE, "--epochs", 1) == 0
    run = capsys.readouterr().out.splitlines()
    assert demo[1] == run[1] == EXAMPLE_SOURCE_LINE  # line 0: the example's "epoch 1: loss ..."
    monkeypatch.setattr(decorators, "_global", None)
    assert memlab("demo", "--epochs", 1, "--device", "cpu") == 0  # as memlab run -g cpu: a device named
    assert capsys.readouterr().out.splitlines()[1] == EXAMPLE_SOURCE_LINE.replace(" (no CUDA GPU here)", "")


def _blocks(tensors: Any) -> int:
    """Bytes of the CUDA caching allocator's blocks for ``tensors``: each rounded up to 512 B."""
    return sum(max(512, -(-t.nbytes // 512) * 512) for t in tensors)


def test_demo_says_what_the_model_itself_takes_and_the_switch_turns_workspaces_off(
    capsys: Any, monkeypatch: Any
) -> None:
    from memlab.examples.train import make_model

    parameters = _blocks(make_model().parameters())  # 6,341,120 B
    state = 2 * parameters + 6 * 512  # AdamW: exp_avg, exp_avg_sq, and a 0-dim step per parameter
    total, each = format_size(2 * parameters + state), format_size(parameters)
    footprint = (
        f"the model itself takes {total}: parameters {each}, gradients {each}, optimizer state "
        f"{format_size(state)} (after an optimizer step); the rest of each peak is the batch, activations "
        "and temporaries"
    )
    assert memlab("demo", "--epochs", 1) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == EXAMPLE_SOURCE_LINE
    assert out.endswith(f"\n\n{footprint}, and 64.00M of workspaces\n")
    assert footprint.startswith("the model itself takes 24.19M: parameters 6.05M, gradients 6.05M, ")

    monkeypatch.setattr(decorators, "_global", None)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # PyTorch's switch: workspaces of 0 bytes
    assert memlab("demo", "--epochs", 1) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == SOURCE_LINE and out.endswith(f"\n\n{footprint}\n")
    without = tables(out)["train_step"]
    assert [row[0] for row in without] == [
        format_size(parse_size(row[0]) - 64 * 2**20) for row in TRAIN_STEP_ROWS
    ]


def test_run_without_names_shows_the_decorated_functions(capsys: Any) -> None:
    assert memlab("run", EXAMPLE, "--epochs", 1) == 0
    assert tables(capsys.readouterr().out) == {"train_step": TRAIN_STEP_ROWS}


def test_extra_columns_for_a_decorated_function_that_never_ran(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "never.py"
    script.write_text("import memlab\n\n@memlab.profile\ndef never():\n    pass\n", encoding="utf-8")
    assert memlab("run", "-c", "allocated_bytes.all.current", script) == 0
    assert (
        capsys.readouterr().out == f"## never  ({script}:4)\n\nregistered, but never called while profiling\n"
    )


SNAPSHOT_SCRIPT = """\
import torch

kept = torch.empty(256, 1024)
scratch = torch.empty(1024, 1024)
del scratch
if len(__import__("sys").argv) > 1:
    raise RuntimeError("boom")
"""
MiB = 1024 * 1024


def _snapshot_run(tmp_path: Path, *script_args: str) -> tuple[int, dict[str, Any], Path]:
    import pickle

    script = tmp_path / "snap.py"
    script.write_text(SNAPSHOT_SCRIPT, encoding="utf-8")
    status = memlab("run", "--snapshot", tmp_path / "out.pickle", script, *script_args)
    with open(tmp_path / "out.pickle", "rb") as file:
        return status, pickle.load(file), script


def test_run_snapshot_holds_the_scripts_segments_and_lines(tmp_path: Path, capsys: Any) -> None:
    import torch

    status, snapshot, script = _snapshot_run(tmp_path)
    with memlab_package.TensorTracker() as tracker:  # the same tensors, measured here
        kept = torch.empty(256, 1024)
        scratch = torch.empty(1024, 1024)
        del scratch
    assert status == 0 and kept.nbytes == MiB
    assert sum(s["total_size"] for s in snapshot["segments"]) == tracker.memory_reserved() == 22 * MiB
    active = [b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [(b["size"], b["frames"][0]) for b in active] == [
        (MiB, {"filename": str(script), "line": 3, "name": "<module>"})  # then memlab's caller here
    ]
    assert [e["action"] for e in snapshot["device_traces"][0]] == [
        "segment_alloc",
        "alloc",
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
    ]
    assert "nothing was profiled" in capsys.readouterr().err


def test_run_snapshot_is_written_when_the_script_raises(tmp_path: Path, capsys: Any) -> None:
    status, snapshot, _ = _snapshot_run(tmp_path, "--raise")
    assert status == 1 and "RuntimeError: boom" in capsys.readouterr().err
    assert sum(s["total_size"] for s in snapshot["segments"]) == 22 * MiB


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("out.png", "memlab run: error: --snapshot {tmp}/out.png: write to a file ending in .pickle, .pkl\n"),
        (
            "missing/out.pickle",
            "memlab run: error: --snapshot {tmp}/missing/out.pickle: no such folder '{tmp}/missing'\n",
        ),
    ],
)
def test_run_snapshot_bad_paths_are_one_line_errors(
    script: Path, tmp_path: Path, capsys: Any, path: str, message: str
) -> None:
    assert memlab("run", "--snapshot", tmp_path / path, script) == 2
    captured = capsys.readouterr()
    assert captured.err == message.format(tmp=tmp_path) and captured.out == ""


def test_run_plot_draws_the_runs_memory_with_its_peak(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("matplotlib")
    script = tmp_path / "snap.py"
    script.write_text(SNAPSHOT_SCRIPT, encoding="utf-8")
    assert memlab("run", "--plot", tmp_path / "run.png", "--snapshot", tmp_path / "out.pickle", script) == 0
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import pickle

    from memlab.history.series import memory_series

    with open(tmp_path / "out.pickle", "rb") as file:
        series = memory_series(pickle.load(file))
    assert max(series.allocated) == 5 * MiB and max(series.reserved) == 22 * MiB


def test_run_plot_bad_path_is_a_one_line_error(script: Path, tmp_path: Path, capsys: Any) -> None:
    assert memlab("run", "--plot", tmp_path / "run.gif", script) == 2
    assert capsys.readouterr().err == (
        f"memlab run: error: --plot {tmp_path}/run.gif: write to a file ending in .png, .svg, .pdf\n"
    )


@pytest.mark.cuda
def test_run_snapshot_on_a_gpu_is_pytorchs_own(tmp_path: Path) -> None:
    import pickle

    script = tmp_path / "gpu.py"
    script.write_text("import torch\n\nkept = torch.empty(1024, device='cuda')\n", encoding="utf-8")
    assert memlab("run", "--snapshot", tmp_path / "gpu.pickle", script) == 0
    with open(tmp_path / "gpu.pickle", "rb") as file:
        snapshot = pickle.load(file)
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [4096]
    assert {"filename": str(script), "line": 3, "name": "<module>"} in allocs[0]["frames"]


def test_run_with_a_gpu_index_that_does_not_exist_is_one_line_not_the_cpu(script: Path, capsys: Any) -> None:
    assert main(["run", "-g", "99", "-f", "work", str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the script did not run
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("memlab run: error: -g 99: no such GPU (this machine has ")


def test_run_on_meta_of_a_cpu_script_says_why_every_byte_is_zero(script: Path, capsys: Any) -> None:
    assert memlab("run", "-g", "meta", "-f", "work", script) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "modelled: CUDA caching allocator replayed from meta tensors (memlab.TensorTracker); counted from "
        "the program's first line; no tensor was made on meta, so every byte column is 0: the tensors were "
        "on cpu (measure cpu to see them)"
    )


def test_a_script_read_from_a_pipe_runs_and_shows_its_lines(capsys: Any) -> None:
    read, write = os.pipe()  # as bash's <(...) passes a script: /dev/fd/N, readable once
    os.write(write, b"import memlab, torch\n@memlab.profile\ndef f():\n    return torch.empty(256)\nf()\n")
    os.close(write)
    try:
        assert main(["run", f"/dev/fd/{read}"]) == 0
    finally:
        os.close(read)
    assert capsys.readouterr().out.splitlines()[2:] == [
        f"## f  (/dev/fd/{read}:3)",
        "",
        "active_bytes reserved_bytes line  code",
        "         all            all",
        "        peak           peak",
        "                               2  @memlab.profile",
        "       0.00B          0.00B    3  def f():",
        "       1.00K          2.00M    4      return torch.empty(256)",
    ]


def test_run_with_one_part_columns_prints_one_header_line(script: Path, capsys: Any) -> None:
    assert memlab("run", "-D", "-c", "hits", "-c", "delta", "-f", "work", script) == 0
    assert capsys.readouterr().out.split(f"## work  ({script}:9)\n\n")[1].split("\n\n")[0] == (
        "hits delta line  code\n"  # each column name is one part: one header line, no blank ones
        "   1 0.00B    9  def work(n):\n"
        "   1 4.00M   10      a = torch.empty(n, 1024)\n"  # a 4 MiB tensor each, as WORK_ROWS
        "   1 4.00M   11      b = torch.empty(n, 1024)\n"
        "   1 4.00M   12      return a + b"
    )


NESTED_CAPACITY_SCRIPT = """\
import torch
import memlab


def main():
    kept = torch.empty(1024 * 1024)
    try:
        with memlab.TensorTracker(capacity="8 MiB"):
            torch.empty(4 * 1024 * 1024)
    except torch.OutOfMemoryError:
        pass
    return kept


main()
"""


def test_run_does_not_count_a_request_a_tracker_in_the_script_refused(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "nested.py"
    path.write_text(NESTED_CAPACITY_SCRIPT, encoding="utf-8")
    assert memlab("run", "-f", "main", path) == 0
    rows = tables(capsys.readouterr().out)["main"]
    # the 16 MiB the inner tracker refused is allocated by no GPU: the peak stays at the kept 4 MiB
    assert [(peak, line) for peak, _, line, _ in rows] == [
        ("0.00B", "5"),
        ("4.00M", "6"),
        ("4.00M", "7"),
        ("4.00M", "8"),
        ("4.00M", "9"),
        ("4.00M", "10"),
        ("4.00M", "11"),
        ("4.00M", "12"),
    ]
