"""The files ``memlab run`` and ``memlab demo`` write (``-o``, ``--snapshot``, ``--plot``): a path
that cannot be written is a one-line error before the script runs; a write that still fails at the
end (a full disk: ``/dev/full``) leaves the table printed, names the file on stderr and leaves the
previous file as it was."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from memlab import _arguments
from memlab.cli import main
from memlab.line_profiler import decorators
from tests.full_disk import FullDisk

SCRIPT = """\
import torch
import memlab

print("the script ran")

@memlab.profile
def work():
    return torch.empty(1024)

work()
"""
# The table memlab run prints for SCRIPT on CPU (its tracker entered before the script), for the
# script at the absolute path {script} (outside the working directory: named as run).
TABLE = """\
modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); \
counted from the program's first line

## work  ({script}:7)

active_bytes reserved_bytes line  code
         all            all
        peak           peak
                               6  @memlab.profile
       0.00B          0.00B    7  def work():
       4.00K          2.00M    8      return torch.empty(1024)
"""
needs_dev_full = pytest.mark.skipif(
    not os.path.exists("/dev/full"), reason="needs /dev/full (Linux), a device that is always full"
)


@pytest.fixture(autouse=True)
def fresh_global_profiler(monkeypatch: Any) -> None:
    monkeypatch.setattr(decorators, "_global", None)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT, encoding="utf-8")
    (tmp_path / "folder.txt").mkdir()
    (tmp_path / "folder.pickle").mkdir()
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "a_file").write_text("", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "-o", "folder.txt"], "-o {tmp}/folder.txt: is a folder; name a file to write in it"),
        (["run", "-o", "gone/out.csv"], "-o {tmp}/gone/out.csv: no such folder '{tmp}/gone'"),
        (["run", "-o", "a_file/out.json"], "-o {tmp}/a_file/out.json: no such folder '{tmp}/a_file'"),
        (
            ["run", "--snapshot", "folder.pickle"],
            "--snapshot {tmp}/folder.pickle: is a folder; name a file to write in it",
        ),
        (["run", "--plot", "folder.png"], "--plot {tmp}/folder.png: is a folder; name a file to write in it"),
        (["run", "--plot", "gone/run.svg"], "--plot {tmp}/gone/run.svg: no such folder '{tmp}/gone'"),
        (["demo", "-o", "folder.txt"], "-o {tmp}/folder.txt: is a folder; name a file to write in it"),
        (["demo", "-o", "gone/out.txt"], "-o {tmp}/gone/out.txt: no such folder '{tmp}/gone'"),
    ],
)
def test_a_path_that_cannot_be_written_stops_before_the_script_runs(
    script: Path, tmp_path: Path, capsys: Any, argv: list[str], message: str
) -> None:
    command, *options = argv
    paths = [str(tmp_path / a) if "." in a or "/" in a else a for a in options]
    assert main([command, *paths, *([str(script)] if command == "run" else ["--epochs", "1"])]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # neither the script nor the example ran
    assert captured.err == f"memlab {command}: error: {message.format(tmp=tmp_path)}\n"


def test_a_file_this_process_may_not_write_stops_before_the_script_runs(
    script: Path, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    # Tests run as root here, for whom every file is writable: os.access answers as for a user.
    (tmp_path / "locked.txt").write_text("", encoding="utf-8")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main(["run", "-o", str(tmp_path / "locked.txt"), str(script)]) == 2
    assert main(["run", "-o", str(tmp_path / "new.txt"), str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"memlab run: error: -o {tmp_path}/locked.txt: this process may not write to that file",
        f"memlab run: error: -o {tmp_path}/new.txt: this process may not create files in '{tmp_path}'",
    ]


def test_plot_without_matplotlib_stops_before_the_script_runs(
    script: Path, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    real = _arguments.importlib.util.find_spec
    monkeypatch.setattr(
        _arguments.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name)
    )
    assert main(["run", "--plot", str(tmp_path / "run.png"), str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"memlab run: error: --plot {tmp_path}/run.png: plotting needs matplotlib: "
        "pip install 'memlab[plot]'\n"
    )


@needs_dev_full
@pytest.mark.parametrize("extension", ["txt", "json", "csv"])
def test_a_table_that_cannot_be_written_at_the_end_is_printed_all_the_same(
    script: Path, tmp_path: Path, capsys: Any, extension: str
) -> None:
    full = tmp_path / f"full.{extension}"
    full.symlink_to("/dev/full")
    assert main(["run", "-o", str(full), str(script)]) == 1  # the script succeeded; the file is missing
    captured = capsys.readouterr()
    assert captured.out == "the script ran\n" + TABLE.format(script=script)
    assert captured.err == f"memlab run: could not write -o {full}: [Errno 28] No space left on device\n"


@needs_dev_full
def test_a_snapshot_and_plot_that_cannot_be_written_leave_the_table_and_the_status(
    script: Path, tmp_path: Path, capsys: Any
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "full.pickle").symlink_to("/dev/full")
    (tmp_path / "full.png").symlink_to("/dev/full")
    script.write_text(SCRIPT + "raise SystemExit(3)\n", encoding="utf-8")
    argv = ["run", "--snapshot", str(tmp_path / "full.pickle"), "--plot", str(tmp_path / "full.png")]
    assert main([*argv, str(script)]) == 3  # the script's own failure is the status
    captured = capsys.readouterr()
    assert captured.out == "the script ran\n" + TABLE.format(script=script)
    assert captured.err.splitlines() == [
        f"memlab run: could not write --snapshot {tmp_path}/full.pickle: [Errno 28] No space left on device",
        f"memlab run: could not write --plot {tmp_path}/full.png: [Errno 28] No space left on device",
    ]


def test_a_plot_of_a_run_without_tensors_is_named_after_the_run(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("matplotlib")
    script = tmp_path / "empty.py"
    script.write_text("print('no tensors')\n", encoding="utf-8")
    assert main(["run", "--plot", str(tmp_path / "run.png"), str(script)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "no tensors\n"
    assert captured.err.splitlines() == [
        f"memlab run: could not write --plot {tmp_path}/run.png: the snapshot has no trace entries for "
        "device 0: record them with memlab.TensorTracker(history=True) (or "
        "torch.cuda.memory._record_memory_history() on a GPU); devices with entries: none",
        "memlab run: nothing was profiled: decorate functions with @memlab.profile or name them with -f",
    ]
    assert not (tmp_path / "run.png").exists()


def test_a_disk_that_fills_up_leaves_every_previous_file_as_it_was(
    script: Path, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    pytest.importorskip("matplotlib")
    outputs = {"-o": "out.json", "--snapshot": "run.pickle", "--plot": "run.png"}
    previous = {name: f"previous {name}\n".encode() for name in outputs.values()}
    for name, content in previous.items():
        (tmp_path / name).write_bytes(content)
    before = sorted(os.listdir(tmp_path))
    disk = FullDisk(tmp_path, room=10).install(monkeypatch)
    argv = [part for option, name in outputs.items() for part in (option, str(tmp_path / name))]
    assert main(["run", *argv, str(script)]) == 1  # the script succeeded; its files are missing
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert captured.out == "the script ran\n" + TABLE.format(script=script)
    assert captured.err.splitlines() == [
        f"memlab run: could not write {option} {tmp_path}/{name}: [Errno 28] No space left on device"
        for option, name in [("--snapshot", "run.pickle"), ("--plot", "run.png"), ("-o", "out.json")]
    ]
    # each failed half-way in a temporary file beside it: .run.pickle.<random>.tmp
    assert sorted({failed[1:].rsplit(".", 2)[0] for failed, _held in disk.failures}) == sorted(previous)
    assert sorted(os.listdir(tmp_path)) == before
    assert {name: (tmp_path / name).read_bytes() for name in previous} == previous
