"""MemReporter and a tracker's history agree: where each storage was allocated, the same category names."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn

from memlab import MemReporter, TensorTracker


def test_rows_say_where_their_storage_was_allocated_and_take_the_trackers_categories():
    w = torch.ones(100, requires_grad=True)
    with TensorTracker(history=True) as tracker:
        line = sys._getframe().f_lineno + 1
        model = nn.Linear(10, 10)
        saved = (w * 3).exp()  # exp saves its output for backward: an activation
        frame = MemReporter(model, tracker=tracker).to_dataframe()
    rows = frame.set_index("name")
    here = f"{__file__}:{line}"
    assert [(rows.loc[n, "category"], rows.loc[n, "allocated_at"]) for n in ("weight", "bias")] == [
        ("parameter", here),
        ("parameter", here),
    ]
    (activation,) = frame[frame["category"] == "activation"].itertuples()
    assert (activation.memory, activation.allocated_at) == (400, f"{__file__}:{line + 1}")
    del saved


def test_the_active_tracker_is_used_when_none_is_given_and_the_text_report_gains_a_column():
    with TensorTracker(history=True):
        line = sys._getframe().f_lineno + 1
        model = nn.Linear(10, 10)
        out = io.StringIO()
        MemReporter(model).report(stream=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["Element", "type", "Size", "Used", "MEM", "Allocated", "at"]
    weight = next(row for row in lines if row.startswith("weight "))
    assert weight.split()[1:] == ["(10,", "10)", "400.00B", f"{__file__}:{line}"]


def test_without_history_rows_have_no_place():
    with TensorTracker() as tracker:
        model = nn.Linear(10, 10)
        frame = MemReporter(model, tracker=tracker).to_dataframe()
    assert "allocated_at" not in frame.columns
    assert set(frame.loc[frame["name"].isin(["weight", "bias"]), "category"]) == {"parameter"}


def test_a_tracker_that_is_not_a_tensor_tracker_is_a_type_error():
    with pytest.raises(TypeError, match=r"tracker must be a memlab\.TensorTracker or None, got str"):
        MemReporter(tracker="tracker")
