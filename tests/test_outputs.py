"""Every file memlab writes is written whole or not at all (``memlab._outputs.replacing_path``): a
disk that fills up half-way, Ctrl-C in the middle or a failed rename leaves the previous file byte
for byte and nothing else in its folder; a write that succeeds gives the file the mode ``open``
would, writes through a symbolic link, and writes a device such as ``/dev/null`` in place."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
from memlab._outputs import replacing_path, write_text
from memlab.commands._ranks import write_merged
from memlab.distributed.merge import merge_reports
from tests.full_disk import NO_SPACE, FullDisk

PREVIOUS = b"the previous file, which a failed write must leave as it was\n"


def work() -> torch.Tensor:
    kept = torch.empty(1000)
    return kept + 1


class Made:
    """What the writers write: a tracker's history, a line profile, a merged table of ranks."""

    def __init__(self) -> None:
        with memlab.TensorTracker(history=True) as self.tracker:
            layer = torch.nn.Linear(100, 100)
            layer(torch.randn(8, 100)).sum().backward()
        self.lp = memlab.LineProfiler(work)
        with self.lp:
            work()
        self.merged = merge_reports(["not a report: rank 0 failed"])


@pytest.fixture(scope="module")
def made() -> Made:
    return Made()


# every writer memlab has, by family: (file name, write it)
Writer = tuple[str, Callable[[Made, Path], Any]]
WRITERS: dict[str, Writer] = {
    "dump_snapshot (pickle)": ("run.pickle", lambda m, p: memlab.dump_snapshot(p, m.tracker)),
    "plot_memory .png (Pillow)": ("run.png", lambda m, p: memlab.plot_memory(m.tracker, p)),
    "plot_memory .svg (matplotlib, text)": ("run.svg", lambda m, p: memlab.plot_memory(m.tracker, p)),
    "plot_memory .pdf (matplotlib, bytes)": ("run.pdf", lambda m, p: memlab.plot_memory(m.tracker, p)),
    "LineProfiler.plot .png": ("lines.png", lambda m, p: m.lp.plot(path=p)),
    "LineProfiler.to_json": ("lines.json", lambda m, p: m.lp.to_json(p)),
    "LineProfiler.to_csv": ("lines.csv", lambda m, p: m.lp.to_csv(p)),
    "merged ranks .txt": ("ranks.txt", lambda m, p: write_merged(m.merged, str(p))),
    "merged ranks .json": ("ranks.json", lambda m, p: write_merged(m.merged, str(p))),
    "merged ranks .csv (pandas)": ("ranks.csv", lambda m, p: write_merged(m.merged, str(p))),
}


def full_size(made: Made, writer: Writer, folder: Path) -> int:
    """How many bytes the writer writes when the disk has room (written to another folder)."""
    name, write = writer
    folder.mkdir()
    write(made, folder / name)
    return (folder / name).stat().st_size


@pytest.mark.parametrize("previous", [PREVIOUS, None], ids=["over a file", "a new file"])
@pytest.mark.parametrize("error", [NO_SPACE, KeyboardInterrupt()], ids=["full disk", "Ctrl-C"])
@pytest.mark.parametrize("writer", WRITERS)
def test_a_write_that_fails_half_way_leaves_the_previous_file_and_nothing_else(
    writer: str, error: BaseException, previous: bytes | None, made: Made, tmp_path: Path, monkeypatch: Any
) -> None:
    name, write = WRITERS[writer]
    size = full_size(made, WRITERS[writer], tmp_path / "with room")
    folder = tmp_path / "full"
    folder.mkdir()
    if previous is not None:
        (folder / name).write_bytes(previous)
    disk = FullDisk(folder, room=size // 2, error=error).install(monkeypatch)
    with pytest.raises(type(error)) as raised:
        write(made, folder / name)
    monkeypatch.undo()
    assert raised.value is error
    (failed, held), *_ = disk.failures
    assert failed.startswith(f".{name}.") and failed.endswith(".tmp")  # a temporary file beside it...
    assert held == size // 2  # ...held half the file when the disk filled up
    assert sorted(os.listdir(folder)) == ([name] if previous is not None else [])
    if previous is not None:
        assert (folder / name).read_bytes() == previous


def test_a_failed_rename_leaves_the_previous_file_and_nothing_else(
    made: Made, tmp_path: Path, monkeypatch: Any
) -> None:
    (tmp_path / "run.pickle").write_bytes(PREVIOUS)

    def refuse(source: str, target: str) -> None:
        raise PermissionError(1, "Operation not permitted", target)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        memlab.dump_snapshot(tmp_path / "run.pickle", made.tracker)
    assert os.listdir(tmp_path) == ["run.pickle"]
    assert (tmp_path / "run.pickle").read_bytes() == PREVIOUS


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_mode_open_would_give_it(
    mask: int, mode: int, umask: Callable[[int], None], made: Made, tmp_path: Path
) -> None:
    umask(mask)
    with open(tmp_path / "by_open.json", "w") as file:  # what a user expects: Python's own open
        file.write("{}")
    made.lp.to_json(tmp_path / "lines.json")
    assert stat.S_IMODE((tmp_path / "by_open.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "lines.json").stat().st_mode) == mode
    assert sorted(os.listdir(tmp_path)) == ["by_open.json", "lines.json"]


def test_a_replaced_file_keeps_its_mode(umask: Callable[[int], None], made: Made, tmp_path: Path) -> None:
    umask(0o077)
    path = tmp_path / "lines.csv"
    path.write_bytes(PREVIOUS)
    path.chmod(0o664)
    made.lp.to_csv(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664
    assert path.read_text(encoding="utf-8") == made.lp.to_csv()
    assert os.listdir(tmp_path) == ["lines.csv"]


def test_a_symbolic_link_is_written_through(made: Made, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "lines.json").write_bytes(PREVIOUS)
    (tmp_path / "link.json").symlink_to(tmp_path / "real" / "lines.json")
    made.lp.to_json(tmp_path / "link.json")
    assert (tmp_path / "link.json").is_symlink()
    assert (tmp_path / "real" / "lines.json").read_text(encoding="utf-8") == made.lp.to_json()
    assert sorted(os.listdir(tmp_path)) == ["link.json", "real"]
    assert os.listdir(tmp_path / "real") == ["lines.json"]


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_a_device_is_written_in_place(made: Made, tmp_path: Path) -> None:
    (tmp_path / "null.json").symlink_to("/dev/null")
    made.lp.to_json(tmp_path / "null.json")
    with replacing_path(tmp_path / "null.json") as path:
        assert path == str(tmp_path / "null.json")
    assert os.listdir(tmp_path) == ["null.json"]
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_write_text_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("a longer previous text\n" * 100, encoding="utf-8")
    write_text(path, "short\r\n", newline="")
    assert path.read_bytes() == b"short\r\n"
    assert os.listdir(tmp_path) == ["out.txt"]
