"""The IPython magics, in IPython's own test shell: %mlrun, %%mlrun and %memreport on CPU.

Without a GPU the profiler measures through a TensorTracker with the CUDA allocator model, so a
1024 x 1024 float32 tensor is 4.00M and the first large allocation reserves a 20 MiB segment.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

import memlab
from memlab.extension import split_statement
from tests.full_disk import FullDisk

WORK_CELL = """\
import torch
def work():
    a = torch.empty(1024, 1024)
    b = torch.empty(1024, 1024)
    return a + b
work()
"""
# (active_bytes.all.peak, reserved_bytes.all.peak, line, code) of work() on CPU.
WORK_ROWS = [
    ("0.00B", "0.00B", "2", "def work():"),
    ("4.00M", "20.00M", "3", "a = torch.empty(1024, 1024)"),
    ("8.00M", "20.00M", "4", "b = torch.empty(1024, 1024)"),
    ("12.00M", "20.00M", "5", "return a + b"),
]


@pytest.fixture
def ip() -> Iterator[Any]:
    """IPython's test shell with memlab loaded, emptied before and after: tensors a test leaves
    (names, ``Out``, ``_``, a traceback's frames) would be adopted when a later test profiles."""
    shell = globalipapp.get_ipython()
    shell.reset(new_session=False)
    shell.extension_manager.load_extension("memlab")
    yield shell
    shell.reset(new_session=False)
    shell.InteractiveTB.tb = shell.last_execution_result = None  # the last traceback's frames


def rows(stats: Any, columns: int = 2) -> list[tuple[str, ...]]:
    """The table rows of a display (or its text): ``(*values, line, code)``, headers dropped."""
    out = []
    for text in (stats if isinstance(stats, str) else repr(stats)).splitlines():
        parts = text.split(None, columns + 1)
        if len(parts) == columns + 2 and parts[columns].isdigit():
            out.append(tuple(parts))
    return out


def run(ip: Any, cell: str) -> tuple[Any, Any]:
    """Run ``cell`` and return (its result, what it printed and displayed)."""
    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


def test_load_ext_registers_the_magics(ip: Any) -> None:
    magics = ip.magics_manager.magics
    assert "mlrun" in magics["line"] and "mlrun" in magics["cell"] and "memreport" in magics["line"]
    # %load_ext memlab calls memlab.load_ipython_extension, defined so that importing memlab does
    # not import IPython (tests/test_import.py checks that in a fresh interpreter).
    assert memlab.load_ipython_extension.__module__ == "memlab"


def test_cell_magic_profiles_a_function_defined_in_the_cell(ip: Any) -> None:
    trace = sys.gettrace()
    result, _ = run(ip, "%%mlrun -f work\n" + WORK_CELL)
    assert sys.gettrace() is trace and memlab.sources.tracker.active_tracker() is None
    assert result.error_in_exec is None
    source, table = repr(result.result).split("\n\n", 1)
    assert source == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        "(memlab.TensorTracker); no tensors existed before profiling"
    )
    cell_file = ip.user_ns["work"].__code__.co_filename  # IPython's name for the cell, as tracebacks show it
    assert table.startswith(f"## work  ({cell_file}:2)\n")
    assert rows(result.result) == WORK_ROWS


def test_result_renders_as_html_in_notebooks_and_as_text_in_terminals(ip: Any) -> None:
    result, _ = run(ip, "%%mlrun -f work\n" + WORK_CELL)
    html = result.result._repr_html_()
    assert "<table" in html and "return a + b" in html
    assert [size in html for size in ("4.00M", "8.00M", "12.00M", "20.00M")] == [True] * 4
    assert "<table" not in repr(result.result)


def test_line_magic_runs_the_rest_of_the_line_as_written(ip: Any) -> None:
    run(ip, WORK_CELL.removesuffix("work()\n"))  # defines work(), keeps no result
    result, _ = run(ip, '%mlrun -f work x = work(); y = "a  b"  # comment')
    assert ip.user_ns["y"] == "a  b"
    assert tuple(ip.user_ns["x"].shape) == (1024, 1024)
    assert rows(result.result) == WORK_ROWS


