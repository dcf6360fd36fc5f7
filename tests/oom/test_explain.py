"""explain_oom and its automatic watches: the report of an OOM, the error left unchanged, no work
without an OOM."""

from __future__ import annotations

import gc
import io
import os
import pickle
import traceback

import pytest
import torch

import memlab
from memlab.oom import watch as watch_module
from memlab.oom.report import shown_path
from memlab.sources.allocator import CachingAllocatorModel

MIB = 1 << 20
HERE = shown_path(__file__)  # as reports print it: relative to the current directory
#: The small GPUs below hold their tensors and the 32 MiB cuBLAS workspace of the H100 a tracker
#: models, which the step's first matmul allocates in a segment of its own.
WORKSPACE = 32 * MIB


def _floats(mib: float) -> int:
    return int(mib * MIB) // 4


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    gc.collect()
    monkeypatch.setenv("MEMLAB_OOM_DIR", str(tmp_path))
    yield
    assert not watch_module._entries
    assert not watch_module._pending


def step(model, x):
    h = model(x)
    grown = torch.empty(_floats(48))  # the failing line
    return h + grown.sum()


def test_profiled_function_reports_the_failing_line_and_largest_tensor(capsys):
    lp = memlab.LineProfiler(target_gpu="cpu")
    profiled = lp(step)
    with memlab.TensorTracker(capacity=40 * MIB + WORKSPACE, history=True) as tracker:
        model = torch.nn.Linear(2048, 1024, bias=False)  # an 8 MiB weight
        x = torch.ones(4, 2048)
        with pytest.raises(torch.OutOfMemoryError) as raised:
            profiled(model, x)
    report = memlab.oom.last_report()
    err = capsys.readouterr().err
    assert err == report.text() + "\n"
    lines = err.splitlines()
    failing = step.__code__.co_firstlineno + 2
    assert lines[0] == (  # the forward's matmul took the H100's first 32 MiB cuBLAS workspace
        f"memlab: out of memory (OutOfMemoryError) at {HERE}:{failing} in step; includes 1 modelled cuBLAS "
        "workspace of the H100: 32.00M"
    )
    assert lines[1] == f"  {failing:>5} | grown = torch.empty(_floats(48))  # the failing line"
    assert report.requested == 48 * MIB
    assert report.capacity == 40 * MIB + WORKSPACE
    assert report.verdict == "shortage"
    largest = report.culprits[0]
    assert (largest.name, largest.category, largest.size) == ("weight", "parameter", 8 * MIB)
    made = test_profiled_function_reports_the_failing_line_and_largest_tensor.__code__.co_firstlineno + 4
    assert largest.allocated_at == f"{__file__}:{made}"
    assert f"  {'weight':<32} {'parameter':<15} {'8.00M':>9}  {HERE}:{made}" in lines
    # the caller gets PyTorch's own error, raised at the failing line
    error = raised.value
    assert type(error) is torch.OutOfMemoryError
    assert str(error) == report.message
    assert str(error).startswith(
        "CUDA out of memory. Tried to allocate 48.00 MiB. GPU 0 has a total capacity of 72.00 MiB"
    )
    user_frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__]
    assert (user_frames[-1].name, user_frames[-1].lineno) == ("step", failing)
    assert tracker.memory_stats()["num_ooms"] == 1


def test_the_report_is_not_printed_twice_by_nested_watches(capsys):
    inner = memlab.explain_oom(step)
    with memlab.explain_oom() as outer, memlab.TensorTracker(capacity="40 MiB"):
        with pytest.raises(torch.OutOfMemoryError):
            inner(torch.nn.Linear(8, 8), torch.ones(1, 8))
    assert outer.reports == []
    assert capsys.readouterr().err.count("memlab: out of memory") == 1


