"""Every public function (``memlab.__all__`` and the API DESIGN.md and the README document) and every
``memlab`` subcommand, called with wrong types, values and paths.

Python: a ``TypeError`` or ``ValueError`` (``FileNotFoundError`` for a file to read that is missing)
raised by one of memlab's own ``raise`` statements, never an error from deep inside, whose message
says which argument was wrong. Command line: status 2 and one line on stderr that names the option
or value, never a traceback, before anything runs. A new public function belongs in these tables.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
import memlab.distributed
from memlab.cli import main
from memlab.line_profiler import decorators, read_csv, read_json

MEMLAB = os.path.dirname(memlab.__file__)


def work(n: int) -> torch.Tensor:
    return torch.empty(n)


def loss_fn(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def generator() -> Any:
    yield 1


class Made:
    """The objects whose methods the table calls, made once, and a folder with files in it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.lp = memlab.LineProfiler(work)
        with self.lp:
            work(10)
        self.tracker = memlab.TensorTracker(history=True)
        with self.tracker:
            self.kept = torch.empty(10)
        self.allocator = memlab.CachingAllocatorModel()
        self.reporter = memlab.MemReporter()
        self.snapshot = self.reporter.snapshot()
        self.diff = self.reporter.diff(self.snapshot)
        self.estimate = memlab.estimate(work, 16)
        (tmp / "table.csv").write_text("a,b\n1,2\n", encoding="utf-8")
        (tmp / "data.pickle").write_bytes(pickle.dumps({"not": "a snapshot"}))
        (tmp / "folder").mkdir()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    return Made(tmp_path_factory.mktemp("bad_inputs"))


