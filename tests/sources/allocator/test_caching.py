"""CachingAllocatorModel: the CUDA caching allocator's behaviour, in exact bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memlab import STAT_KEYS
from memlab.sources.allocator import CachingAllocatorModel
from memlab.sources.allocator.config import round_size
from tests.sources.allocator.invariants import MiB, assert_consistent, model

# -- the published check ----------------------------------------------------------------------------


def test_linear_100_100_weight_and_bias_match_a_real_gpu():
    m = model()
    m.malloc(40_000)
    m.malloc(400)
    stats = m.memory_stats()
    assert stats["active_bytes.all.peak"] == 40_960
    assert stats["reserved_bytes.all.peak"] == 2_097_152


def test_memory_stats_has_exactly_the_keys_of_torch_cuda_memory_stats():
    assert tuple(model().memory_stats()) == STAT_KEYS


# -- rounding and pools through the model -----------------------------------------------------------


@pytest.mark.parametrize(("nbytes", "granted"), [(1, 512), (511, 512), (512, 512), (513, 1024)])
def test_small_request_is_granted_its_rounded_size_in_a_2_mib_small_segment(nbytes, granted):
    m = model()
    m.malloc(nbytes)
    stats = m.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] == granted
    assert stats["requested_bytes.small_pool.current"] == nbytes
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["segment.small_pool.current"] == 1


def test_one_mib_request_uses_the_small_pool():
    m = model()
    m.malloc(1 * MiB)
    stats = m.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] == 1 * MiB
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["allocation.large_pool.current"] == 0


def test_one_mib_plus_one_byte_uses_the_large_pool_and_a_20_mib_segment():
    m = model()
    m.malloc(1 * MiB + 1)
    stats = m.memory_stats()
    assert stats["allocated_bytes.large_pool.current"] == 1 * MiB + 512
    assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
    assert stats["allocation.small_pool.current"] == 0


def test_request_just_under_10_mib_after_rounding_gets_a_20_mib_segment():
    m = model()
    m.malloc(10 * MiB - 512)
    assert m.memory_stats()["reserved_bytes.large_pool.current"] == 20 * MiB


def test_request_that_rounds_to_10_mib_gets_a_segment_of_exactly_10_mib():
    m = model()
    m.malloc(10 * MiB - 1)
    m.malloc(10 * MiB)
    stats = m.memory_stats()
    assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
    assert stats["segment.large_pool.current"] == 2
    assert stats["inactive_split.large_pool.current"] == 0


def test_zero_bytes_returns_handle_0_and_changes_nothing():
    m = model()
    before = m.memory_stats()
    assert m.malloc(0) == 0
    m.free(0)
    assert m.memory_stats() == before


# -- splitting --------------------------------------------------------------------------------------


def test_small_pool_splits_off_a_512_byte_remainder():
    m = model()
    m.malloc(1 * MiB)
    m.malloc(1 * MiB - 512)
    stats = m.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] == 2 * MiB - 512
    assert stats["inactive_split.small_pool.current"] == 1
    assert stats["inactive_split_bytes.small_pool.current"] == 512


def test_small_pool_hands_out_an_exact_fit_whole():
    m = model()
    m.malloc(1 * MiB)
    m.malloc(1 * MiB)
    stats = m.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] == 2 * MiB
    assert stats["segment.small_pool.current"] == 1
    assert stats["inactive_split.small_pool.current"] == 0


def test_large_pool_does_not_split_off_a_remainder_of_exactly_1_mib():
    m = model()
    m.malloc(19 * MiB)
    stats = m.memory_stats()
    assert stats["allocated_bytes.large_pool.current"] == 20 * MiB
    assert stats["requested_bytes.large_pool.current"] == 19 * MiB
    assert stats["inactive_split.large_pool.current"] == 0


def test_large_pool_splits_off_a_remainder_above_1_mib():
    m = model()
    m.malloc(19 * MiB - 512)
    stats = m.memory_stats()
    assert stats["allocated_bytes.large_pool.current"] == 19 * MiB - 512
    assert stats["inactive_split.large_pool.current"] == 1
    assert stats["inactive_split_bytes.large_pool.current"] == 1 * MiB + 512


def test_request_between_1_and_10_mib_is_cut_from_a_20_mib_segment():
    m = model()
    m.malloc(4 * MiB)
    m.malloc(4 * MiB)
    stats = m.memory_stats()
    assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
    assert stats["inactive_split_bytes.large_pool.current"] == 12 * MiB
    assert stats["num_device_alloc"] == 1


def test_best_fit_takes_the_smallest_free_block_that_fits():
    m = model()
    a = m.malloc(4 * MiB)
    m.malloc(2 * MiB)
    b = m.malloc(3 * MiB)
    m.malloc(2 * MiB)
    m.free(a)  # free blocks now: 4 MiB, 3 MiB and the 9 MiB tail
    m.free(b)
    m.malloc(3 * MiB)
    sizes = [(blk["size"], blk["allocated"]) for blk in m.snapshot()[0]["blocks"]]
    assert sizes == [(4 * MiB, False), (2 * MiB, True), (3 * MiB, True), (2 * MiB, True), (9 * MiB, False)]


# -- freeing, merging and reuse ---------------------------------------------------------------------


def test_free_keeps_the_memory_reserved():
    m = model()
    m.free(m.malloc(4 * MiB))
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["reserved_bytes.all.current"] == 20 * MiB


def test_freed_block_merges_with_free_neighbours_on_both_sides():
    m = model()
    a = m.malloc(2 * MiB)
    b = m.malloc(2 * MiB)
    m.free(a)
    assert m.memory_stats()["inactive_split.large_pool.current"] == 2
    m.free(b)
    stats = m.memory_stats()
    assert [blk["size"] for blk in m.snapshot()[0]["blocks"]] == [20 * MiB]
    assert stats["inactive_split.large_pool.current"] == 0
    assert stats["inactive_split_bytes.large_pool.current"] == 0


def test_inactive_split_counts_free_blocks_of_split_segments():
    m = model()
    a = m.malloc(2 * MiB)
    m.malloc(2 * MiB)
    c = m.malloc(2 * MiB)
    m.malloc(2 * MiB)
    m.free(a)
    m.free(c)
    stats = m.memory_stats()
    assert stats["inactive_split.large_pool.current"] == 3
    assert stats["inactive_split_bytes.large_pool.current"] == 2 * MiB + 2 * MiB + 12 * MiB
    assert stats["inactive_split.all.current"] == 3


def test_cached_block_is_reused_and_reserved_stays_flat():
    m = model()
    m.free(m.malloc(1000))
    m.malloc(1000)
    stats = m.memory_stats()
    assert stats["reserved_bytes.all.current"] == 2 * MiB
    assert stats["reserved_bytes.all.peak"] == 2 * MiB
    assert stats["num_device_alloc"] == 1
    assert stats["allocation.all.allocated"] == 2


def test_freeing_counts_freed_bytes_and_active_follows_allocation():
    m = model()
    m.free(m.malloc(40_000))
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.freed"] == 40_448
    assert stats["active_bytes.all.freed"] == 40_448
    assert stats["requested_bytes.all.freed"] == 40_000
    assert stats["active.all.current"] == 0


# -- empty_cache ------------------------------------------------------------------------------------


def test_empty_cache_releases_only_fully_free_segments():
    m = model()
    a = m.malloc(1 * MiB)
    b = m.malloc(1 * MiB)
    m.malloc(1 * MiB)  # a second small segment, half used
    m.free(a)
    m.free(b)
    m.empty_cache()
    stats = m.memory_stats()
    assert stats["reserved_bytes.all.current"] == 2 * MiB
    assert stats["segment.all.current"] == 1
    assert stats["inactive_split_bytes.small_pool.current"] == 1 * MiB
    assert stats["num_device_free"] == 1
    assert stats["num_sync_all_streams"] == 1


def test_empty_cache_keeps_peaks():
    m = model()
    m.free(m.malloc(30 * MiB))
    m.empty_cache()
    stats = m.memory_stats()
    assert stats["reserved_bytes.all.current"] == 0
    assert stats["reserved_bytes.all.peak"] == 30 * MiB


# -- capacity, the retry path and OOM ---------------------------------------------------------------


def test_failing_segment_frees_cached_segments_and_retries():
    m = model(capacity=40 * MiB)
    m.free(m.malloc(15 * MiB))  # a cached 16 MiB segment
    m.malloc(30 * MiB)
    stats = m.memory_stats()
    assert stats["num_alloc_retries"] == 1
    assert stats["num_ooms"] == 0
    assert stats["reserved_bytes.all.current"] == 30 * MiB
    assert stats["num_device_free"] == 1


def test_request_that_cannot_fit_after_the_retry_raises_out_of_memory():
    m = model(capacity=40 * MiB)
    m.malloc(30 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        m.malloc(20 * MiB)
    stats = m.memory_stats()
    assert stats["num_alloc_retries"] == 1
    assert stats["num_ooms"] == 1


def test_out_of_memory_message_is_pytorchs():
    m = model(capacity="1 GiB")
    m.free(m.malloc(1000 * MiB))
    m.malloc(900 * MiB)  # cut from the cached 1000 MiB segment: 100 MiB stay reserved, split
    with pytest.raises(torch.OutOfMemoryError) as error:
        m.malloc(200 * MiB)
    assert str(error.value) == (
        "CUDA out of memory. Tried to allocate 200.00 MiB. GPU 0 has a total capacity of 1024.00 MiB of "
        "which 24.00 MiB is free. Of the allocated memory 900.00 MiB is allocated by PyTorch, and 100.00 MiB "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
        "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def test_out_of_memory_reports_the_segment_size_not_the_request():
    m = model(capacity=10 * MiB)
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"Tried to allocate 20\.00 MiB\. GPU 0 has a total capacity of "
        r"10\.00 MiB of which 10\.00 MiB is free\. Of the allocated memory 0 bytes is allocated",
    ):
        m.malloc(3 * MiB)


def test_failed_malloc_leaves_the_model_consistent_and_usable():
    m = model(capacity=40 * MiB)
    kept = m.malloc(30 * MiB)
    before = {k: v for k, v in m.memory_stats().items() if not k.startswith("num_")}
    with pytest.raises(torch.OutOfMemoryError):
        m.malloc(20 * MiB)
    after = {k: v for k, v in m.memory_stats().items() if not k.startswith("num_")}
    assert after == before
    assert_consistent(m)
    m.free(m.malloc(1 * MiB))
    m.free(kept)
    assert m.memory_stats()["allocated_bytes.all.current"] == 0


def test_request_of_an_exabyte_raises_out_of_memory_without_counting_an_oom():
    m = model()
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        m.malloc(2**60)
    assert m.memory_stats()["num_ooms"] == 0


def test_set_capacity_changes_the_limit_from_now_on_keeping_what_is_reserved():
    m = model(capacity=40 * MiB)
    m.malloc(30 * MiB)
    m.set_capacity("20 MiB")  # below what is reserved: the segment stays
    assert (m.capacity, m.memory_stats()["reserved_bytes.all.current"]) == (20 * MiB, 30 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        m.malloc(1000)
    m.set_capacity(None)
    m.malloc(1000)
    assert m.memory_stats()["reserved_bytes.all.current"] == 32 * MiB


def test_capacity_accepts_size_strings():
    assert model(capacity="2 GiB").capacity == 2 * 1024 * MiB


def test_capacity_that_is_not_a_size_is_rejected():
    with pytest.raises(ValueError, match="capacity 'lots' is not a size"):
        model(capacity="lots")
    with pytest.raises(TypeError, match="capacity must be an int"):
        model(capacity=1.5)


# -- max_split_size_mb ------------------------------------------------------------------------------


def test_max_split_size_is_reported_in_bytes_and_minus_one_when_unlimited():
    assert model(config="max_split_size_mb:64").memory_stats()["max_split_size"] == 64 * MiB
    assert model().memory_stats()["max_split_size"] == -1


def test_oversize_block_serves_a_large_request_whole_without_splitting():
    m = model(config="max_split_size_mb:20")
    m.free(m.malloc(40 * MiB))
    m.malloc(25 * MiB)
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.current"] == 40 * MiB
    assert stats["reserved_bytes.all.current"] == 40 * MiB
    assert stats["oversize_allocations.current"] == 1
    assert stats["oversize_segments.current"] == 1


def test_oversize_block_is_not_handed_out_for_a_request_below_max_split_size():
    m = model(config="max_split_size_mb:20")
    m.free(m.malloc(40 * MiB))
    m.malloc(15 * MiB)
    stats = m.memory_stats()
    assert stats["reserved_bytes.all.current"] == 56 * MiB
    assert stats["allocated_bytes.all.current"] == 16 * MiB


def test_oversize_block_is_not_used_when_it_exceeds_the_request_by_20_mib_or_more():
    m = model(config="max_split_size_mb:20")
    m.free(m.malloc(50 * MiB))
    m.malloc(30 * MiB)
    assert m.memory_stats()["reserved_bytes.all.current"] == 80 * MiB


def test_max_non_split_rounding_mb_widens_the_oversize_limit():
    m = model(config="max_split_size_mb:20,max_non_split_rounding_mb:40")
    m.free(m.malloc(50 * MiB))
    m.malloc(30 * MiB)
    assert m.memory_stats()["reserved_bytes.all.current"] == 50 * MiB


def test_with_max_split_size_a_failing_segment_first_frees_an_oversize_cached_block_without_a_retry():
    m = model(capacity=50 * MiB, config="max_split_size_mb:20")
    m.free(m.malloc(40 * MiB))
    m.malloc(19 * MiB)  # cannot use the oversize block; its 20 MiB segment needs the 40 MiB back
    stats = m.memory_stats()
    assert stats["reserved_bytes.all.current"] == 20 * MiB
    assert stats["num_device_free"] == 1
    assert stats["num_alloc_retries"] == 0
    assert stats["num_sync_all_streams"] == 0


# -- roundup_power2_divisions -----------------------------------------------------------------------


def test_roundup_power2_divisions_changes_the_granted_size():
    m = model(config="roundup_power2_divisions:4")
    m.malloc(5 * MiB + 1)
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.current"] == 6 * MiB
    assert stats["requested_bytes.all.current"] == 5 * MiB + 1


# -- configuration ----------------------------------------------------------------------------------


def test_config_default_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert CachingAllocatorModel().memory_stats()["max_split_size"] == 128 * MiB


def test_unknown_config_option_is_rejected():
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        model(config="colour:blue")


# -- statistics resets ------------------------------------------------------------------------------


def test_reset_peak_memory_stats_sets_peaks_to_current_values():
    m = model()
    a = m.malloc(4 * MiB)
    m.malloc(1000)
    m.free(a)
    m.reset_peak_memory_stats()
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 1024
    assert stats["reserved_bytes.all.peak"] == 22 * MiB


def test_reset_accumulated_memory_stats_zeroes_totals_and_counters():
    m = model()
    m.free(m.malloc(4 * MiB))
    m.empty_cache()
    m.reset_accumulated_memory_stats()
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.allocated"] == 0
    assert stats["allocated_bytes.all.freed"] == 0
    assert stats["num_device_alloc"] == 0
    assert stats["num_sync_all_streams"] == 0
    assert stats["reserved_bytes.all.peak"] == 20 * MiB


def test_table_is_the_live_stat_table_for_samplers():
    m = model()
    sample = m.table.sampler(["allocated_bytes.all.peak", "allocated_bytes.all.current"])
    m.free(m.malloc(4 * MiB))
    assert sample() == (4 * MiB, 0)
    assert sample() == (0, 0)


# -- bad input --------------------------------------------------------------------------------------


def test_negative_size_is_a_value_error():
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        model().malloc(-1)


@pytest.mark.parametrize("nbytes", [1.5, "512", None, True])
def test_non_int_size_is_a_type_error(nbytes):
    with pytest.raises(TypeError, match="nbytes must be an int number of bytes"):
        model().malloc(nbytes)


def test_int_like_sizes_are_accepted():
    m = model()
    m.malloc(torch.tensor(40_000).item())
    assert m.memory_stats()["requested_bytes.all.current"] == 40_000


def test_unknown_handle_is_a_value_error():
    with pytest.raises(ValueError, match="unknown handle 7: it was not returned by this allocator's malloc"):
        model().free(7)


def test_double_free_is_a_value_error_saying_so():
    m = model()
    handle = m.malloc(100)
    m.free(handle)
    with pytest.raises(ValueError, match=f"handle {handle} was already freed"):
        m.free(handle)


def test_non_int_handle_is_a_type_error():
    with pytest.raises(TypeError, match="handle must be an int"):
        model().free("1")


# -- snapshot ---------------------------------------------------------------------------------------


def test_snapshot_lists_segments_and_their_blocks():
    m = model()
    m.malloc(40_000)
    (segment,) = m.snapshot()
    assert segment["segment_type"] == "small"
    assert segment["total_size"] == 2 * MiB
    assert segment["allocated_size"] == 40_448
    assert segment["requested_size"] == 40_000
    assert [(b["size"], b["requested_size"], b["allocated"]) for b in segment["blocks"]] == [
        (40_448, 40_000, True),
        (2 * MiB - 40_448, 0, False),
    ]


# -- properties -------------------------------------------------------------------------------------

sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(4096, 1 * MiB + 4096),
    st.integers(1 * MiB, 12 * MiB),
    st.integers(12 * MiB, 64 * MiB),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes),
        st.tuples(st.just("free"), st.integers(0, 10**6)),
        st.tuples(st.just("empty_cache"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=operations,
    config=st.sampled_from(
        ["", "max_split_size_mb:20", "roundup_power2_divisions:[1:2,4:4,>:8]", "expandable_segments:True"]
    ),
    capacity=st.sampled_from([None, 64 * MiB, 200 * MiB]),
)
def test_random_malloc_free_sequences_keep_the_model_consistent(ops, config, capacity):
    m = model(capacity=capacity, config=config)
    live: dict[int, int] = {}
    for op, value in ops:
        if op == "malloc":
            try:
                handle = m.malloc(value)
            except torch.OutOfMemoryError:
                continue
            if handle:
                live[handle] = value
        elif op == "free" and live:
            handle = list(live)[value % len(live)]
            del live[handle]
            m.free(handle)
        elif op == "empty_cache":
            m.empty_cache()
        assert_consistent(m)
        stats = m.memory_stats()
        assert stats["requested_bytes.all.current"] == sum(live.values())
        granted = [b for s in m.snapshot() for b in s["blocks"] if b["allocated"]]
        assert sorted(b["requested_size"] for b in granted) == sorted(live.values())
        assert all(b["size"] >= round_size(b["requested_size"], m.config) for b in granted)
        if capacity is not None:
            assert stats["reserved_bytes.all.current"] <= capacity