def test_an_oom_swallowed_inside_the_block_is_still_reported(capsys):
    stream = io.StringIO()
    with memlab.explain_oom(stream=stream) as watch, memlab.TensorTracker(capacity="10 MiB"):
        try:
            torch.empty(_floats(16))
        except torch.OutOfMemoryError:
            pass  # a library retrying with less
        kept = torch.empty(_floats(1))
    assert kept.numel() == _floats(1)
    (report,) = watch.reports
    assert report.caught
    assert report.requested == 16 * MIB
    assert stream.getvalue().startswith(f"memlab: out of memory (OutOfMemoryError) at {HERE}:")
    assert "(caught before it left the watched block)" in stream.getvalue().splitlines()[0]
    assert capsys.readouterr().err == ""


def test_with_history_the_snapshot_pickle_is_written_where_asked(tmp_path):
    stream = io.StringIO()
    folder = tmp_path / "snapshots"
    folder.mkdir()
    with memlab.explain_oom(stream=stream, snapshot_dir=folder) as watch:
        with memlab.TensorTracker(capacity="10 MiB", history=True):
            keep = torch.empty(_floats(1))
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(_floats(16))
    assert keep.numel()
    path = watch.report.snapshot_path
    assert os.path.dirname(path) == str(folder)
    assert os.path.basename(path).startswith(f"memlab-oom-{os.getpid()}-")
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    actions = [entry["action"] for entry in snapshot["device_traces"][0]]
    assert actions[-1] == "oom"
    assert sum(s["total_size"] for s in snapshot["segments"]) == watch.report.reserved
    assert stream.getvalue().splitlines()[-1] == f"snapshot: {path} (memlab viz, or pytorch.org/memory_viz)"


def test_without_history_no_pickle_is_written(tmp_path):
    with memlab.explain_oom(stream=io.StringIO()) as watch, memlab.TensorTracker(capacity="10 MiB"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(_floats(16))
    assert watch.report.snapshot_path is None
    assert list(tmp_path.iterdir()) == []


def test_other_errors_pass_without_a_report(capsys):
    with pytest.raises(ValueError, match="not memory"), memlab.explain_oom():
        raise ValueError("not memory")
    assert capsys.readouterr() == ("", "")


def test_an_oom_raised_outside_any_tracker_is_reported_from_its_traceback():
    stream = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError, match=r"^made up$"), memlab.explain_oom(stream=stream):
        raise torch.OutOfMemoryError("made up")
    line = test_an_oom_raised_outside_any_tracker_is_reported_from_its_traceback.__code__.co_firstlineno + 3
    assert stream.getvalue().splitlines() == [
        f"memlab: out of memory (OutOfMemoryError) at {HERE}:{line} in "
        "test_an_oom_raised_outside_any_tracker_is_reported_from_its_traceback",
        f'  {line:>5} | raise torch.OutOfMemoryError("made up")',
        "  made up",
        "  (no allocator state was captured for this error)",
    ]


def test_no_oom_means_no_output_and_no_statistics_read(capsys, monkeypatch):
    reads = []
    original = CachingAllocatorModel.memory_stats
    monkeypatch.setattr(CachingAllocatorModel, "memory_stats", lambda self: reads.append(1) or original(self))
    watched = memlab.explain_oom(step)
    with memlab.TensorTracker(capacity=64 * MIB + WORKSPACE, history=True):
        with memlab.explain_oom():
            out = watched(torch.nn.Linear(8, 8), torch.ones(2, 8))
    assert out.shape == (2, 8)
    assert reads == []
    assert capsys.readouterr() == ("", "")


