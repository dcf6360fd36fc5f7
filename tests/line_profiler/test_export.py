"""Line records outside the process: versioned plain data, and the rule for what read_json/read_csv read."""

from __future__ import annotations

import json
import pickle

import pandas as pd
import pytest
import torch

import memlab
from memlab.line_profiler import LineStats, read_csv, read_json
from memlab.line_profiler.export import records_from_data, records_to_data

U8 = torch.uint8
COLUMNS = ("allocated_bytes.all.peak", "allocated_bytes.all.freed", "hits", "delta")


def branch(flag):
    if flag:
        block = torch.empty(3000, dtype=U8)
    else:
        block = torch.empty(1024, dtype=U8)
    del block
    return 1


def never_called():
    return 1


@pytest.fixture
def profiled(exact):
    lp = memlab.LineProfiler(branch, never_called, columns=COLUMNS[:2])
    with lp:
        branch(True)
        branch(True)
    return lp


def test_records_round_trip_through_json_and_pickle(profiled):
    stats = profiled.display(None, COLUMNS)
    data = records_to_data(stats.tables, COLUMNS, profiled.source_line())
    first = branch.__code__.co_firstlineno
    assert data["format"] == "memlab.line_records" and data["version"] == 1
    assert data["source"] == (
        "modelled (no CUDA GPU here): exact bytes of cpu tensors (memlab.TensorTracker(allocator=None)); "
        "tensors made before the tracker was entered are not counted"
    )
    assert data["columns"] == list(COLUMNS)
    assert [(f["name"], f["calls"], f["filename"]) for f in data["functions"]] == [
        ("branch", 2, __file__),
        ("never_called", 0, __file__),
    ]
    assert data["functions"][0]["lines"][2] == [
        first + 2,
        "        block = torch.empty(3000, dtype=U8)",
        [3000, 0, 2, 6000],
    ]
    assert data["functions"][0]["lines"][3] == [first + 3, "    else:", None]
    assert data["functions"][0]["lines"][5] == [first + 5, "    del block", [3000, 6000, 2, -6000]]
    shown = LineStats(stats.tables, COLUMNS)
    for copy in (json.loads(json.dumps(data)), pickle.loads(pickle.dumps(data))):
        tables = records_from_data(copy)
        assert tables == stats.tables
        assert repr(LineStats(tables, copy["columns"], copy["source"])) == repr(
            profiled.display(None, COLUMNS)
        )
        assert repr(LineStats(tables, copy["columns"])) == repr(shown)
        assert LineStats(tables, copy["columns"])._repr_html_() == shown._repr_html_()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"format": "memlab.line_profiler/1"},
            "not memlab line records: expected format 'memlab.line_records' version 1, "
            "got format 'memlab.line_profiler/1'",
        ),
        (
            {"version": 2},
            "memlab line records version 2 is newer than this memlab reads; upgrade memlab "
            "(expected format 'memlab.line_records' version 1)",
        ),
        (
            {"version": "1"},
            "memlab line records version '1' is not a known version "
            "(expected format 'memlab.line_records' version 1)",
        ),
        (
            {"functions": [{"name": "f"}]},
            "malformed memlab line records (format 'memlab.line_records' version 1): KeyError('lines')",
        ),
    ],
)
def test_records_of_another_format_or_version_are_refused(change, message):
    data = {**records_to_data([], ["hits"]), **change}
    with pytest.raises(ValueError) as error:
        records_from_data(data)
    assert str(error.value) == message


def test_records_from_something_else_than_a_dict():
    with pytest.raises(TypeError) as error:
        records_from_data([])
    assert str(error.value) == "expected a dict of format 'memlab.line_records' version 1, got list"


@pytest.mark.parametrize("read", [read_json, read_csv])
def test_a_missing_file_is_file_not_found(read, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for missing in ("missing.json", tmp_path / "missing.csv", "dir, with comma/missing.csv"):
        with pytest.raises(FileNotFoundError):
            read(missing)


def test_text_and_paths_read_back_the_same(profiled, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    frame = profiled.to_dataframe()
    profiled.to_json("profile.json")
    profiled.to_csv("profile.csv")
    for read, text, path in (
        (read_json, "  " + profiled.to_json(), "profile.json"),
        (read_csv, profiled.to_csv(), "profile.csv"),
    ):
        pd.testing.assert_frame_equal(read(text), frame)
        pd.testing.assert_frame_equal(read(path), frame)
        pd.testing.assert_frame_equal(read(tmp_path / path), frame)
        with open(path, encoding="utf-8") as file:
            pd.testing.assert_frame_equal(read(file), frame)


def test_an_empty_csv_is_not_a_profile():
    with pytest.raises(ValueError, match="not a memlab line profile CSV"):
        read_csv("\n")
