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


def train(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


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
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        self.plan = memlab.plan(train, self.model, torch.ones(2, 4), budget="1 GiB")
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
    "plan(5, model)": (lambda m: memlab.plan(5, m.model), TypeError, "step must be callable"),
    "plan(f, tensor)": (
        lambda m: memlab.plan(train, torch.ones(2)),
        TypeError,
        "plan needs the model among the step's arguments",
    ),
    "plan(budget='lots')": (
        lambda m: memlab.plan(train, m.model, budget="lots"),
        ValueError,
        "budget 'lots' is not a size",
    ),
    "plan(steps=0)": (lambda m: memlab.plan(train, m.model, steps=0), ValueError, "steps must be"),
    "plan.apply(5)": (
        lambda m: m.plan.apply(5),
        TypeError,
        "apply takes the model (a torch.nn.Module), got int",
    ),
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
    nothing_to_pass = {"DEFAULT_COLUMNS", "STAT_KEYS", "__version__", "Estimate", "EstimateError", "Plan"}
    called = {name.split("(")[0] for name in API} | {"clear_global_line_profiler"}
    assert [name for name in memlab.__all__ if name not in nothing_to_pass | called] == []
    assert {"lp.plot", "tracker.adopt", "reporter.diff", "estimate.fits", "distributed.gather"} <= called


SCRIPT = "import torch\nprint('the script ran')\n"
# (argv, what the one line on stderr contains), {script} and {tmp} filled in; nothing may run.
CLI: list[tuple[list[str], str]] = [
    ([], "memlab: error: name a COMMAND: run, estimate, plan, viz, demo"),
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
    (["plan"], "memlab plan: error: the following arguments are required: CONFIG_OR_MODEL"),
    (
        ["plan", "{tmp}/folder", "--gradient-checkpointing"],
        "memlab plan: error: a plan chooses the blocks to checkpoint: leave out --gradient-checkpointing",
    ),
    (
        ["plan", "{tmp}/folder", "--gpu", "sm87"],
        "memlab plan: error: a plan needs a budget: --gpu sm87 gives",
    ),
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


# -- issue 25: messages ----

_GPU_VALID = (
    "valid: a GPU name (V100, V100-32GB, T4, A100, A100-40GB, A10G, RTX3090, L4, L40S, RTX4090, H100, "
    "H100-NVL, GH200, H200, B200), a compute capability ('sm90', (9, 0)) or None; the compute "
    "capabilities: sm35, sm37, sm50, sm52, sm53, sm60, sm61, sm62, sm70, sm72, sm75, sm80, sm86, sm87, "
    "sm89, sm90, sm100, sm103, sm110, sm120, sm121"
)


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ("sm99", "gpu 'sm99' is not the compute capability of any NVIDIA GPU; "),
        ((9, 9), "gpu (9, 9) is not the compute capability of any NVIDIA GPU; "),
        ("sm_91", "gpu 'sm_91' is not the compute capability of any NVIDIA GPU; "),
        ("H800", "gpu 'H800' is not a GPU memlab knows; "),
        ("RTX 4090 D", "gpu 'RTX 4090 D' is not a GPU memlab knows (it does not read 'D'); "),
        (
            "A100 64GB",
            "gpu 'A100 64GB': memlab knows the A100 with 80 GB (A100) or 40 GB (A100-40GB), not 64 GB; ",
        ),
        (
            "GH200 144G HBM3e",
            "gpu 'GH200 144G HBM3e': memlab knows the GH200 with 96 GB (GH200), not 144 GB; ",
        ),
        ("A100 80GB 40GB", "gpu 'A100 80GB 40GB' is not a GPU memlab knows (it does not read '40GB'); "),
    ],
)
def test_an_unknown_gpu_or_capability_is_a_value_error_listing_the_valid_ones(gpu: Any, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        memlab.estimate(work, 16, device="cuda", gpu=gpu)
    assert str(raised.value) == message + _GPU_VALID
    with pytest.raises(ValueError) as raised:
        memlab.TensorTracker(gpu=gpu)
    assert str(raised.value) == message + _GPU_VALID


@pytest.fixture
def ipython() -> Any:
    """IPython's test shell with memlab loaded and a model, a function and an optimizer defined."""
    from IPython.testing import globalipapp

    shell = globalipapp.get_ipython()
    shell.reset(new_session=False)
    shell.extension_manager.load_extension("memlab")
    shell.run_cell("import torch\nlin = torch.nn.Linear(4, 4)\ndef work():\n    return 1\n")
    yield shell
    shell.reset(new_session=False)


def _magic_error(shell: Any, magic: str, line: str) -> str:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError) as raised:
        shell.run_line_magic(magic, line)
    return str(raised.value)


