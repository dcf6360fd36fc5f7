"""Merging per-rank reports (plain data, no processes): values per rank, spread, status."""

from __future__ import annotations

import re

import pytest

from memlab.distributed.merge import FORMAT, MergedLines, MergedStats, merge_reports
from memlab.line_profiler.export import records_to_data
from memlab.line_profiler.records import FunctionTable

COLUMNS = ["hits", "active_bytes.all.peak"]


def lines_report(peaks: list[int | None], status: str = "profiled") -> dict:
    lines = [(10, "def step():", {"hits": 1, "active_bytes.all.peak": 0})]
    lines += [
        (11 + i, f"line {i}", None if p is None else {"hits": 1, "active_bytes.all.peak": p})
        for i, p in enumerate(peaks)
    ]
    data = records_to_data([FunctionTable("step", "train.py", 1, lines)], COLUMNS, "modelled")
    return {
        "format": FORMAT,
        "kind": "lines",
        "status": status,
        "error": None,
        "source": "modelled",
        "data": data,
    }


def empty_report(kind: str = "lines") -> dict:
    return {"format": FORMAT, "kind": kind, "status": "empty", "error": None, "source": None}


def test_each_line_has_every_ranks_value_the_extremes_and_the_skew():
    merged = merge_reports([lines_report([100, 300]), lines_report([200, 300]), lines_report([50, None])])
    assert isinstance(merged, MergedLines)
    assert merged.reported == [0, 1, 2]
    assert [values["active_bytes.all.peak"] for _, _, _, values in merged.lines] == [
        [0, 0, 0],
        [100, 200, 50],
        [300, 300, None],
    ]
    frame = merged.to_dataframe()
    assert frame.loc[("step", 11)].tolist() == [100, 200, 50, 200, 1, 50, 2, 150, "line 0"]
    # a tie goes to the lowest rank; a rank without a value is left out
    assert frame.loc[("step", 12)].tolist()[3:8] == [300, 0, 300, 0, 0]


def test_ranks_that_profiled_nothing_or_raised_are_named():
    raised = {**lines_report([7]), "status": "error", "error": "RuntimeError: boom"}
    merged = merge_reports([lines_report([5]), empty_report(), raised, "garbage"])
    assert merged.status() == (
        "1 of 4 ranks reported (0); rank 1 profiled nothing; rank 2 failed: RuntimeError: boom; "
        "rank 3 failed: sent str, not a memlab rank report (memlab.rank_report/1)"
    )
    # the failed rank's records still count where it sent them
    assert merged.lines[1][3]["active_bytes.all.peak"] == [5, None, 7, None]


def test_no_rank_profiled_anything():
    merged = merge_reports([empty_report(), empty_report("stats")])
    assert merged.status() == "0 of 2 ranks reported (none); ranks 0, 1 profiled nothing"
    assert merged.lines == [] and merged.render().startswith("memlab: hits across ranks: 0 of 2")


def test_a_column_that_was_not_gathered_is_a_value_error():
    with pytest.raises(
        ValueError, match=re.escape("column 'time' was not gathered; gathered: hits, active_bytes.all.peak")
    ):
        merge_reports([lines_report([1])]).to_dataframe("time")


def stats_report(peak: int, time_us: int | None) -> dict:
    data = {"allocated_peak": peak, "reserved_peak": 2 * peak, "allocated_current": 0, "reserved_current": 0}
    return {
        "format": FORMAT,
        "kind": "stats",
        "status": "profiled",
        "error": None,
        "source": "s",
        "data": {**data, "peak_time_us": time_us},
    }


def test_tracker_statistics_per_rank_and_the_rank_that_peaked_first():
    merged = merge_reports([stats_report(1024, 20), stats_report(3072, 10), empty_report("stats")])
    assert isinstance(merged, MergedStats)
    assert merged.values("allocated_peak") == [1024, 3072, None]
    assert merged.spread("reserved_peak") == {
        "max": 6144,
        "max_rank": 1,
        "min": 2048,
        "min_rank": 0,
        "skew": 4096,
    }
    assert merged.first_to_peak == 1
    assert merged.render().splitlines() == [
        "memlab: tracker statistics across ranks: 2 of 3 ranks reported (0, 1); rank 2 profiled nothing",
        "  rank  allocated peak   reserved peak",
        "     0           1.00K           2.00K",
        "     1           3.00K           6.00K",
        "     2                                ",
        "allocated peak: max 3.00K (rank 1), min 1.00K (rank 0), skew 2.00K",
        "reserved peak: max 6.00K (rank 1), min 2.00K (rank 0), skew 4.00K",
        "first to peak: rank 1",
    ]
    assert merged.to_dataframe()["allocated_peak"].tolist()[:2] == [1024, 3072]


def test_a_rank_that_sent_another_kind_is_an_error():
    merged = merge_reports([stats_report(1, None), lines_report([1])])
    assert (
        merged.status() == "1 of 2 ranks reported (0); rank 1 failed: sent lines where the others sent stats"
    )
