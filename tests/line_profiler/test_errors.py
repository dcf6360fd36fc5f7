"""Bad input fails early, with a typed error that lists what would have been valid."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.sources.select import check_target


def work():
    return 1


def test_a_bad_column_name_at_construction_lists_the_valid_names():
    with pytest.raises(
        ValueError, match=r"unknown column 'active_bytes\.peak'; valid columns .*hits.*delta"
    ) as info:
        memlab.LineProfiler(work, columns=("active_bytes.peak",))
    assert "active_bytes.all.peak" in str(info.value)
    assert "reserved_bytes.large_pool.freed" in str(info.value)


def test_a_bad_column_name_at_display_lists_the_valid_names():
    lp = memlab.LineProfiler(work)
    with pytest.raises(ValueError, match="unknown column 'bytes'; valid columns") as info:
        lp.display(columns=("bytes",))
    assert "num_alloc_retries" in str(info.value)


def test_a_valid_but_unrecorded_column_says_how_to_record_it():
    lp = memlab.LineProfiler(work)
    with pytest.raises(ValueError) as error:
        lp.to_dataframe(columns=("segment.all.current",))
    assert str(error.value) == (
        "column 'segment.all.current' was not recorded: memlab records only the columns chosen before "
        "profiling, since each one costs time on every profiled line; recorded: hits, delta, "
        "active_bytes.all.peak, reserved_bytes.all.peak. Choose it up front with "
        "LineProfiler(columns=[..., 'segment.all.current']), @memlab.profile(columns=...), "
        "memlab run -c segment.all.current or %mlrun -c segment.all.current, or call add_columns() "
        "before the next session"
    )


def test_columns_added_while_disabled_are_recorded_at_once():
    lp = memlab.LineProfiler(work)
    lp.add_columns(["segment.all.current"])
    frame = lp.to_dataframe(columns=("segment.all.current",))
    assert list(frame.columns) == ["segment.all.current", "code"]
    assert frame["segment.all.current"].isna().all()  # work() never ran: its lines are blank


def test_a_bad_column_name_in_the_decorators_raises_at_decoration():
    with pytest.raises(ValueError, match="unknown column 'peak'"):
        memlab.profile(columns=("peak",))
    with pytest.raises(ValueError, match="unknown column 'peak'"):
        memlab.profile_every(columns=("peak",))


def test_a_non_string_column_is_a_type_error():
    with pytest.raises(TypeError, match="column names must be strings, got int 3"):
        memlab.LineProfiler(columns=(3,))


def test_add_function_rejects_a_non_callable():
    with pytest.raises(TypeError, match=r"needs a Python function.*got int 42, which is not callable"):
        memlab.LineProfiler().add_function(42)


def test_add_function_rejects_a_callable_without_python_code():
    with pytest.raises(TypeError, match="no Python code to trace"):
        memlab.LineProfiler().add_function(len)


def test_selecting_an_unregistered_function_lists_the_registered_ones():
    lp = memlab.LineProfiler(work)
    with pytest.raises(ValueError, match="'other' is not a registered function; registered: work"):
        lp.display("other")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (0, 0),
        ("0", 0),
        ("cpu", torch.device("cpu")),
        ("meta", torch.device("meta")),
        (torch.device("meta"), torch.device("meta")),
    ],
)
def test_valid_targets(target, expected):
    assert check_target(target) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
def test_gpu_0_without_a_gpu_is_kept_for_the_default_device():
    assert check_target(0) == 0  # pytorch_memlab's default target_gpu=0: modelled, and the table says so
    assert check_target("0", name="-g") == 0


NO_GPU_7 = (
    "no such GPU (this machine has no CUDA GPU; only index 0, the default, stands for the default "
    "device without one); use 0, 'cpu' or 'meta' to model one"
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
@pytest.mark.parametrize("target", [7, "7", 1])
def test_a_gpu_index_that_does_not_exist_is_an_error_not_the_cpu(global_profiler, target):
    index = int(target)
    with pytest.raises(ValueError) as error:
        memlab.LineProfiler(work, target_gpu=target)
    assert str(error.value) == f"target_gpu {index}: {NO_GPU_7}"
    with pytest.raises(ValueError) as error:
        memlab.set_target_gpu(target)
    assert str(error.value) == f"target_gpu {index}: {NO_GPU_7}"
    assert global_profiler.target_gpu == 0  # unchanged
    lp = memlab.LineProfiler(work)
    with pytest.raises(ValueError) as error:
        lp.target_gpu = target
    assert str(error.value) == f"target_gpu {index}: {NO_GPU_7}"
    with pytest.raises(ValueError) as error:
        check_target(target, name="-g")
    assert str(error.value) == f"-g {index}: {NO_GPU_7}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
@pytest.mark.parametrize("target", ["cuda:7", "cuda", torch.device("cuda", 7)])
def test_a_named_gpu_that_does_not_exist_is_an_error_not_a_substitution(target):
    device = torch.device(target)
    with pytest.raises(ValueError) as error:
        memlab.LineProfiler(work, target_gpu=target)
    assert str(error.value) == (
        f"target_gpu {device}: no such GPU (this machine has no CUDA GPU); use 'cpu' or 'meta' to model one"
    )
    with pytest.raises(ValueError, match="no such GPU"):
        memlab.set_target_gpu(target)


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        (1.5, TypeError, r"target_gpu must be 'cpu', 'meta', 'cuda', 'cuda:1', .* got float 1\.5"),
        (True, TypeError, "got bool True"),
        (None, TypeError, "got NoneType None"),
        (-1, ValueError, "got the negative index -1"),
        ("gpu0", ValueError, "target_gpu 'gpu0' is not a device; valid: 'cpu', 'meta'"),
    ],
)
def test_set_target_gpu_rejects_anything_else_listing_the_valid_forms(target, error, message):
    with pytest.raises(error, match=message):
        memlab.set_target_gpu(target)
    assert memlab.line_profiler.global_line_profiler().target_gpu == 0


def test_an_unknown_source_lists_the_valid_ones():
    with pytest.raises(ValueError, match="source must be None or 'auto', 'cuda', 'tracker'"):
        memlab.LineProfiler(source="gpu")


def test_source_cuda_without_a_gpu_fails_when_enabled():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    lp = memlab.LineProfiler(work, source="cuda")
    with pytest.raises(ValueError) as error:
        lp.enable()
    assert str(error.value) == (
        "source='cuda' reads a CUDA GPU's own statistics, but the target is cpu and this machine has "
        "no CUDA GPU; use source=None or 'tracker' to model the GPU's numbers"
    )
    assert not lp.enabled


@pytest.mark.parametrize(("interval", "error"), [(0, ValueError), (-2, ValueError), (1.0, TypeError)])
def test_profile_every_needs_a_positive_int_interval(interval, error):
    with pytest.raises(error, match="output_interval must be a positive int"):
        memlab.profile_every(interval)