def test_a_function_redefined_by_the_cell_is_shown_once(ip: Any) -> None:
    run(ip, "%%mlrun -f work\n" + WORK_CELL)
    result, _ = run(ip, "%%mlrun -f work\n" + WORK_CELL)
    assert repr(result.result).count("## ") == 1
    assert rows(result.result) == WORK_ROWS


def test_methods_and_module_functions_by_name(ip: Any, tmp_path: Any, monkeypatch: Any) -> None:
    (tmp_path / "memlab_magic_mod.py").write_text(
        "import torch\n\ndef make():\n    return torch.empty(256)\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cell = textwrap.dedent(
        """\
        import torch, memlab_magic_mod
        class Net:
            def step(self):
                return torch.empty(1024, 256)
        Net().step(); memlab_magic_mod.make()
        """
    )
    result, _ = run(ip, "%%mlrun -f Net.step -f memlab_magic_mod:make\n" + cell)
    text = repr(result.result)
    assert text.index("## Net.step") < text.index("## make")
    assert rows(result.result) == [
        ("0.00B", "0.00B", "3", "def step(self):"),
        ("1.00M", "2.00M", "4", "return torch.empty(1024, 256)"),
        ("0.00B", "2.00M", "3", "def make():"),  # the freed 1 MiB block's segment stays cached
        ("1.00K", "2.00M", "4", "return torch.empty(256)"),
    ]
    monkeypatch.delitem(sys.modules, "memlab_magic_mod")


def test_extra_columns_and_no_defaults(ip: Any) -> None:
    result, _ = run(ip, "%%mlrun -D -c allocated_bytes.all.current -c hits -f work\n" + WORK_CELL)
    header = repr(result.result).splitlines()[4]
    assert header.split() == ["allocated_bytes", "hits", "line", "code"]
    assert rows(result.result) == [
        ("0.00B", "1", "2", "def work():"),
        ("4.00M", "1", "3", "a = torch.empty(1024, 1024)"),
        ("8.00M", "1", "4", "b = torch.empty(1024, 1024)"),
        ("12.00M", "1", "5", "return a + b"),
    ]


def test_dump_profile_writes_the_text_shown(ip: Any, tmp_path: Any) -> None:
    path = tmp_path / "profile.txt"
    result, _ = run(ip, f"%%mlrun -c requested_bytes.all.peak -T {path} -f work\n" + WORK_CELL)
    assert path.read_text(encoding="utf-8") == repr(result.result)
    assert "requested_bytes" in path.read_text(encoding="utf-8")
    assert rows(result.result, 3)[-1] == ("12.00M", "20.00M", "12.00M", "5", "return a + b")


def test_quiet_prints_and_returns_nothing_but_still_dumps(ip: Any, tmp_path: Any) -> None:
    path = tmp_path / "quiet.txt"
    result, captured = run(ip, f"%%mlrun -q -T {path} -f work\n" + WORK_CELL)
    assert result.result is None
    assert (captured.stdout, captured.stderr, captured.outputs) == ("", "", [])
    assert rows(path.read_text(encoding="utf-8")) == WORK_ROWS


def test_return_profiler_shows_the_table_and_returns_the_profiler(ip: Any) -> None:
    result, captured = run(ip, "%%mlrun -r -f work\n" + WORK_CELL)
    assert isinstance(result.result, memlab.LineProfiler)
    assert len(captured.outputs) == 1 and rows(captured.outputs[0].data["text/plain"]) == WORK_ROWS
    frame = result.result.to_dataframe()
    assert frame["active_bytes.all.peak"].tolist() == [0, 4 * 2**20, 8 * 2**20, 12 * 2**20]
    quiet, captured = run(ip, "%%mlrun -r -q -f work\n" + WORK_CELL)
    assert isinstance(quiet.result, memlab.LineProfiler) and captured.outputs == []