def test_memreport_of_a_gpu_that_is_not_here_is_the_usage_error_of_mlrun(ipython: Any) -> None:
    assert not torch.cuda.is_available()
    memreport = _magic_error(ipython, "memreport", "-d cuda:7")
    mlrun = _magic_error(ipython, "mlrun", "-g cuda:7 -f work work()")
    assert mlrun == "-g cuda:7: no such GPU (this machine has no CUDA GPU); use 'cpu' or 'meta' to model one"
    assert memreport == mlrun.replace("-g cuda:7", "-d cuda:7")
    assert _magic_error(ipython, "memreport", "-d cuda:7 lin") == memreport


@pytest.mark.parametrize(
    ("magic", "line", "message"),
    [
        (
            "mlrun",
            '-f "train step',
            '%mlrun -f "train step: unbalanced quote (") in the options; close it or remove it',
        ),
        (
            "mlrun",
            "-f 'work work()",
            "%mlrun -f 'work work(): unbalanced quote (') in the options; close it or remove it",
        ),
        (
            "mlrun",
            "--function='work work()",
            "%mlrun --function='work work(): unbalanced quote (') in the options; close it or remove it",
        ),
        (
            "mlrun",
            '-f work -T "out.txt work()',
            '%mlrun -f work -T "out.txt work(): unbalanced quote (") in the options; close it or remove it',
        ),
        (
            "mlrun",
            "-f work -T \\",
            "%mlrun -f work -T \\: the \\ that ends the options escapes nothing; remove it",
        ),
        (
            "memreport",
            '"lin',
            '%memreport "lin: unbalanced quote (") in the arguments; close it or remove it',
        ),
        (
            "memreport",
            "-d 'cpu lin",
            "%memreport -d 'cpu lin: unbalanced quote (') in the arguments; close it or remove it",
        ),
    ],
)
def test_an_unbalanced_quote_in_a_magics_options_is_a_usage_error(
    ipython: Any, magic: str, line: str, message: str
) -> None:
    assert _magic_error(ipython, magic, line) == message