# (call, error type, what the message starts with or contains: names the argument; {tmp} is the folder)
Case = tuple[Callable[[Made], Any], type[Exception], str]
API: dict[str, Case] = {
    # line profiling
    "LineProfiler(5)": (
        lambda m: memlab.LineProfiler(5),
        TypeError,
        "add_function() needs a Python function",
    ),
    "LineProfiler(target_gpu=1.5)": (
        lambda m: memlab.LineProfiler(target_gpu=1.5),
        TypeError,
        "target_gpu must be",
    ),
    "LineProfiler(target_gpu='tpu:x')": (
        lambda m: memlab.LineProfiler(target_gpu="tpu:x"),
        ValueError,
        "target_gpu 'tpu:x' is not a device",
    ),
    "LineProfiler(source='gpu')": (lambda m: memlab.LineProfiler(source="gpu"), ValueError, "source must be"),
    "LineProfiler(columns=5)": (lambda m: memlab.LineProfiler(columns=5), TypeError, "columns must be"),
    "LineProfiler(columns=['peak'])": (
        lambda m: memlab.LineProfiler(columns=["peak"]),
        ValueError,
        "unknown column 'peak'",
    ),
    "lp.add_function(5)": (
        lambda m: m.lp.add_function(5),
        TypeError,
        "add_function() needs a Python function",
    ),
    "lp.display(columns=5)": (lambda m: m.lp.display(columns=5), TypeError, "columns must be"),
    "lp.print_stats(stream=5)": (
        lambda m: m.lp.print_stats(stream=5),
        TypeError,
        "stream must be None or a text",
    ),
    "lp.to_json(5)": (lambda m: m.lp.to_json(5), TypeError, "path_or_buf must be None, a file path"),
    "lp.to_json(missing folder)": (
        lambda m: m.lp.to_json(m.tmp / "gone" / "p.json"),
        ValueError,
        "path_or_buf {tmp}/gone/p.json: no such folder '{tmp}/gone'",
    ),
    "lp.to_csv(folder)": (
        lambda m: m.lp.to_csv(m.tmp / "folder"),
        ValueError,
        "path_or_buf {tmp}/folder: is a folder",
    ),
    "lp.plot(column=5)": (lambda m: m.lp.plot(column=5), TypeError, "column must be one statistic name"),
    "lp.plot(column='hits')": (
        lambda m: m.lp.plot(column="hits"),
        ValueError,
        "column 'hits' is not a statistic",
    ),
    "lp.plot(path=missing folder)": (
        lambda m: m.lp.plot(path=m.tmp / "gone" / "x.png"),
        ValueError,
        "path {tmp}/gone/x.png: no such folder '{tmp}/gone'",
    ),
    "lp.plot(path=5)": (lambda m: m.lp.plot(path=5), TypeError, "path must be a file path"),
    "read_json(5)": (lambda m: read_json(5), TypeError, "path_or_buf must be a path"),
    "read_json(a CSV)": (
        lambda m: read_json(m.tmp / "table.csv"),
        ValueError,
        "path_or_buf '{tmp}/table.csv' is not a memlab line profile",
    ),
    "read_json(a pickle)": (
        lambda m: read_json(m.tmp / "data.pickle"),
        ValueError,
        "path_or_buf '{tmp}/data.pickle' is not a memlab line profile",
    ),
    "read_csv(a pickle)": (
        lambda m: read_csv(m.tmp / "data.pickle"),
        ValueError,
        "path_or_buf '{tmp}/data.pickle' is not a memlab line profile CSV",
    ),
    "profile(5)": (lambda m: memlab.profile(5), TypeError, "add_function() needs a Python function"),
    "profile(columns=5)": (lambda m: memlab.profile(columns=5), TypeError, "columns must be"),
    "profile_every(0)": (
        lambda m: memlab.profile_every(0),
        ValueError,
        "output_interval must be a positive int",
    ),
    "profile_every('2')": (
        lambda m: memlab.profile_every("2"),
        TypeError,
        "output_interval must be a positive int",
    ),
    "profile_every(enable='yes')": (
        lambda m: memlab.profile_every(enable="yes"),
        TypeError,
        "enable must be True or False",
    ),
    "set_target_gpu(1.5)": (lambda m: memlab.set_target_gpu(1.5), TypeError, "target_gpu must be"),
    "set_target_gpu('tpu:x')": (lambda m: memlab.set_target_gpu("tpu:x"), ValueError, "target_gpu 'tpu:x'"),
    # memory sources
    "TensorTracker(allocator='x')": (
        lambda m: memlab.TensorTracker(allocator="x"),
        ValueError,
        "allocator must be",
    ),
    "TensorTracker(capacity='lots')": (
        lambda m: memlab.TensorTracker(capacity="lots"),
        ValueError,
        "capacity 'lots' is not a size",
    ),
    "TensorTracker(capacity=-1)": (
        lambda m: memlab.TensorTracker(capacity=-1),
        ValueError,
        "capacity must be >= 0",
    ),
    "TensorTracker(adopt='yes')": (
        lambda m: memlab.TensorTracker(adopt="yes"),
        TypeError,
        "adopt must be True",
    ),
    "TensorTracker(history='x')": (lambda m: memlab.TensorTracker(history="x"), TypeError, "history must be"),
    "TensorTracker(model=5)": (
        lambda m: memlab.TensorTracker(model=5),
        TypeError,
        "model must be a torch.nn",
    ),
    "TensorTracker(optimizer=5)": (
        lambda m: memlab.TensorTracker(optimizer=5),
        TypeError,
        "optimizer must be",
    ),
    "tracker.memory_stats(1.5)": (lambda m: m.tracker.memory_stats(1.5), TypeError, "device must be"),
    "tracker.adopt(category='weights')": (
        lambda m: m.tracker.adopt(category="weights"),
        ValueError,
        "category must be one of unknown, parameter",
    ),
    "tracker.adopt(category=5)": (
        lambda m: m.tracker.adopt(category=5),
        ValueError,
        "category must be one of",
    ),
    "tracker.adopt(roots=5)": (lambda m: m.tracker.adopt(roots=5), TypeError, "roots must be None"),
    "tracker.adopt(device='tpu:x')": (
        lambda m: m.tracker.adopt(device="tpu:x"),
        ValueError,
        "device 'tpu:x'",
    ),
    "tracker.add_model(5)": (lambda m: m.tracker.add_model(5), TypeError, "model must be a torch.nn.Module"),
    "tracker.add_optimizer(5)": (lambda m: m.tracker.add_optimizer(5), TypeError, "optimizer must be"),
    "tracker.snapshot(device=1.5)": (lambda m: m.tracker.snapshot(device=1.5), TypeError, "device must be"),
    "tracker.by_category(at='x')": (lambda m: m.tracker.by_category(at="x"), ValueError, "at must be one of"),
    "tracker.allocation_context(5)": (
        lambda m: m.tracker.allocation_context(5),
        TypeError,
        "tensor must be a torch.Tensor",
    ),
    "tracker.block_address(5)": (
        lambda m: m.tracker.block_address(5),
        TypeError,
        "tensor must be a torch.Tensor",
    ),
    "tracker.sampler(['x'])": (lambda m: m.tracker.sampler(["x"]), ValueError, "unknown statistic 'x'"),
    "tracker.max_memory_allocated('tpu:x')": (
        lambda m: m.tracker.max_memory_allocated("tpu:x"),
        ValueError,
        "device 'tpu:x'",
    ),
    "CachingAllocatorModel(capacity='lots')": (
        lambda m: memlab.CachingAllocatorModel(capacity="lots"),
        ValueError,
        "capacity 'lots'",
    ),
    "CachingAllocatorModel(config=5)": (
        lambda m: memlab.CachingAllocatorModel(config=5),
        TypeError,
        "config must be",
    ),
    "CachingAllocatorModel(config='bogus:1')": (
        lambda m: memlab.CachingAllocatorModel(config="bogus:1"),
        ValueError,
        "allocator config 'bogus:1': unknown option 'bogus'",
    ),
    "allocator.malloc('x')": (lambda m: m.allocator.malloc("x"), TypeError, "nbytes must be"),
    "allocator.malloc(-1)": (lambda m: m.allocator.malloc(-1), ValueError, "nbytes must be >= 0"),
    "allocator.free(12345)": (lambda m: m.allocator.free(12345), ValueError, "unknown handle 12345"),
    "allocator.history_snapshot('x')": (
        lambda m: m.allocator.history_snapshot("x"),
        TypeError,
        "device must be a CUDA device index",
    ),
    # MemReporter
    "MemReporter(5)": (lambda m: memlab.MemReporter(5), TypeError, "model must be a torch.nn.Module"),
    "MemReporter(pre_collect='x')": (
        lambda m: memlab.MemReporter(pre_collect="x"),
        TypeError,
        "pre_collect must be True or False, got str 'x'",
    ),
    "MemReporter(device_model='x')": (
        lambda m: memlab.MemReporter(device_model="x"),
        ValueError,
        "device_model",
    ),
    "MemReporter(tracker=5)": (lambda m: memlab.MemReporter(tracker=5), TypeError, "tracker must be"),
    "reporter.add_optimizer(5)": (lambda m: m.reporter.add_optimizer(5), TypeError, "optimizer must be"),
    "reporter.report(stream=5)": (
        lambda m: m.reporter.report(stream=5),
        TypeError,
        "stream must be None or a text stream with a write() method",
    ),
    "reporter.report(verbose='yes')": (
        lambda m: m.reporter.report(verbose="yes"),
        TypeError,
        "verbose must be True or False",
    ),
    "reporter.report(device='tpu:x')": (
        lambda m: m.reporter.report(device="tpu:x"),
        ValueError,
        "device 'tpu:x'",
    ),
    "reporter.report(source=5)": (lambda m: m.reporter.report(source=5), TypeError, "source must have"),
    "reporter.diff(5)": (
        lambda m: m.reporter.diff(5),
        TypeError,
        "before must be a TensorSnapshot (from MemReporter.snapshot()), got int 5",
    ),
    "reporter.diff(snapshot, 5)": (
        lambda m: m.reporter.diff(m.snapshot, 5),
        TypeError,
        "after must be a TensorSnapshot (from MemReporter.snapshot()) or None (now), got int 5",
    ),
    "reporter.to_dataframe(verbose=5)": (
        lambda m: m.reporter.to_dataframe(verbose=5),
        TypeError,
        "verbose must",
    ),
    "snapshot.report(stream=5)": (lambda m: m.snapshot.report(stream=5), TypeError, "stream must be"),
    "diff.report(stream=5)": (lambda m: m.diff.report(stream=5), TypeError, "stream must be"),
    # Courtesy
    "Courtesy(device=1.5)": (lambda m: memlab.Courtesy(device=1.5), TypeError, "device must be"),
    "Courtesy(device='tpu:x')": (lambda m: memlab.Courtesy(device="tpu:x"), ValueError, "device 'tpu:x'"),
    "Courtesy(offload=5)": (lambda m: memlab.Courtesy(device="cpu", offload=5), TypeError, "offload must be"),
    "Courtesy(offload=missing folder)": (
        lambda m: memlab.Courtesy(device="cpu", offload=str(m.tmp / "gone")),
        ValueError,
        "offload='{tmp}/gone' is neither 'cpu' nor an existing directory",
    ),
    # snapshots and plots
    "dump_snapshot(5, tracker)": (
        lambda m: memlab.dump_snapshot(5, m.tracker),
        TypeError,
        "path must be a file",
    ),
    "dump_snapshot(folder, tracker)": (
        lambda m: memlab.dump_snapshot(m.tmp / "folder", m.tracker),
        ValueError,
        "path {tmp}/folder: is a folder",
    ),
    "dump_snapshot(missing folder, tracker)": (
        lambda m: memlab.dump_snapshot(m.tmp / "gone" / "s.pickle", m.tracker),
        ValueError,
        "path {tmp}/gone/s.pickle: no such folder '{tmp}/gone'",
    ),
    "dump_snapshot(path, 5)": (
        lambda m: memlab.dump_snapshot(m.tmp / "s.pickle", 5),
        TypeError,
        "tracker must be a memlab.TensorTracker, a CachingAllocatorModel or ExactAllocator, or None",
    ),
    "dump_snapshot(path) with no tracker active": (
        lambda m: memlab.dump_snapshot(m.tmp / "s.pickle"),
        ValueError,
        "no TensorTracker is active: pass tracker=",
    ),
    "plot_memory(5)": (lambda m: memlab.plot_memory(5), TypeError, "source must be a memlab.TensorTracker"),
    "plot_memory(missing pickle)": (
        lambda m: memlab.plot_memory(m.tmp / "none.pickle"),
        FileNotFoundError,
        "no such snapshot: '{tmp}/none.pickle'",
    ),
    "plot_memory(a CSV)": (
        lambda m: memlab.plot_memory(m.tmp / "table.csv"),
        ValueError,
        "source '{tmp}/table.csv' is not a memory snapshot pickle",
    ),
    "plot_memory(a folder)": (
        lambda m: memlab.plot_memory(str(m.tmp / "folder")),
        ValueError,
        "source '{tmp}/folder' is a folder",
    ),
    "plot_memory(snapshot, device='x')": (
        lambda m: memlab.plot_memory(m.tracker.snapshot(), device="x"),
        TypeError,
        "device must be None or an index into the snapshot's device_traces",
    ),
    "plot_memory(tracker, path=missing folder)": (
        lambda m: memlab.plot_memory(m.tracker, m.tmp / "gone" / "p.png"),
        ValueError,
        "path {tmp}/gone/p.png: no such folder",
    ),
    # will it fit
    "estimate(5)": (lambda m: memlab.estimate(5), TypeError, "fn must be callable"),
    "estimate(device='tpu:x')": (
        lambda m: memlab.estimate(work, 4, device="tpu:x"),
        ValueError,
        "device 'tpu:x'",
    ),
    "estimate.by_category(at='x')": (
        lambda m: m.estimate.by_category(at="x"),
        ValueError,
        "at must be one of",
    ),
    "estimate.fits('lots')": (lambda m: m.estimate.fits("lots"), ValueError, "budget 'lots' is not a size"),
    "estimate.fits(1, headroom=-1)": (
        lambda m: m.estimate.fits(1, headroom=-1),
        ValueError,
        "headroom must be",
    ),
    "estimate.line_profile(5)": (lambda m: m.estimate.line_profile(5), TypeError, "add_function() needs"),
    "max_batch_size(5, f)": (lambda m: memlab.max_batch_size(5, work), TypeError, "step must be callable"),
    "max_batch_size(f, 5)": (
        lambda m: memlab.max_batch_size(work, 5),
        TypeError,
        "make_batch must be callable",
    ),
    "max_batch_size(budget='lots')": (
        lambda m: memlab.max_batch_size(work, int, "lots"),
        ValueError,
        "budget 'lots' is not a size",
    ),
    "max_batch_size(low=0)": (
        lambda m: memlab.max_batch_size(work, int, "1 GiB", low=0),
        ValueError,
        "low must be",
    ),
    "max_batch_size(low='1')": (
        lambda m: memlab.max_batch_size(work, int, "1 GiB", low="1"),
        TypeError,
        "low must be an int",
    ),
    "max_batch_size(high below low)": (
        lambda m: memlab.max_batch_size(work, int, "1 GiB", low=4, high=2),
        ValueError,
        "high must be >= 4",
    ),
    "max_batch_size(headroom=-1)": (
        lambda m: memlab.max_batch_size(work, int, "1 GiB", headroom=-1),
        ValueError,
        "headroom must be >= 0",
    ),
    "max_batch_size(device=1.5)": (
        lambda m: memlab.max_batch_size(work, int, "1 GiB", device=1.5),
        TypeError,
        "device must be",
    ),
    "autobatch(5)": (lambda m: memlab.autobatch(5), TypeError, "autobatch wraps a loss function"),
    "autobatch(batch_dim=-1)": (
        lambda m: memlab.autobatch(loss_fn, batch_dim=-1),
        ValueError,
        "batch_dim must be",
    ),
    "autobatch(budget='lots')": (
        lambda m: memlab.autobatch(loss_fn, budget="lots"),
        ValueError,
        "budget 'lots'",
    ),
    "autobatch(micro_batch=0)": (
        lambda m: memlab.autobatch(loss_fn, micro_batch=0),
        ValueError,
        "micro_batch must",
    ),
    "autobatch(f)(5)": (
        lambda m: memlab.autobatch(loss_fn)(5),
        TypeError,
        "was called without a tensor argument that has a dimension 0 (batch_dim) to split",
    ),
    "autobatch(f)(a scalar tensor)": (
        lambda m: memlab.autobatch(loss_fn)(torch.tensor(1.0)),
        TypeError,
        "(batch_dim) to split",
    ),
    # why did it run out of memory
    "explain_oom(5)": (lambda m: memlab.explain_oom(5), TypeError, "explain_oom takes a function to watch"),
    "explain_oom()(a generator function)": (
        lambda m: memlab.explain_oom()(generator),
        TypeError,
        "explain_oom watches plain functions; for generator",
    ),
    "explain_oom(batch_dim='0')": (
        lambda m: memlab.explain_oom(batch_dim="0"),
        TypeError,
        "batch_dim must be",
    ),
    "explain_oom(batch_dim=-1)": (
        lambda m: memlab.explain_oom(batch_dim=-1),
        ValueError,
        "batch_dim must be",
    ),
    "explain_oom(stream=5)": (
        lambda m: memlab.explain_oom(stream=5),
        TypeError,
        "stream must be None or a text",
    ),
    "explain_oom(snapshot_dir=5)": (
        lambda m: memlab.explain_oom(snapshot_dir=5),
        TypeError,
        "snapshot_dir must",
    ),
    "explain_oom(remedies='no')": (
        lambda m: memlab.explain_oom(remedies="no"),
        TypeError,
        "remedies must be True",
    ),
    # shells and beyond one process
    "load_ipython_extension(5)": (
        lambda m: memlab.load_ipython_extension(5),
        TypeError,
        "ipython must be the IPython shell",
    ),
    "distributed.gather(lp) without a process group": (
        lambda m: memlab.distributed.gather(m.lp),
        ValueError,
        "gather() needs torch.distributed's default process group",
    ),
}