def test_device_by_index_or_string_measures_the_same_on_cpu(ip: Any) -> None:
    by_index, _ = run(ip, "%%mlrun -g 0 -f work\n" + WORK_CELL)
    by_string, _ = run(ip, "%%mlrun -g cpu -f work\n" + WORK_CELL)
    assert rows(by_index.result) == rows(by_string.result) == WORK_ROWS


def test_time_column(ip: Any) -> None:
    result, _ = run(ip, "%%mlrun -D -c time -c active_bytes.all.peak -f work\n" + WORK_CELL)
    assert repr(result.result).splitlines()[4].split() == ["time", "active_bytes", "line", "code"]
    shown = rows(result.result)
    assert [row[1:] for row in shown] == [row[:1] + row[2:] for row in WORK_ROWS]
    assert all(re.fullmatch(r"\d+ns|\d+\.\d\d(us|ms|s)", row[0]) for row in shown)


def test_a_cell_that_raises_shows_the_table_so_far(ip: Any) -> None:
    cell = "import torch\ndef work():\n    a = torch.empty(1024, 1024)\n    return 1 / 0\nwork()\n"
    result, captured = run(ip, "%%mlrun -f work\n" + cell)
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    shown = captured.outputs[0].data["text/plain"]
    assert "4.00M" in shown and "return 1 / 0" in shown


@pytest.mark.parametrize(
    ("line", "cell", "named"),
    [
        ("-f nope x = 1", None, "nope"),
        ("-f torch x = 1", None, "torch"),
        ("-f work -c bogus work()", None, "bogus"),
        ("-f work", None, "statement"),
        ("-f work", "\n", "statement"),
        ("-f work x = 1", "work()", "first line"),
        ("x = 1", None, "-f FUNC"),
        ("-f 'a b' x = 1", None, "a b"),
        ("-g bogus -f work work()", None, "-g 'bogus' is not a device; valid: 'cpu', 'meta', 'cuda'"),
        ("-g mps -f work work()", None, "-g mps: this torch cannot use it here ("),
        ("-z -f work work()", None, "-z"),
        ("-D -f work work()", None, "-c COL"),
    ],
)
def test_usage_errors_are_one_line(ip: Any, line: str, cell: str | None, named: str) -> None:
    run(ip, WORK_CELL)
    with pytest.raises(UsageError) as error:
        if cell is None:
            ip.run_line_magic("mlrun", line)
        else:
            ip.run_cell_magic("mlrun", line, cell)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_an_unknown_name_is_reported_after_the_cell_ran(ip: Any) -> None:
    result, captured = run(ip, "%mlrun -f nope x = 1")
    assert isinstance(result.error_in_exec, UsageError) and "nope" in str(result.error_in_exec)
    assert ip.user_ns["x"] == 1
    assert "Traceback" not in captured.stdout + captured.stderr


def test_memreport_names_the_model_and_optimizer_state(ip: Any) -> None:
    run(
        ip,
        "import torch\nlin = torch.nn.Linear(1024, 1024)\nopt = torch.optim.AdamW(lin.parameters())\n"
        "lin(torch.ones(1, 1024)).sum().backward(); opt.step()\n",
    )
    _, captured = run(ip, "%memreport lin")
    lines = [line.split() for line in captured.stdout.splitlines()]
    assert ["weight", "(1024,", "1024)", "4.00M"] in lines
    assert ["bias.grad", "(1024,)", "4.00K"] in lines
    assert ["AdamW.weight.exp_avg_sq", "(1024,", "1024)", "4.00M"] in lines


