"""Byte sizes: parsing the strings people write and printing sizes like pytorch_memlab."""

from __future__ import annotations

import math

import pytest

from memlab._units import format_size, format_sizes_apart, parse_size


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("0", 0),
        ("1024", 1024),
        ("512 B", 512),
        ("512b", 512),
        ("1K", 1024),
        ("64 KiB", 65_536),
        ("1 KB", 1000),
        ("2 GiB", 2_147_483_648),
        ("2gib", 2_147_483_648),
        ("512MB", 512_000_000),
        ("64 MiB", 67_108_864),
        ("1.5 K", 1536),
        (".5 KiB", 512),
        ("1.0001 K", 1024),
        ("1 T", 1024**4),
        ("1 TB", 1000**4),
        ("1 PiB", 1024**5),
        ("  3 M  ", 3 * 1024**2),
    ],
)
def test_parse_size_reads_numbers_with_binary_and_decimal_units(text, nbytes):
    assert parse_size(text) == nbytes


def test_parse_size_passes_ints_through():
    assert parse_size(0) == 0
    assert parse_size(40_960) == 40_960


@pytest.mark.parametrize("text", ["", "lots", "2 GiBs", "-1", "1e3", "1,024", "K", "2 G B"])
def test_parse_size_rejects_strings_that_are_not_sizes(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_parse_size_rejects_negative_ints():
    with pytest.raises(ValueError, match="size must be >= 0 bytes, got -1"):
        parse_size(-1)


@pytest.mark.parametrize("value", [1.5, None, True, b"1K", [1]])
def test_parse_size_rejects_other_types(value):
    with pytest.raises(TypeError, match="must be an int number of bytes or a string"):
        parse_size(value)


def test_parse_size_names_the_argument_in_errors():
    with pytest.raises(ValueError, match="capacity 'big' is not a size"):
        parse_size("big", name="capacity")


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0.00B"),
        (512, "512.00B"),
        (1023, "1023.00B"),
        (1024, "1.00K"),
        (40_960, "40.00K"),
        (2_097_152, "2.00M"),
        (1024**3, "1.00G"),
        (1024**4, "1.00T"),
        (1024**5, "1.00P"),
        (1024**6, "1024.00P"),
        (-1536, "-1.50K"),
        (1.5, "1.50B"),
    ],
)
def test_format_size_prints_1024_based_units_with_two_decimals(nbytes, text):
    assert format_size(nbytes) == text


def test_format_size_prints_nan_as_empty():
    assert format_size(math.nan) == ""


@pytest.mark.parametrize(
    ("sizes", "texts"),
    [
        ((1 << 20, (1 << 20) + 4096), ["1.00M (1,048,576 B)", "1.00M (1,052,672 B)"]),
        ((1 << 20, 1 << 20), ["1.00M", "1.00M"]),  # equal sizes read equal: no bytes needed
        ((1 << 20, 2 << 20), ["1.00M", "2.00M"]),
        ((1023, 1024), ["1023.00B", "1.00K"]),
        ((1024, 1029), ["1.00K (1,024 B)", "1.00K (1,029 B)"]),
        ((1024, 1030), ["1.00K", "1.01K"]),
        ((512, 512, 513), ["512.00B", "512.00B", "513.00B"]),
    ],
)
def test_sizes_that_differ_never_read_the_same(sizes, texts):
    assert format_sizes_apart(*sizes) == texts
