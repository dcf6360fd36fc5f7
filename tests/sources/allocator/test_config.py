"""The caching allocator's size arithmetic and PYTORCH_CUDA_ALLOC_CONF parsing, at their boundaries."""

from __future__ import annotations

import pytest

from memlab.sources.allocator.config import (
    UNLIMITED,
    AllocatorConfig,
    allocation_size,
    is_small,
    parse_alloc_conf,
    pool_name,
    round_size,
)

KiB = 1024
MiB = 1024 * 1024


def divisions(n: int) -> AllocatorConfig:
    return parse_alloc_conf(f"roundup_power2_divisions:{n}")


# -- round_size -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "granted"),
    [
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (40_000, 40_448),
        (400, 512),
        (1 * MiB, 1 * MiB),
        (1 * MiB + 1, 1 * MiB + 512),
    ],
)
def test_round_size_rounds_up_to_a_multiple_of_512_bytes_with_512_minimum(nbytes, granted):
    assert round_size(nbytes) == granted


def test_round_size_with_4_divisions_rounds_5_mib_plus_1_to_6_mib():
    assert round_size(5 * MiB + 1, divisions(4)) == 6 * MiB


def test_round_size_with_4_divisions_rounds_1_mib_plus_1_to_the_next_quarter():
    assert round_size(1 * MiB + 1, divisions(4)) == 1 * MiB + 256 * KiB


def test_round_size_with_divisions_keeps_powers_of_two():
    assert round_size(4 * MiB, divisions(4)) == 4 * MiB


def test_round_size_with_divisions_leaves_requests_up_to_512_times_divisions_to_512_rounding():
    # 1200 B is not above 512 * 4 = 2048 B, so plain rounding applies (not 1280 B)
    assert round_size(1200, divisions(4)) == 1536
    assert round_size(2048, divisions(4)) == 2048
    assert round_size(2049, divisions(4)) == 2560


def test_round_size_with_one_division_is_plain_rounding():
    assert round_size(5 * MiB + 1, divisions(1)) == 5 * MiB + 512


def test_round_size_uses_the_divisions_of_the_request_size_interval():
    config = parse_alloc_conf("roundup_power2_divisions:[1:0,2:4,4:0]")
    assert round_size(1 * MiB + 1, config) == 1 * MiB + 512  # [1, 2) MiB: 0 divisions
    assert round_size(2 * MiB + 1, config) == 2 * MiB + 512 * KiB  # [2, 4) MiB: 4 divisions
    assert round_size(4 * MiB + 1, config) == 4 * MiB + 512  # [4, …) MiB: 0 divisions


# -- pools and segment sizes -----------------------------------------------------------------------


def test_one_mib_is_the_largest_small_pool_size():
    assert is_small(1 * MiB) and pool_name(1 * MiB) == "small_pool"
    assert not is_small(1 * MiB + 512) and pool_name(1 * MiB + 512) == "large_pool"


@pytest.mark.parametrize(
    ("size", "segment"),
    [
        (512, 2 * MiB),
        (1 * MiB, 2 * MiB),
        (1 * MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (10 * MiB + 512, 12 * MiB),
        (21 * MiB, 22 * MiB),
    ],
)
def test_allocation_size_is_2_mib_small_20_mib_below_10_mib_else_rounded_to_2_mib(size, segment):
    assert allocation_size(size) == segment


# -- parse_alloc_conf --------------------------------------------------------------------------------


def test_empty_config_gives_pytorch_defaults():
    config = parse_alloc_conf("")
    assert config.max_split_size == UNLIMITED
    assert config.reported_max_split_size == -1
    assert config.max_non_split_rounding_size == 20 * MiB
    assert config.roundup_power2_divisions == (0,) * 16
    assert config.expandable_segments is False


def test_config_reads_every_modelled_option():
    config = parse_alloc_conf(
        "max_split_size_mb:128, max_non_split_rounding_mb:40,roundup_power2_divisions:4,"
        "expandable_segments:False,garbage_collection_threshold:0.6,backend:native"
    )
    assert config.max_split_size == 128 * MiB
    assert config.reported_max_split_size == 128 * MiB
    assert config.max_non_split_rounding_size == 40 * MiB
    assert config.roundup_power2_divisions == (4,) * 16
    assert config.garbage_collection_threshold == 0.6


def test_interval_divisions_fill_below_the_first_entry_and_from_the_last_entry_on_like_pytorch():
    # PyTorch fills '>' from the last listed interval itself, so 512 MB gets 4, not 2
    config = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert config.roundup_power2_divisions == (1,) * 9 + (4,) * 7


def test_options_without_effect_on_device_memory_are_accepted():
    config = parse_alloc_conf("release_lock_on_cudamalloc:True,pinned_num_register_threads:8")
    assert config == AllocatorConfig(source="release_lock_on_cudamalloc:True,pinned_num_register_threads:8")


@pytest.mark.parametrize("threads", [1, 2, 64, 128])
def test_pinned_num_register_threads_accepts_powers_of_2_up_to_128(threads):
    text = f"pinned_num_register_threads:{threads}"
    assert parse_alloc_conf(text) == AllocatorConfig(source=text)


@pytest.mark.parametrize("threads", [0, 3, 96, 256])
def test_pinned_num_register_threads_rejects_what_pytorch_rejects(threads):
    with pytest.raises(
        ValueError,
        match=f"pinned_num_register_threads must be a power of 2 from 1 to 128, got '{threads}'",
    ):
        parse_alloc_conf(f"pinned_num_register_threads:{threads}")


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown option 'max_split_mb'; valid options are: .*max_split_size_mb"
    ):
        parse_alloc_conf("max_split_mb:128")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_split_size_mb:abc", "max_split_size_mb expects a non-negative integer, got 'abc'"),
        ("max_split_size_mb:19", "max_split_size_mb too small, must be >= 20, got 19"),
        ("max_split_size_mb", "expected 'max_split_size_mb:<value>'"),
        ("expandable_segments:true", "expected True or False for expandable_segments, got 'true'"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of 2, got '3'"),
        ("roundup_power2_divisions:[3:2]", "intervals must be powers of 2"),
        ("roundup_power2_divisions:[256:2", "missing its closing"),
        ("garbage_collection_threshold:1.5", r"must be in \(0.0, 1.0\)"),
        ("max_split_size_mb:128;expandable_segments:True", "expects a non-negative integer"),
        ("backend:cudaMallocAsync", "backend:cudaMallocAsync is not modelled"),
        ("backend:other", "unknown allocator backend 'other'"),
        ("per_process_memory_fraction:0.5", "'per_process_memory_fraction' is not modelled"),
    ],
)
def test_bad_config_values_raise_value_error(text, message):
    with pytest.raises(ValueError, match=message):
        parse_alloc_conf(text)


def test_config_must_be_a_string():
    with pytest.raises(TypeError, match="config must be a string"):
        parse_alloc_conf(128)  # type: ignore[arg-type]


def test_none_reads_pytorch_cuda_alloc_conf_first(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:32")
    assert parse_alloc_conf(None).max_split_size == 64 * MiB


def test_none_falls_back_to_pytorch_alloc_conf(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:32")
    assert parse_alloc_conf(None).max_split_size == 32 * MiB


def test_none_without_environment_gives_defaults(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert parse_alloc_conf(None) == AllocatorConfig()