def test_memreport_verbose_shows_sharing(ip: Any) -> None:
    run(ip, "import torch\nlin = torch.nn.Linear(4, 4)\nrow = lin.weight[0]\n")
    _, plain = run(ip, "%memreport lin")
    _, verbose = run(ip, "%memreport -v -d cpu lin")
    assert "(->weight)" in verbose.stdout and "(->weight)" not in plain.stdout


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("nope", "nope"),
        ("opt", "torch.nn.Module"),
        ("-d bogus lin", "-d 'bogus' is not a device; valid: 'cpu', 'meta', 'cuda', 'cuda:1', a CUDA index"),
    ],
)
def test_memreport_usage_errors(ip: Any, line: str, named: str) -> None:
    run(ip, "import torch\nlin = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(lin.parameters())\n")
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("memreport", line)
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("line", "statement"),
    [
        ("-f f x = f(2)", "x = f(2)"),
        ("-f f   x  =  f( 2 )  ", "x  =  f( 2 )"),
        ("-qf f f()", "f()"),
        ("-fwork -rq work()", "work()"),
        ('-T "my file.txt" -f f f()', "f()"),
        ("--function=f --quiet f()", "f()"),
        ('-f f print("it\'s")', 'print("it\'s")'),
        ("-f f -- -x", "-x"),
        ("-f f print('\\'')", "print('\\'')"),  # shlex finds no closing quote: the statement's own
        ("-f f", ""),
        ("", ""),
    ],
)
def test_split_statement_keeps_the_statement_verbatim(line: str, statement: str) -> None:
    options, rest = split_statement(line)
    assert rest == statement
    assert line.startswith(options)


def test_mlrun_snapshot_writes_the_cells_memory_snapshot(ip: Any, tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "cell.pickle"
    result, _ = run(ip, f"%%mlrun --snapshot {path} -f work\n" + WORK_CELL)
    assert result.error_in_exec is None
    with open(path, "rb") as file:
        snapshot = pickle.load(file)
    assert [s["total_size"] for s in snapshot["segments"]] == [20 * 1024 * 1024]
    assert [e["action"] for e in snapshot["device_traces"][0]].count("alloc") == 3  # a, b, a + b
    assert snapshot["device_traces"][0][1]["frames"][0]["line"] == 3  # a = torch.empty(...)


def test_mlrun_snapshot_bad_path_is_a_usage_error(ip: Any, tmp_path: Path) -> None:
    run(ip, WORK_CELL)
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("mlrun", f"--snapshot {tmp_path}/out.png -f work work()")
    assert str(error.value) == f"--snapshot {tmp_path}/out.png: write to a file ending in .pickle, .pkl"


def test_mlrun_plot_writes_the_cells_memory_plot(ip: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "cell.png"
    result, _ = run(ip, f"%%mlrun --plot {path} -f work\n" + WORK_CELL)
    assert result.error_in_exec is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mlrun_plot_bad_path_is_a_usage_error(ip: Any, tmp_path: Path) -> None:
    run(ip, WORK_CELL)
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("mlrun", f"--plot {tmp_path}/out.pickle -f work work()")
    assert str(error.value) == f"--plot {tmp_path}/out.pickle: write to a file ending in .png, .svg, .pdf"


def test_a_gpu_index_that_does_not_exist_is_a_usage_error_not_the_cpu(ip: Any) -> None:
    run(ip, WORK_CELL)
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("mlrun", "-g 99 -f work work()")
    assert str(error.value).startswith("-g 99: no such GPU (this machine has ")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("folder", "-T {tmp}/folder: is a folder; name a file to write in it"),
        ("gone/profile.txt", "-T {tmp}/gone/profile.txt: no such folder '{tmp}/gone'"),
    ],
)
def test_mlrun_dump_profile_path_is_checked_before_the_code_runs(
    ip: Any, tmp_path: Path, target: str, message: str
) -> None:
    (tmp_path / "folder").mkdir()
    run(ip, WORK_CELL + "ran = []\n")
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("mlrun", f"-T {tmp_path}/{target} -f work ran.append(work())")
    assert str(error.value) == message.format(tmp=tmp_path)
    assert ip.user_ns["ran"] == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux): always full")