def test_a_line_profiler_session_explains_an_oom(capsys):
    lp = memlab.LineProfiler(step, target_gpu="cpu")
    with memlab.TensorTracker(capacity="40 MiB"), pytest.raises(torch.OutOfMemoryError), lp:
        step(torch.nn.Linear(8, 8), torch.ones(2, 8))
    assert capsys.readouterr().err.startswith(
        f"memlab: out of memory (OutOfMemoryError) at {HERE}:{step.__code__.co_firstlineno + 2} in step; "
        "includes 1 modelled cuBLAS workspace of the H100: 32.00M\n"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_dim": "0"}, TypeError, "batch_dim must be an int dimension >= 0 or None, got str '0'"),
        (
            {"batch_dim": -1},
            ValueError,
            "batch_dim must be an int dimension >= 0 or None (0), got -1: the batch dimension is counted "
            "from the front, as the same tensors may have different ranks",
        ),
        (
            {"stream": 5},
            TypeError,
            "stream must be None or a text stream with a write() method (sys.stdout, an open file, "
            "io.StringIO()), got int 5",
        ),
        (
            {"snapshot_dir": 5},
            TypeError,
            "snapshot_dir must be None ($MEMLAB_OOM_DIR, else the temporary directory) or a folder path "
            "(a str or os.PathLike), got int 5",
        ),
        ({"remedies": "no"}, TypeError, "remedies must be True or False, got str 'no'"),
    ],
)
def test_explain_oom_checks_its_arguments_when_it_is_made(kwargs, error, message):
    with pytest.raises(error) as raised:
        memlab.explain_oom(**kwargs)
    assert str(raised.value) == message
    with pytest.raises(TypeError, match="explain_oom takes a function to watch"):
        memlab.explain_oom(3)


def test_a_missing_snapshot_dir_keeps_the_report_and_says_why_there_is_no_snapshot(tmp_path):
    stream = io.StringIO()
    missing = tmp_path / "missing"
    watch = memlab.explain_oom(stream=stream, snapshot_dir=missing, remedies=False)
    with pytest.raises(torch.OutOfMemoryError), watch, memlab.TensorTracker(capacity="10 MiB", history=True):
        torch.empty(_floats(16))
    code = test_a_missing_snapshot_dir_keeps_the_report_and_says_why_there_is_no_snapshot.__code__
    failing = code.co_firstlineno + 5
    assert stream.getvalue().splitlines() == [
        f"memlab: out of memory (OutOfMemoryError) at {HERE}:{failing} in "
        "test_a_missing_snapshot_dir_keeps_the_report_and_says_why_there_is_no_snapshot",
        f"  {failing:>5} | torch.empty(_floats(16))",
        "  requested 16.00M (block 16.00M, new segment 16.00M) on cpu, modelled CUDA caching allocator",
        "  capacity 10.00M  reserved 0.00B  allocated 0.00B  free 10.00M",
        "verdict: shortage: 10.00M free in all (10.00M on the device, 0.00B cached), less than the 16.00M "
        "block requested",
        f"snapshot: not written: no such folder '{missing}' (snapshot_dir)",
    ]
    assert (watch.report.snapshot_path, watch.report.snapshot_error) == (
        None,
        f"no such folder '{missing}' (snapshot_dir)",
    )
    assert list(tmp_path.iterdir()) == []


class _BrokenStream:
    """A stream whose writes fail, as a closed file's do."""

    def write(self, text):
        raise ValueError("I/O operation on closed file.")

    def flush(self):
        pass


def test_a_stream_that_fails_at_the_error_never_replaces_the_users_error(capsys):
    watch = memlab.explain_oom(stream=_BrokenStream(), remedies=False)
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 16\.00 MiB"):
        with watch, memlab.TensorTracker(capacity="10 MiB"):
            torch.empty(_floats(16))
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "memlab: could not write to stream (ValueError: I/O operation on closed file.):"
    assert err[1].startswith("memlab: out of memory (OutOfMemoryError) at ")


def test_a_capture_that_fails_leaves_the_users_error_alone(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no luck")

    monkeypatch.setattr(watch_module, "capture_tracker_oom", broken)
    stream = io.StringIO()
    with memlab.explain_oom(stream=stream), memlab.TensorTracker(capacity="10 MiB"):
        with pytest.raises(
            torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 16\.00 MiB"
        ):
            torch.empty(_floats(16))
    assert stream.getvalue().splitlines()[-2:] == [
        "  (no allocator state was captured for this error)",
        "  memlab could not capture the allocator state: RuntimeError: no luck",
    ]


def test_explain_oom_with_arguments_decorates_too():
    @memlab.explain_oom(batch_dim=1, stream=io.StringIO())
    def double(x):
        return x * 2

    assert double(torch.ones(2, 3)).tolist() == [[2.0] * 3] * 2
    assert double.__name__ == "double"
