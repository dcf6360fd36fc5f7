"""Which source measures a target, and the line that says so."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memlab
from memlab._devices import default_device_as
from memlab.sources.cuda import CudaSource
from memlab.sources.select import SourceSelector, check_target, describe_source, measured_device, open_source
from memlab.sources.tracker import is_active

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")


def test_the_cuda_source_says_it_measures_the_gpu():
    assert describe_source(CudaSource(0), torch.device("cuda", 0)) == (
        "measured on cuda:0 (torch.cuda.memory_stats)"
    )


def test_a_tracker_the_user_entered_says_what_it_does_not_count():
    tracker = memlab.TensorTracker()
    assert describe_source(tracker, torch.device("meta")) == (
        "modelled: CUDA caching allocator replayed from meta tensors (memlab.TensorTracker); "
        "tensors made before the tracker was entered are not counted"
    )


def test_an_exact_tracker_says_it_counts_exact_bytes():
    tracker = memlab.TensorTracker(allocator=None)
    assert describe_source(tracker, torch.device("cpu"), fallback=True) == (
        "modelled (no CUDA GPU here): exact bytes of cpu tensors (memlab.TensorTracker(allocator=None)); "
        "tensors made before the tracker was entered are not counted"
    )


def test_an_adopting_tracker_says_how_much_it_adopted_first_and_later():
    tracker = memlab.TensorTracker(adopt=True)
    tracker.adoptions = [(12, 5 * 1024 * 1024), (0, 0), (3, 1536)]
    assert describe_source(tracker, torch.device("cpu")) == (
        "modelled: CUDA caching allocator replayed from cpu tensors (memlab.TensorTracker); "
        "12 tensor storages (5.00M) existed before profiling, 3 more were adopted at later calls"
    )
    tracker.adoptions = [(0, 0)]
    assert describe_source(tracker, torch.device("cpu")).endswith("; no tensors existed before profiling")


def test_another_source_is_named_by_its_class():
    class Counter:
        def memory_stats(self, device=None):
            return {}

        def sampler(self, keys, device=None):
            return lambda: ()

    assert describe_source(Counter(), torch.device("cpu")) == "read from Counter for cpu"


@no_gpu
def test_an_int_target_without_a_gpu_opens_an_adopting_tracker_on_the_default_device():
    selector = SourceSelector()
    selection = selector.open(check_target(0))
    assert isinstance(selection.source, memlab.TensorTracker) and selection.source.adopt_on_enter
    assert selection.device == torch.device("cpu")
    assert not is_active(selection.source)  # each thread that profiles enters it
    leave = selection.enter_thread()
    try:
        assert is_active(selection.source) and selection.source.counts_this_thread()
        assert selection.describe().startswith("modelled (no CUDA GPU here): CUDA caching allocator")
    finally:
        leave()
    assert not is_active(selection.source)
    again = selector.open(0)
    assert again.source is selection.source  # kept between sessions


def test_a_thread_where_the_tracker_counts_already_does_not_enter_it_again():
    with memlab.TensorTracker(allocator=None) as tracker:
        selection = SourceSelector("tracker").open(check_target("meta"))
        leave = selection.enter_thread()
        assert _get_current_dispatch_mode_stack() == [tracker]  # not pushed a second time
        leave()
        assert _get_current_dispatch_mode_stack() == [tracker]
    assert not is_active(tracker)


def test_an_entered_tracker_is_used_as_it_is():
    with memlab.TensorTracker(allocator=None) as tracker:
        selection = SourceSelector("tracker").open(check_target("meta"))
        assert selection.source is tracker and selection.device == torch.device("meta")
        assert open_source(torch.device("meta")) is tracker
    assert open_source(torch.device("meta")) is None


@no_gpu
def test_a_named_gpu_that_does_not_exist_is_rejected_early():
    with pytest.raises(ValueError) as error:
        check_target("cuda:1", name="-g")
    assert (
        str(error.value)
        == "-g cuda:1: no such GPU (this machine has no CUDA GPU); use 'cpu' or 'meta' to model one"
    )


def test_an_unknown_source_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        SourceSelector("gpu")
    assert str(error.value) == (
        "source must be None or 'auto', 'cuda', 'tracker', or an object with memory_stats() and sampler(); "
        "got 'gpu'"
    )


def test_a_tracker_handed_over_but_not_entered_is_entered_for_each_session():
    tracker = memlab.TensorTracker(allocator=None)

    def double(batch):
        return batch * 2

    lp = memlab.LineProfiler(double, target_gpu="meta", source=tracker, columns=("allocated_bytes.all.peak",))
    with lp:
        doubled = double(torch.ones(1000, device="meta"))
    peaks = [row[1] for row in lp.to_dataframe(double).itertuples(index=False)]
    assert peaks == [4000, 8000]  # the input (made once the session began) and the product
    assert tracker.memory_allocated("meta") == 4000  # the product alone, after the session
    del doubled


@no_gpu
def test_the_measured_device_of_an_int_is_a_gpu_index_only_0_stands_for_the_default_device():
    assert measured_device(0) == (torch.device("cpu"), True)
    assert measured_device(torch.device("meta")) == (torch.device("meta"), False)
    with pytest.raises(ValueError) as error:
        measured_device(7, name="-g")
    assert str(error.value) == (
        "-g 7: no such GPU (this machine has no CUDA GPU; only index 0, the default, stands for the "
        "default device without one); use 0, 'cpu' or 'meta' to model one"
    )
    with pytest.raises(ValueError, match=r"^target_gpu 7: no such GPU"):
        SourceSelector().open(7)  # a target set around check_target is refused where the source is chosen


def test_the_default_device_after_set_default_device_none_is_the_cpu_on_every_release():
    # torch 2.8's own get_default_device raises AttributeError here (its context is None)
    assert not hasattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context")
    with default_device_as(torch.device("meta")):
        assert measured_device(0) == (torch.device("meta"), True)
        torch.set_default_device(None)
        assert measured_device(0) == (torch.device("cpu"), True)
        profiler = memlab.LineProfiler(make_on_cpu)
        profiler.target_gpu = 0
        assert profiler.target_gpu == 0
    assert not hasattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context")  # as it was: never set
    assert torch.get_default_device() == torch.device("cpu")


def make_on_cpu():
    return torch.empty(1000, dtype=torch.uint8)


def test_measuring_meta_while_the_tensors_are_on_the_cpu_says_why_every_byte_is_0():
    lp = memlab.LineProfiler(make_on_cpu, target_gpu="meta", source=memlab.TensorTracker(allocator=None))
    with lp:
        made = make_on_cpu()
    assert [row[1] for row in lp.to_dataframe(make_on_cpu).itertuples(index=False)] == [0, 0]
    assert lp.source_line() == (
        "modelled: exact bytes of meta tensors (memlab.TensorTracker(allocator=None)); tensors made before "
        "the tracker was entered are not counted; no tensor was made on meta, so every byte column is 0: "
        "the tensors were on cpu (measure cpu to see them)"
    )
    lp.target_gpu = "cpu"
    with lp:
        make_on_cpu()
    assert lp.source_line() == (
        "modelled: exact bytes of cpu tensors (memlab.TensorTracker(allocator=None)); tensors made before "
        "the tracker was entered are not counted"
    )
    assert made.numel() == 1000


def test_a_tracker_that_counted_nothing_anywhere_adds_no_hint():
    tracker = memlab.TensorTracker(allocator=None)
    tracker.memory_stats("meta")  # asked about, never used
    assert describe_source(tracker, torch.device("meta")).endswith("are not counted")