def check_raised(error: BaseException, expected: type[Exception], message: str, tmp: Path) -> None:
    """``error`` is ``expected``, says ``message``, and was raised by a ``raise`` of memlab's own."""
    assert type(error) is expected, f"{type(error).__name__}: {error}"
    assert message.format(tmp=tmp) in str(error)
    where = traceback.extract_tb(error.__traceback__)[-1]
    assert where.filename.startswith(MEMLAB + os.sep), f"raised in {where.filename}:{where.lineno}"
    assert where.line is not None and where.line.startswith("raise "), f"{where.filename}:{where.lineno}"


@pytest.mark.parametrize("name", list(API))
def test_a_wrong_argument_is_a_typed_error_that_names_it(name: str, made: Made, monkeypatch: Any) -> None:
    monkeypatch.setattr(decorators, "_global", None)  # set_target_gpu and profile touch a fresh one
    call, expected, message = API[name]
    with pytest.raises(Exception) as raised:
        call(made)
    check_raised(raised.value, expected, message, made.tmp)


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    import torch.distributed as dist

    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "expected", "message"),
    [
        ({"source": 5}, TypeError, "source must be a memlab.LineProfiler, a memlab.TensorTracker or None"),
        ({"dst": 3}, ValueError, "dst must be a rank from 0 to 0, got 3"),
        ({"group": 5}, TypeError, "group must be None (the whole job) or a torch.distributed ProcessGroup"),
    ],
)
def test_gather_names_a_wrong_argument(
    one_rank: Any, made: Made, kwargs: dict[str, Any], expected: type[Exception], message: str
) -> None:
    arguments = {"source": made.lp, **kwargs}
    with pytest.raises(Exception) as raised:
        memlab.distributed.gather(**arguments)
    check_raised(raised.value, expected, message, made.tmp)