def test_memlab_run_dev_null_runs_as_python_does(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    import subprocess
    import sys

    monkeypatch.setattr(decorators, "_global", None)
    python = subprocess.run([sys.executable, os.devnull], capture_output=True, text=True, check=False)
    assert (python.returncode, python.stdout, python.stderr) == (0, "", "")
    empty = tmp_path / "empty.py"
    empty.write_bytes(b"")
    assert main(["run", str(empty)]) == 0
    as_empty_script = capsys.readouterr()
    assert main(["run", os.devnull]) == python.returncode
    assert capsys.readouterr() == as_empty_script
    assert as_empty_script.out == ""
    assert as_empty_script.err == (
        "memlab run: nothing was profiled: decorate functions with @memlab.profile or name them with -f\n"
    )


# -- issue 25: io ----------------------------------------------------------------------------------
# A snapshot pickle that would run a command, plot files with an extension matplotlib cannot save,
# and memlab viz's default output.
class RunsACommand:
    """What a hostile snapshot holds: unpickling it calls ``os.system`` (creates ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def hostile_pickles(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Pickles whose loading would create ``tmp/marker``, and the global each names: one written by
    pickle from a ``__reduce__`` (``os.system`` is ``posix.system`` on Linux, where it lives), one
    written by hand with protocol 0's ``GLOBAL os system``."""
    marker = tmp / "marker"
    reduced = tmp / "reduced.pickle"
    reduced.write_bytes(pickle.dumps({"segments": [], "device_traces": [[RunsACommand(marker)]]}))
    by_hand = tmp / "by_hand.pickle"
    by_hand.write_bytes(f"cos\nsystem\n(Vtouch {marker}\ntR.".encode())
    assert pickle.loads(by_hand.read_bytes()) == 0 and marker.exists()  # it does run, when unpickled
    marker.unlink()
    return {"reduced": (reduced, f"{os.system.__module__}.system"), "by hand": (by_hand, "os.system")}


def refused(name: str, path: Path, qualified: str) -> str:
    return (
        f"{name} '{path}' is refused: the pickle names the Python object {qualified}, which memlab does "
        "not load (nothing in the file was run; a memory snapshot holds only dicts, lists, strings and "
        "numbers)"
    )


@pytest.mark.parametrize("kind", ["reduced", "by hand"])
def test_plot_memory_refuses_a_pickle_that_would_run_a_command(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path, qualified = hostile_pickles(tmp_path)[kind]
    with pytest.raises(Exception) as raised:
        memlab.plot_memory(path)
    check_raised(raised.value, ValueError, refused("source", path, qualified), tmp_path)
    assert str(raised.value) == refused("source", path, qualified)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("kind", ["reduced", "by hand"])
def test_viz_refuses_a_pickle_that_would_run_a_command(kind: str, tmp_path: Path, capsys: Any) -> None:
    path, qualified = hostile_pickles(tmp_path)[kind]
    assert main(["viz", str(path), "-o", str(tmp_path / "page.html")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"memlab viz: error: {refused('snapshot', path, qualified)}\n"
    assert not (tmp_path / "marker").exists()
    assert sorted(os.listdir(tmp_path)) == ["by_hand.pickle", "reduced.pickle"]  # and no page


def test_a_pickle_of_any_other_object_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "tensor.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[torch.zeros(2)]]}))
    with pytest.raises(Exception) as raised:
        memlab.plot_memory(path)
    message = refused("source", path, "torch._utils._rebuild_tensor_v2")
    check_raised(raised.value, ValueError, message, tmp_path)
    assert str(raised.value) == message


def figure_extensions() -> str:
    """What matplotlib itself says it can save, as the message lists it."""
    from matplotlib.backend_bases import FigureCanvasBase

    return ", ".join(sorted(f".{e}" for e in FigureCanvasBase.get_supported_filetypes()))


@pytest.mark.parametrize("name", ["p.xyz", "p", "p.png.bak"])
def test_a_plot_path_matplotlib_cannot_save_is_refused_before_anything_is_drawn(
    name: str, made: Made, tmp_path: Path, monkeypatch: Any
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    import memlab.history.plot

    drawn: list[Any] = []
    monkeypatch.setattr(memlab.history.plot, "memory_series", lambda *a: drawn.append(a))
    monkeypatch.setattr(Figure, "__init__", lambda *a, **k: drawn.append("a figure"))
    expected = f"path {tmp_path}/{name}: write to a file ending in {figure_extensions()}"
    path = tmp_path / name
    for plot in (lambda: memlab.plot_memory(made.tracker, path), lambda: made.lp.plot(path=path)):
        with pytest.raises(Exception) as raised:
            plot()
        check_raised(raised.value, ValueError, expected, tmp_path)
        assert str(raised.value) == expected
    assert drawn == []
    assert os.listdir(tmp_path) == []


@pytest.fixture
def viz_folder(tmp_path: Path) -> Path:
    """A folder with a snapshot pickle, ``snapshot.pickle``."""
    with memlab.TensorTracker(history=True) as tracker:
        torch.empty(100)
    memlab.dump_snapshot(tmp_path / "snapshot.pickle", tracker)
    return tmp_path


def viz_error(argv: list[str], capsys: Any) -> str:
    assert main(["viz", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_viz_names_its_default_output_when_it_is_a_folder(viz_folder: Path, capsys: Any) -> None:
    (viz_folder / "snapshot.html").mkdir()
    assert viz_error([str(viz_folder / "snapshot.pickle")], capsys) == (
        f"memlab viz: error: default output {viz_folder}/snapshot.html: is a folder; name a file to write in "
        "it (the snapshot's name with .html; choose another with -o FILE)\n"
    )


def test_viz_names_its_default_output_when_the_folder_is_read_only(
    viz_folder: Path, capsys: Any, monkeypatch: Any
) -> None:
    # Tests run as root here, for whom every folder is writable: os.access answers as for a user.
    monkeypatch.setattr(os, "access", lambda path, mode: not (mode & os.W_OK))
    assert viz_error([str(viz_folder / "snapshot.pickle")], capsys) == (
        f"memlab viz: error: default output {viz_folder}/snapshot.html: this process may not create files "
        f"in '{viz_folder}' (the snapshot's name with .html; choose another with -o FILE)\n"
    )


def test_viz_will_not_write_its_page_over_the_snapshot(viz_folder: Path, capsys: Any) -> None:
    snapshot = viz_folder / "snapshot.html"  # a snapshot named .html: the default output is itself
    os.rename(viz_folder / "snapshot.pickle", snapshot)
    content = snapshot.read_bytes()
    assert viz_error([str(snapshot)], capsys) == (
        f"memlab viz: error: default output {snapshot} is the snapshot itself: name another file with "
        "-o FILE\n"
    )
    assert viz_error([str(snapshot), "-o", os.path.join(viz_folder, ".", "snapshot.html")], capsys) == (
        f"memlab viz: error: -o {viz_folder}/./snapshot.html is the snapshot itself: name another file with "
        "-o FILE\n"
    )
    assert snapshot.read_bytes() == content
    assert os.listdir(viz_folder) == ["snapshot.html"]


def test_a_file_in_a_folder_this_process_may_not_create_files_in_is_refused_before_anything_runs(
    made: Made, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    # memlab writes beside the file and renames, so it needs the folder even where the file is
    # writable. Tests run as root here, for whom every folder is writable: os.access answers as for
    # a user who may write the file but not the folder.
    (tmp_path / "old.json").write_bytes(b"previous\n")
    (tmp_path / "script.py").write_text(SCRIPT, encoding="utf-8")
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(tmp_path))
    monkeypatch.setattr(decorators, "_global", None)
    with pytest.raises(Exception) as raised:
        made.lp.to_json(tmp_path / "old.json")
    expected = f"path_or_buf {tmp_path}/old.json: this process may not create files in '{tmp_path}'"
    check_raised(raised.value, ValueError, expected, tmp_path)
    assert str(raised.value) == expected
    assert main(["run", "-o", str(tmp_path / "old.json"), str(tmp_path / "script.py")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the script did not run
    assert (
        captured.err
        == f"memlab run: error: -o {tmp_path}/old.json: this process may not create files in '{tmp_path}'\n"
    )
    assert (tmp_path / "old.json").read_bytes() == b"previous\n"


# -- issue 25: remedies ----


@pytest.mark.parametrize("budget", [0, "0 B", "0 GiB"])
def test_autobatch_refuses_a_budget_of_nothing_as_max_batch_size_does(budget: Any) -> None:
    message = f"budget must be a size above 0 bytes (e.g. '8 GiB'), got {budget!r}"
    with pytest.raises(ValueError) as raised:
        memlab.autobatch(loss_fn, budget=budget)
    assert str(raised.value) == message
    with pytest.raises(ValueError) as raised:  # the same check, from max_batch_size
        memlab.max_batch_size(lambda x: loss_fn(x).backward(), lambda b: torch.randn(b, 8), budget=budget)
    assert str(raised.value) == message


def test_autobatch_with_a_budget_below_one_sample_says_what_one_needs() -> None:
    model = torch.nn.Linear(256, 256)

    def model_loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    x = torch.randn(64, 256)
    wrapped = memlab.autobatch(model_loss, budget="1 MiB", gpu="A100")
    with pytest.raises(ValueError) as raised:
        wrapped(x)
    assert model.weight.grad is None  # nothing ran
    # what one sample needs, from a tracked run of two of them in a row (as the estimate runs them)
    with memlab.TensorTracker(gpu="A100") as tracker:
        for _ in range(2):
            model_loss(x[:1]).backward()
    needs = memlab._units.format_size(tracker.max_memory_reserved())
    assert str(raised.value) == (
        f"autobatch: not even a micro-batch of 1 (of 64) fits in the budget (1.00M): it needs {needs} "
        "(peak reserved, estimated)"
    )


# pytester runs the plugin's usage errors (the plugin is loaded from the entry point)
pytest_plugins = ["pytester"]


def test_two_limit_marks_on_one_test_are_a_usage_error_naming_both(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_file="""
import pytest

@pytest.mark.limit_tensor_memory("64 MiB")
@pytest.mark.limit_tensor_memory("32 MiB", metric="reserved")
def test_twice():
    pass

@pytest.mark.limit_tensor_memory("64 MiB")
class TestClass:
    @pytest.mark.limit_tensor_memory("1 MiB")
    def test_closest(self):
        pass
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == (
        "ERROR: test_file.py::test_twice: 2 limit_tensor_memory marks on one test: "
        "@pytest.mark.limit_tensor_memory('32 MiB', metric='reserved') and "
        "@pytest.mark.limit_tensor_memory('64 MiB'); keep one"
    )


# -- issue 25: courtesy ----


_PARKED_WRITES = {
    "add_": lambda t: t.add_(1),
    "copy_": lambda t: t.copy_(torch.zeros(4, 6)),
    "resize_": lambda t: t.resize_(1000),
    "set_": lambda t: t.set_(torch.zeros(3).untyped_storage()),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "t_": lambda t: t.t_(),
    "as_strided_": lambda t: t.as_strided_((2,), (1,)),
}


@pytest.mark.parametrize("op", sorted(_PARKED_WRITES))
def test_a_write_to_a_parked_tensor_is_one_error_saying_it_is_parked(op: str, tmp_path: Path) -> None:
    from memlab.courtesy import ParkedTensorError

    weight = torch.nn.Parameter(torch.arange(24.0).reshape(4, 6))
    with memlab.Courtesy(device="cpu", offload=tmp_path):
        with pytest.raises(ParkedTensorError) as raised:
            _PARKED_WRITES[op](weight)
        assert str(raised.value) == (
            f"tensor float32 [4, 6] is parked by memlab.Courtesy until restore(): {op} would write to it or "
            "change its shape, strides or storage in place; call restore() first"
        )
        assert weight.shape == (4, 6) and weight.stride() == (0, 0)
    assert type(weight) is torch.nn.Parameter and weight.stride() == (6, 1)
    assert weight.tolist() == torch.arange(24.0).reshape(4, 6).tolist()


def test_a_parked_file_changed_in_place_is_an_oserror_naming_it(tmp_path: Path) -> None:
    import zlib

    data = torch.arange(256, dtype=torch.float64)  # 2048 B
    courtesy = memlab.Courtesy(device="cpu", offload=tmp_path)
    courtesy.yield_memory()
    (workdir,) = tmp_path.iterdir()
    raw = torch.arange(256, dtype=torch.float64).view(torch.uint8).numpy().tobytes()
    (path,) = [p for p in workdir.iterdir() if p.read_bytes() == raw]
    changed = raw[:1024] + b"\xff\xff\xff\xff" + raw[1028:]
    path.write_bytes(changed)
    with pytest.raises(OSError) as raised:
        courtesy.restore()
    assert str(raised.value).endswith(
        f"{path} (2048 B, tensor float64 [256]): its bytes changed after they were written (CRC-32 "
        f"{zlib.crc32(changed):#010x}, {zlib.crc32(raw):#010x} was written): it was overwritten or corrupted"
    )
    assert torch.isnan(data).all()
    path.write_bytes(raw)
    assert courtesy.restore() == 2048 and data.tolist() == [float(i) for i in range(256)]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_quantized_tensor_is_named_in_a_warning_and_left_in_place(tmp_path: Path) -> None:
    quantized = torch.quantize_per_tensor(torch.arange(6.0), 0.5, 0, torch.quint8)
    storage, before = quantized.untyped_storage(), quantized.int_repr().tolist()
    courtesy = memlab.Courtesy(device="cpu", offload=tmp_path)
    with pytest.warns(
        UserWarning, match=r"\(it cannot re-point a quantized tensor at a copy\): tensors? .*quint8 \[6\]"
    ):
        courtesy.yield_memory()
    assert quantized.untyped_storage() is storage and quantized.int_repr().tolist() == before
    courtesy.restore()
    assert quantized.dequantize().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# -- issue 25: signals ----
def test_os_exit_with_a_code_that_is_no_integer_raises_in_the_program_as_python_does(tmp_path: Path) -> None:
    """``os._exit("3")`` under ``memlab run``: the TypeError ``os._exit`` raises under ``python``,
    in the program, and the table once, at the program's end (not a report, then a program that
    runs on after its tracker was exited)."""
    import subprocess
    import sys

    script = tmp_path / "bad_exit.py"
    script.write_text(
        "import os\nimport torch\nimport memlab\n\n\n@memlab.profile\ndef step():\n"
        "    return torch.ones(4)\n\n\n"
        "step()\ntry:\n    os._exit('3')\nexcept TypeError as error:\n    print('TypeError:', error)\n",
        encoding="utf-8",
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "memlab", "run", "-c", "active_bytes.all.peak", "-D", str(script)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert lines[0] == "TypeError: 'str' object cannot be interpreted as an integer"
    assert done.stdout.count("## step") == 1


def test_an_xdist_worker_output_in_another_format_is_named_in_the_summary_not_a_crash() -> None:
    from types import SimpleNamespace

    from memlab.pytest_plugin.plugin import MeasuringPlugin

    controller = MeasuringPlugin(None, True, 5)
    node = SimpleNamespace(
        workerinput={"workerid": "gw3"}, workeroutput={"memlab_peaks": [["t.py::a", "cpu"]]}
    )
    controller.pytest_testnodedown(node, None)
    assert controller.peaks == []
    assert controller.lost == [
        "gw3: its measurements are not (test, device, allocated, reserved[, note]) rows"
    ]


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


# -- issue 26: viz ----


@pytest.fixture
def viz_run(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """``run.pickle``: a tracked run of one 4,000 B tensor; and its snapshot."""
    with memlab.TensorTracker(history=True) as tracker:
        kept = torch.ones(1000)
    assert kept.nbytes == 4000
    memlab.dump_snapshot(tmp_path / "run.pickle", tracker)
    return tmp_path / "run.pickle", tracker.snapshot()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"stack": "bands"}, ValueError, "stack must be one of category, largest; got 'bands'"),
        ({"points": 15}, ValueError, "points must be >= 16, got 15"),
        ({"points": 2000.0}, TypeError, "points must be an int, got float 2000.0"),
        ({"top": 0}, ValueError, "top must be >= 1, got 0"),
        ({"top": True}, TypeError, "top must be an int, got bool True"),
        ({"device": 1}, ValueError, "the snapshot has no trace entries for device 1: record them with"),
    ],
)
def test_memory_page_rejects_a_bad_argument_naming_it(
    viz_run: tuple[Path, dict[str, Any]], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    from memlab.history.page import memory_page

    with pytest.raises(error) as raised:
        memory_page(viz_run[1], **kwargs)
    assert str(raised.value).startswith(message)


def test_memory_page_of_a_snapshot_without_a_trace_says_how_to_record_one() -> None:
    from memlab.history.page import memory_page

    with pytest.raises(ValueError) as raised:
        memory_page({"segments": [], "device_traces": [[]]})
    assert str(raised.value) == (
        "the snapshot has no trace entries for device 0: record them with memlab.TensorTracker(history=True) "
        "(or torch.cuda.memory._record_memory_history() on a GPU); devices with entries: none"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--points", "5"],
            "argument --points: must be a whole number of at least 16, got '5' (see memlab viz --help)",
        ),
        (
            ["--top", "0"],
            "argument --top: must be a whole number of at least 1, got '0' (see memlab viz --help)",
        ),
        (
            ["--stack", "bands"],
            "argument --stack: invalid choice: 'bands' (choose from 'category', 'largest') "
            "(see memlab viz --help)",
        ),
        (
            ["--viewer", "web"],
            "argument --viewer: invalid choice: 'web' (choose from 'memlab', 'pytorch') "
            "(see memlab viz --help)",
        ),
        (
            ["--device", "2"],
            "snapshot {run}: the snapshot has no trace entries for device 2: record them with "
            "memlab.TensorTracker(history=True) (or torch.cuda.memory._record_memory_history() on a GPU); "
            "devices with entries: [0]; its segments alone: --viewer pytorch --segments",
        ),
        (
            ["--segments", "--viewer", "memlab"],
            "--segments draws PyTorch's Allocator State History, which only --viewer pytorch draws "
            "(its page loads PyTorch's viewer from the web); memlab's page draws the timeline",
        ),
    ],
)
def test_viz_bad_options_are_one_line_errors_and_write_nothing(
    viz_run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any, args: list[str], message: str
) -> None:
    run, _ = viz_run
    try:
        status = main(["viz", str(run), "-o", str(tmp_path / "page.html"), *args])
    except SystemExit as exit_:  # argparse's own errors leave through SystemExit
        status = exit_.code
    assert status == 2
    assert capsys.readouterr().err == f"memlab viz: error: {message.format(run=run)}\n"
    assert not (tmp_path / "page.html").exists()


# -- issue 26: lines ----
TYPO_SCRIPT = """\
import time
import torch


def load_data():
    return torch.ones(4)


def train_step(x):
    return x * 2


def evaluate():
    return 1


print("definitions done", flush=True)

if __name__ == "__main__":
    for step in range(3):
        time.sleep(0.2)
        train_step(load_data())
        print(f"step {step}", flush=True)
"""


def test_run_with_a_name_the_script_never_defines_says_so_before_its_main_work_and_at_the_end(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(TYPO_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "memlab", "run", "-f", "train_setp", "train.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the order in which the lines were written
        text=True,
        timeout=300,
    )
    message = (
        "memlab run: error: -f train_setp: train.py defines no function named train_setp; "
        "it defines train_step, load_data, evaluate"  # the close match first, then in the script's order
    )
    assert (done.returncode, done.stdout.splitlines()) == (
        2,
        [
            "definitions done",
            f"{message}; the program runs on without it",
            "step 0",
            "step 1",
            "step 2",
            message,
        ],
    )


def test_run_with_a_name_a_script_without_functions_never_defines_says_it_defines_none(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(decorators, "_global", None)
    script = tmp_path / "flat.py"
    script.write_text("x = 1\n", encoding="utf-8")
    assert main(["run", "-f", "step", str(script)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == (
        "",
        f"memlab run: error: -f step: {script} defines no function named step, nor any other function\n",
    )


def test_run_with_a_method_the_class_lacks_names_the_methods_it_has(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(decorators, "_global", None)
    script = tmp_path / "net.py"
    script.write_text(
        "class Net:\n    def forward(self):\n        return 1\n\n    def reset(self):\n        return 0\n\n"
        "if __name__ == '__main__':\n    Net().forward()\n",
        encoding="utf-8",
    )
    assert main(["run", "-f", "Net.froward", str(script)]) == 2
    message = (
        f"memlab run: error: -f Net.froward: {script} defines no function named Net.froward; it defines "
    )
    assert capsys.readouterr().err.splitlines() == [  # a class is a name -f takes too (all its methods)
        f"{message}Net.forward, Net, Net.reset; the program runs on without it",
        f"{message}Net.forward, Net, Net.reset",
    ]


def test_run_with_a_typo_prints_the_programs_buffered_output_before_the_final_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = "import torch\n\ndef step():\n    return torch.ones(4)\n\nif __name__ == '__main__':\n"
    (tmp_path / "quiet.py").write_text(script + "    print('training')\n    step()\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(  # stdout is a pipe: the program's print stays in its buffer until flushed
        [sys.executable, "-m", "memlab", "run", "-f", "stpe", "quiet.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    message = "memlab run: error: -f stpe: quiet.py defines no function named stpe; it defines step"
    assert (done.returncode, done.stdout) == (
        2,
        f"{message}; the program runs on without it\ntraining\n{message}\n",
    )