def test_mlrun_shows_the_table_when_dump_profile_cannot_be_written(ip: Any, tmp_path: Path) -> None:
    full = tmp_path / "full.txt"
    full.symlink_to("/dev/full")
    result, captured = run(ip, f"%%mlrun -T {full} -f work\n" + WORK_CELL)
    assert result.error_in_exec is None
    assert rows(result.result) == WORK_ROWS
    assert captured.stderr == f"memlab: could not write -T {full}: [Errno 28] No space left on device\n"


def test_load_ipython_extension_needs_the_shell() -> None:
    with pytest.raises(TypeError) as error:
        memlab.load_ipython_extension(5)
    assert str(error.value) == (
        "ipython must be the IPython shell (get_ipython(), or what %load_ext memlab passes), got int 5"
    )


MODEL_CELL = """\
import torch
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU())
def work():
    model(torch.randn(64, 256)).sum().backward()
work()
"""
# The module table of MODEL_CELL on CPU (the CUDA allocator model): a 1 MiB weight and a 4 KiB bias,
# the batch (64 KiB, saved by the Linear), its output and the ReLU's (256 KiB each, the ReLU saves its own),
# and the modelled H100's 32 MiB cuBLAS workspaces: the forward thread's from the Linear's forward on,
# the autograd thread's from the Linear's backward on.
MODULE_ROWS = [
    "module  type        calls  forward  backward  parameter  gradient  optimizer  activation",
    "(root)  Sequential      1   33.57M    66.32M      0.00B     0.00B      0.00B       0.00B",
    "0       Linear          1   33.32M    66.32M      1.00M     1.00M      0.00B      64.00K",
    "1       ReLU            1   33.57M    33.57M      0.00B     0.00B      0.00B     256.00K",
]


def test_by_module_shows_the_memory_per_module_without_naming_a_function(ip: Any) -> None:
    result, captured = run(ip, "%%mlrun --by-module\n" + MODEL_CELL)
    assert result.error_in_exec is None and result.result is None
    (shown,) = captured.outputs
    assert shown.data["text/plain"].splitlines()[0] == "memory per module on cpu, highest peak first"
    assert shown.data["text/plain"].splitlines()[3:] == MODULE_ROWS
    assert not torch_module_hooks()


def test_by_module_with_functions_shows_both_tables(ip: Any) -> None:
    result, captured = run(ip, "%%mlrun -f work --by-module\n" + MODEL_CELL)
    assert rows(result.result) == [  # the line's peak is the model's backward peak
        ("1.00M", "2.00M", "3", "def work():"),
        ("66.32M", "68.00M", "4", "model(torch.randn(64, 256)).sum().backward()"),  # two 32 MiB workspaces
    ]
    (shown,) = captured.outputs
    assert shown.data["text/plain"].splitlines()[3:] == MODULE_ROWS
    quiet, captured = run(ip, "%%mlrun -q --by-module\n" + MODEL_CELL)
    assert quiet.result is None and captured.outputs == []


def torch_module_hooks() -> dict[int, Any]:
    import torch

    return dict(torch.nn.modules.module._global_forward_pre_hooks)


def test_mlrun_dump_profile_on_a_full_disk_leaves_the_previous_file(
    ip: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    dumped = tmp_path / "table.txt"
    dumped.write_text("the previous table\n", encoding="utf-8")
    FullDisk(tmp_path, room=50).install(monkeypatch)
    result, captured = run(ip, f"%%mlrun -T {dumped} -f work\n" + WORK_CELL)
    monkeypatch.undo()
    assert result.error_in_exec is None
    assert rows(result.result) == WORK_ROWS
    assert captured.stderr == f"memlab: could not write -T {dumped}: [Errno 28] No space left on device\n"
    assert os.listdir(tmp_path) == ["table.txt"]
    assert dumped.read_text(encoding="utf-8") == "the previous table\n"