def test_the_table_covers_every_public_name() -> None:
    # Constants and classes memlab hands out (Estimate's methods are called on memlab.estimate's
    # result), and clear_global_line_profiler(), which takes no argument: nothing to pass wrong.
    nothing_to_pass = {"DEFAULT_COLUMNS", "STAT_KEYS", "__version__", "Estimate", "EstimateError"}
    called = {name.split("(")[0] for name in API} | {"clear_global_line_profiler"}
    assert [name for name in memlab.__all__ if name not in nothing_to_pass | called] == []
    assert {"lp.plot", "tracker.adopt", "reporter.diff", "estimate.fits", "distributed.gather"} <= called


SCRIPT = "import torch\nprint('the script ran')\n"
# (argv, what the one line on stderr contains), {script} and {tmp} filled in; nothing may run.
CLI: list[tuple[list[str], str]] = [
    ([], "memlab: error: name a COMMAND: run, estimate, viz, demo"),
    (["--bogus"], "memlab: error: unrecognized arguments: --bogus"),
    (["bogus"], "memlab: error: argument COMMAND: invalid choice: 'bogus'"),
    (["run"], "memlab run: error: name a script to run"),
    (["run", "{tmp}/none.py"], "memlab run: error: no such script: '{tmp}/none.py'"),
    (["run", "{tmp}/folder"], "memlab run: error: '{tmp}/folder' is a directory, not a script"),
    (["run", "-m", ""], "module ''"),
    (["run", "-m", "no_such_module_here"], "memlab run: error: no module named 'no_such_module_here'"),
    (["run", "-f", "1bad", "{script}"], "memlab run: error: -f: '1bad' is not a function name"),
    (["run", "-f", "", "{script}"], "memlab run: error: -f: '' is not a function name"),
    (["run", "-c", "peak", "{script}"], "memlab run: error: unknown column 'peak'"),
    (["run", "-c"], "memlab run: error: argument -c/--column: expected one argument"),
    (["run", "-D", "{script}"], "memlab run: error: -D hides the default columns"),
    (["run", "-g", "tpu:x", "{script}"], "memlab run: error: -g 'tpu:x' is not a device"),
    (["run", "-g", "1.5", "{script}"], "memlab run: error: -g '1.5' is not a device"),
    (["run", "-g", "-1", "{script}"], "memlab run: error: -g '-1' is not a device"),
    (
        ["run", "-o", "{tmp}/out.xlsx", "{script}"],
        "memlab run: error: -o {tmp}/out.xlsx: write to a file ending",
    ),
    (["run", "-o", "", "{script}"], "memlab run: error: -o is empty: name a file to write"),
    (["run", "-o", "{tmp}/folder.txt", "{script}"], "memlab run: error: -o {tmp}/folder.txt: is a folder"),
    (
        ["run", "-o", "{tmp}/gone/out.txt", "{script}"],
        "memlab run: error: -o {tmp}/gone/out.txt: no such folder",
    ),
    (["run", "--snapshot", "{tmp}/s.png", "{script}"], "memlab run: error: --snapshot {tmp}/s.png: write to"),
    (["run", "--snapshot", "", "{script}"], "memlab run: error: --snapshot is empty"),
    (
        ["run", "--snapshot", "{tmp}/gone/s.pickle", "{script}"],
        "memlab run: error: --snapshot {tmp}/gone/s.pickle",
    ),
    (
        ["run", "--plot", "{tmp}/p.gif", "{script}"],
        "memlab run: error: --plot {tmp}/p.gif: write to a file ending",
    ),
    (
        ["run", "--plot", "{tmp}/gone/p.png", "{script}"],
        "memlab run: error: --plot {tmp}/gone/p.png: no such",
    ),
    (["run", "--gather", "{script}"], "memlab run: error: --gather merges the ranks of a torchrun job"),
    (["run", "-x", "{script}"], "memlab: error: unrecognized arguments: -x"),
    (["viz"], "memlab viz: error: the following arguments are required: snapshot"),
    (["viz", "{tmp}/none.pickle"], "memlab viz: error: no such snapshot: '{tmp}/none.pickle'"),
    (
        ["viz", "{tmp}/folder"],
        "memlab viz: error: snapshot '{tmp}/folder' is a folder, not a snapshot pickle",
    ),
    (["viz", "{tmp}/table.csv"], "memlab viz: error: snapshot '{tmp}/table.csv' is not a memory snapshot"),
    (
        ["viz", "{tmp}/data.pickle"],
        "memlab viz: error: snapshot '{tmp}/data.pickle' is not a memory snapshot",
    ),
    (["viz", "{tmp}/data.pickle", "-o", ""], "memlab viz: error: -o is empty: name a file to write"),
    (["viz", "{tmp}/data.pickle", "-o", "{tmp}/v.png"], "memlab viz: error: -o {tmp}/v.png: write to a file"),
    (
        ["viz", "{tmp}/data.pickle", "-o", "{tmp}/gone/v.html"],
        "memlab viz: error: -o {tmp}/gone/v.html: no such",
    ),
    (
        ["demo", "--epochs", "x"],
        "memlab demo: error: argument --epochs: must be a whole number of at least 1",
    ),
    (
        ["demo", "--epochs", "0"],
        "memlab demo: error: argument --epochs: must be a whole number of at least 1",
    ),
    (["demo", "--device", "tpu:x"], "memlab demo: error: --device 'tpu:x' is not a device"),
    (["demo", "--device", "meta"], "memlab demo: error: --device meta: the example reads its loss values"),
    (["demo", "-c", "peak"], "memlab demo: error: unknown column 'peak'"),
    (["demo", "-D"], "memlab demo: error: -D hides the default columns"),
    (["demo", "-o", "{tmp}/out.xlsx"], "memlab demo: error: -o {tmp}/out.xlsx: write to a file ending in"),
    (["demo", "-o", "{tmp}/folder.txt"], "memlab demo: error: -o {tmp}/folder.txt: is a folder"),
    (["demo", "extra"], "memlab: error: unrecognized arguments: extra"),
    (["estimate"], "memlab estimate: error: the following arguments are required: CONFIG_OR_MODEL"),
    (["estimate", "{tmp}/none"], "memlab estimate: error: {tmp}/none: no such file or folder"),
    (["estimate", "{tmp}/folder"], "memlab estimate: error: {tmp}/folder: the folder holds no config.json"),
    (["estimate", "{tmp}/table.csv"], "memlab estimate: error: {tmp}/table.csv: not a JSON model config"),
    (["estimate", "{tmp}/folder", "--batch-size", "0"], "argument --batch-size: must be a whole number"),
    (["estimate", "{tmp}/folder", "--gpu", "X9000"], "memlab estimate: error: --gpu 'X9000' is not a GPU"),
    (["estimate", "{tmp}/folder", "--fsdp", "--ddp"], "argument --ddp: not allowed with argument --fsdp"),
]


@pytest.mark.parametrize(("argv", "message"), CLI, ids=[" ".join(argv) or "(nothing)" for argv, _ in CLI])
def test_a_wrong_option_is_one_line_and_status_2(
    argv: list[str], message: str, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(decorators, "_global", None)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder.txt").mkdir()
    (tmp_path / "table.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    (tmp_path / "data.pickle").write_bytes(pickle.dumps({"not": "a snapshot"}))
    try:
        status = main([arg.format(script=script, tmp=tmp_path) for arg in argv])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""  # nothing ran
    (line,) = captured.err.splitlines()
    assert line.startswith("memlab") and message.format(tmp=tmp_path) in line


def test_the_cli_table_covers_every_subcommand() -> None:
    from memlab.commands import COMMANDS

    assert {argv[0] for argv, _ in CLI if argv and not argv[0].startswith("-")} == {*COMMANDS, "bogus"}


# -- issue 25: numbers ----
def test_an_object_collective_that_needs_another_ranks_objects_names_itself_and_the_ranks() -> None:
    import torch.distributed as dist

    from memlab.distributed import FakeCollectiveError, fake_group

    with fake_group(4, rank=2):
        with pytest.raises(FakeCollectiveError) as broadcast:
            dist.broadcast_object_list([None, None], src=0)
        with pytest.raises(FakeCollectiveError) as scatter:
            dist.scatter_object_list([None], None, src=1)
        with pytest.raises(FakeCollectiveError) as receive:
            dist.recv_object_list([None])
        with pytest.raises(ValueError, match="source rank must provide non-None scatter_object_input_list"):
            dist.scatter_object_list([None], None, src=2)  # the source's own mistake: PyTorch's error
    assert str(broadcast.value) == (
        "torch.distributed.broadcast_object_list from rank 0 to rank 2 of a memlab fake_group of 4: the "
        "objects exist only in the process of rank 0, which a fake group does not run, so this rank cannot "
        "be given them; estimate rank 0 (fake_group(4, rank=0)), or give every rank the objects and skip "
        "the broadcast_object_list"
    )
    assert str(scatter.value).startswith("torch.distributed.scatter_object_list from rank 1 to rank 2 of")
    assert str(receive.value).startswith(
        "torch.distributed.recv_object_list from any rank to rank 2 of a memlab fake_group of 4: the objects "
        "exist only in the process of any rank"
    )


def test_an_fsdp2_model_sharded_in_a_fake_group_left_since_is_an_estimate_error() -> None:
    from torch.distributed.fsdp import fully_shard

    from memlab.distributed import fake_group

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    with fake_group(4, rank=2):
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        inside = memlab.estimate(lambda model, x: model(x).sum().backward(), model, torch.randn(2, 16))
    assert inside.peak_allocated > 0
    with pytest.raises(memlab.EstimateError) as error:
        memlab.estimate(lambda model, x: model(x).sum().backward(), model, torch.randn(2, 16))
    assert str(error.value) == (
        "cannot estimate the model (Sequential): it was sharded with fully_shard inside "
        "memlab.distributed.fake_group(4, rank=2), which has been left, so its process group no longer "
        "exists; call memlab.estimate inside the same `with fake_group(...)` block"
    )


@pytest.fixture
def forget_the_dummy_nested_tensor() -> Any:
    """PyTorch keeps, from the first nested jagged tensor of a process, a dummy one (two meta
    tensors): forgotten after the test, so that later tests that count the tensors alive before
    they profile do not find it."""
    yield
    from torch.nested._internal import nested_tensor

    nested_tensor._dummy_instance = None


@pytest.mark.usefixtures("forget_the_dummy_nested_tensor")
def test_numpy_of_a_nested_jagged_tensor_in_a_step_is_an_estimate_error_naming_the_line() -> None:
    def step(x: torch.Tensor) -> Any:
        nested = torch.nested.nested_tensor([x[:3], x[:5]], layout=torch.jagged)
        return nested.numpy()

    with pytest.raises(memlab.EstimateError) as error:
        memlab.estimate(step, torch.randn(8, 4))
    line = step.__code__.co_firstlineno + 2
    assert str(error.value) == (
        f".numpy() of a NestedTensor at {__file__}:{line}: return nested.numpy(): PyTorch makes NumPy arrays "
        "of plain tensors only ('.numpy() is not supported for tensor subclasses.'), so the step fails there "
        "on real tensors too; read a plain tensor instead (a nested tensor's .values() or .unbind(), a "
        "DTensor's .to_local())"
    )


@pytest.mark.usefixtures("forget_the_dummy_nested_tensor")
def test_a_nested_jagged_tensor_and_numpy_in_a_step_are_estimated() -> None:
    def step(x: torch.Tensor) -> Any:
        nested = torch.nested.nested_tensor([x[:3], x[:5]], layout=torch.jagged)
        return (nested * 2).values().detach().numpy().sum()

    estimate = memlab.estimate(step, torch.randn(8, 4))
    line = step.__code__.co_firstlineno + 2
    assert (estimate.method, estimate.forced_by) == ("fake", None)
    assert estimate.caveats == [
        f".numpy() at {__file__}:{line}: return (nested * 2).values().detach().numpy().sum() read values the "
        "estimate does not have: it gave zeros"
    ]
