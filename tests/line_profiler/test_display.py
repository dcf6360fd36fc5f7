"""Renderers of the same records: text, HTML, DataFrame, JSON and CSV."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pandas as pd
import pytest
import torch

import memlab
from memlab.line_profiler import read_csv, read_json
from memlab.line_profiler.display import format_time

U8 = torch.uint8
COLUMNS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak")
EXACT = (
    "modelled (no CUDA GPU here): exact bytes of cpu tensors (memlab.TensorTracker(allocator=None)); "
    "tensors made before the tracker was entered are not counted"
)


def branch(flag):
    if flag:
        block = torch.empty(2048, dtype=U8)
    else:
        block = torch.empty(1024, dtype=U8)
    return block


def never_called():
    return 1


def line(func, offset):
    return func.__code__.co_firstlineno + offset


@pytest.fixture
def profiled(exact):
    lp = memlab.LineProfiler(branch, never_called, columns=COLUMNS)
    with lp:
        branch(True)
    return lp


def test_text_leaves_lines_that_never_ran_blank(profiled):
    assert repr(profiled.display(branch, COLUMNS)) == (
        f"{EXACT}\n"
        "\n"
        f"## branch  (tests/line_profiler/test_display.py:{line(branch, 0)})\n"
        "\n"
        "allocated_bytes reserved_bytes line  code\n"
        "            all            all\n"
        "           peak           peak\n"
        f"          0.00B          0.00B {line(branch, 0):>4}  def branch(flag):\n"
        f"          0.00B          0.00B {line(branch, 1):>4}      if flag:\n"
        f"          2.00K          2.00K {line(branch, 2):>4}          block = torch.empty(2048, dtype=U8)\n"
        f"                               {line(branch, 3):>4}      else:\n"
        f"                               {line(branch, 4):>4}          block = torch.empty(1024, dtype=U8)\n"
        f"          2.00K          2.00K {line(branch, 5):>4}      return block\n"
    )


def test_print_stats_shows_the_columns_asked_for_hits_and_delta_included(exact):
    lp = memlab.LineProfiler(branch, columns=("allocated_bytes.all.peak", "delta"))
    with lp:
        branch(False)
    out = io.StringIO()
    lp.print_stats(stream=out)
    assert out.getvalue().splitlines()[2:] == [
        f"## branch  (tests/line_profiler/test_display.py:{line(branch, 0)})",
        "",
        "allocated_bytes delta line  code",
        "            all",
        "           peak",
        f"          0.00B 0.00B {line(branch, 0):>4}  def branch(flag):",
        f"          0.00B 0.00B {line(branch, 1):>4}      if flag:",
        f"                      {line(branch, 2):>4}          block = torch.empty(2048, dtype=U8)",
        f"                      {line(branch, 3):>4}      else:",
        f"          1.00K 1.00K {line(branch, 4):>4}          block = torch.empty(1024, dtype=U8)",
        f"          1.00K 0.00B {line(branch, 5):>4}      return block",
    ]


def test_display_of_hits_alone_shows_hits_alone(exact):
    lp = memlab.LineProfiler(branch, columns=["hits"])
    with lp:
        branch(True)
    lp.add_columns(["delta", "hits"])  # added after: shown after, each once
    assert repr(lp.display()).splitlines()[2:] == [
        f"## branch  (tests/line_profiler/test_display.py:{line(branch, 0)})",
        "",
        "hits delta line  code",  # one-part columns: one header line, no blank ones
        f"   1 0.00B {line(branch, 0):>4}  def branch(flag):",
        f"   1 0.00B {line(branch, 1):>4}      if flag:",
        f"   1 2.00K {line(branch, 2):>4}          block = torch.empty(2048, dtype=U8)",
        f"           {line(branch, 3):>4}      else:",
        f"           {line(branch, 4):>4}          block = torch.empty(1024, dtype=U8)",
        f"   1 0.00B {line(branch, 5):>4}      return block",
    ]


def test_text_reports_a_registered_function_that_never_ran(profiled):
    assert repr(profiled.display(never_called)) == (
        f"{EXACT}\n\n## never_called  (tests/line_profiler/test_display.py:{line(never_called, 0)})\n\n"
        "registered, but never called while profiling\n"
    )


def test_text_shows_hits_delta_and_keys_with_fewer_parts(profiled):
    lp = memlab.LineProfiler(branch, columns=("num_alloc_retries", "oversize_allocations.peak"))
    with lp:
        branch(False)
    text = repr(lp.display(branch, ("hits", "delta", "num_alloc_retries", "oversize_allocations.peak")))
    assert text.splitlines()[4:7] == [
        "hits delta num_alloc_retries oversize_allocations line  code",
        " " * 45 + "peak",  # no column has a pool part: no blank line for it
        f"   1 0.00B                 0                    0 {line(branch, 0):>4}  def branch(flag):",
    ]
    assert text.splitlines()[10] == (
        f"   1 1.00K                 0                    0 {line(branch, 4):>4}"
        "          block = torch.empty(1024, dtype=U8)"
    )


def test_display_of_all_functions_joins_them_in_registration_order(profiled):
    text = repr(profiled.display(columns=COLUMNS))
    assert text.startswith(f"{EXACT}\n\n## branch  (tests/line_profiler/test_display.py:{line(branch, 0)})\n")
    assert text.endswith(
        f"\n\n\n## never_called  (tests/line_profiler/test_display.py:{line(never_called, 0)})\n\n"
        "registered, but never called while profiling\n"
    )


def test_html_draws_a_bar_per_column_scaled_to_its_largest_value(profiled):
    html = profiled.display(branch, COLUMNS)._repr_html_()
    assert html.startswith(
        f'<p>{EXACT}</p>\n<h3><span style="font-family: monospace">branch  '
        f"(tests/line_profiler/test_display.py:{line(branch, 0)})</span></h3>"
    )
    assert html.count("linear-gradient(90deg, #4878d0 100.0%, transparent 100.0%)") == 2
    assert html.count("linear-gradient(90deg, #ee854a 100.0%, transparent 100.0%)") == 2
    assert "block = torch.empty(2048, dtype=U8)" in html
    assert "<th>allocated_bytes</th><th>reserved_bytes</th><th>line</th><th>code</th>" in html


def test_html_heads_a_table_with_as_many_rows_as_its_column_names_have_parts(profiled):
    def thead(columns):
        html = profiled.display(branch, columns)._repr_html_()
        return html.split('<thead style="text-align: left">')[1].split("</thead>")[0]

    assert thead(("hits", "delta")) == "<tr><th>hits</th><th>delta</th><th>line</th><th>code</th></tr>"
    assert thead(("hits", "allocated_bytes.all.peak")) == (
        "<tr><th>hits</th><th>allocated_bytes</th><th>line</th><th>code</th></tr>"
        "<tr><th></th><th>all</th><th></th><th></th></tr>"
        "<tr><th></th><th>peak</th><th></th><th></th></tr>"
    )
    assert thead(("hits", "reserved_bytes.all.peak", "delta")) == (
        "<tr><th>hits</th><th>reserved_bytes</th><th>delta</th><th>line</th><th>code</th></tr>"
        "<tr><th></th><th>all</th><th></th><th></th><th></th></tr>"
        "<tr><th></th><th>peak</th><th></th><th></th><th></th></tr>"
    )


def test_html_escapes_source_and_reports_functions_that_never_ran(profiled):
    html = profiled.display(never_called)._repr_html_()
    assert "<p>registered, but never called while profiling</p>" in html


def test_print_stats_writes_to_sys_stdout_as_it_is_when_called(profiled):
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        profiled.print_stats(branch, COLUMNS)
    assert captured.getvalue() == repr(profiled.display(branch, COLUMNS))


def test_print_stats_writes_to_a_given_stream(profiled):
    stream = io.StringIO()
    profiled.print_stats(never_called, stream=stream)
    assert stream.getvalue() == (
        f"{EXACT}\n\n## never_called  (tests/line_profiler/test_display.py:{line(never_called, 0)})\n\n"
        "registered, but never called while profiling\n"
    )


def test_to_dataframe_has_one_row_per_source_line_and_nullable_integers(profiled):
    frame = profiled.to_dataframe(branch)
    first = line(branch, 0)
    assert list(frame.columns) == ["hits", *COLUMNS, "delta", "code"]
    assert frame.index.names == ["function", "line"]
    assert list(frame.index) == [("branch", first + i) for i in range(6)]
    assert [str(t) for t in frame.dtypes[:4]] == ["Int64", "Int64", "Int64", "Int64"]
    assert frame.loc[("branch", first + 2)].tolist() == [
        1,
        2048,
        2048,
        2048,
        "        block = torch.empty(2048, dtype=U8)",
    ]
    assert frame.loc[("branch", first + 4), "hits"] is pd.NA


def test_json_export_reads_back_into_the_same_dataframe(profiled):
    text = profiled.to_json()
    back = read_json(text)
    pd.testing.assert_frame_equal(back, profiled.to_dataframe())
    assert back.attrs["source"] == profiled.to_dataframe().attrs["source"] == EXACT


def test_csv_export_reads_back_into_the_same_dataframe(profiled, tmp_path):
    path = tmp_path / "profile.csv"
    profiled.to_csv(path)
    pd.testing.assert_frame_equal(read_csv(path), profiled.to_dataframe())


def test_json_file_export_with_chosen_columns_reads_back(profiled, tmp_path):
    path = tmp_path / "profile.json"
    profiled.to_json(path, func=branch, columns=("hits", "reserved_bytes.all.peak"))
    pd.testing.assert_frame_equal(
        read_json(path), profiled.to_dataframe(branch, ("hits", "reserved_bytes.all.peak"))
    )


def test_functions_are_selected_by_callable_name_or_list(profiled):
    by_name = profiled.to_dataframe("branch")
    pd.testing.assert_frame_equal(by_name, profiled.to_dataframe(branch))
    assert set(profiled.to_dataframe([branch, never_called]).index.get_level_values(0)) == {
        "branch",
        "never_called",
    }


def test_a_profiler_without_functions_says_so():
    assert repr(memlab.LineProfiler().display()) == "No functions registered\n"


def nap():
    time.sleep(0.01)
    return 1


def test_the_optional_time_column_sums_the_wall_time_of_each_line(exact):
    lp = memlab.LineProfiler(nap, columns=("time",))
    with lp:
        nap()
        nap()
    frame = lp.to_dataframe(nap, ("hits", "time"))
    assert frame["hits"].tolist() == [2, 2, 2]
    assert frame["time"].iloc[1] >= 20_000_000  # slept at least 2 x 10 ms
    assert frame["time"].iloc[0] == 0  # the def row is a state, not an interval


@pytest.mark.parametrize(
    ("nanoseconds", "text"),
    [
        (0, "0ns"),
        (999, "999ns"),
        (1000, "1.00us"),
        (999_994, "999.99us"),
        (4_560_000, "4.56ms"),
        (1_200_000_000, "1.20s"),
    ],
)
def test_times_print_in_human_units(nanoseconds, text):
    assert format_time(nanoseconds) == text


# -- the header names the file and line; docstrings are not rows ------------------------------------
EXAMPLE = '''\
import functools

import torch


def inner(n):
    """Make ``n`` bytes.

    A docstring of several lines, never executed.
    """
    return torch.empty(n, dtype=torch.uint8)


def outer():
    first = inner(1024)
    "a string after the first statement: not a docstring"
    return first, inner(2048)


def keep(func):
    @functools.wraps(func)
    def wrapper(*args):
        return func(*args)

    return wrapper


@keep
def decorated():
    \'\'\'One line.\'\'\'
    return torch.empty(512, dtype=torch.uint8)


def enclosing():
    def nested():
        """Nested,
with a docstring line at column 0."""
        return torch.empty(256, dtype=torch.uint8)

    return nested


def shares_a_line():
    """Doc."""; made = torch.empty(128, dtype=torch.uint8)  # noqa: E702
    return made


def no_docstring():
    return torch.empty(64, dtype=torch.uint8)


make = lambda: torch.empty(32, dtype=torch.uint8)  # noqa: E731
'''


@pytest.fixture
def example(tmp_path, monkeypatch):
    """``example.py`` in a fresh folder, imported as a module, with that folder as working directory."""
    import importlib.util

    (tmp_path / "example.py").write_text(EXAMPLE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("example", tmp_path / "example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)
    return module


def test_the_header_names_the_file_relative_to_the_working_directory_and_the_def_line(exact, example):
    lp = memlab.LineProfiler(example.outer, example.inner, columns=("allocated_bytes.all.peak",))
    with lp:
        example.outer()
    assert repr(lp.display()).split("\n", 2)[2] == (
        "## outer  (example.py:14)\n"
        "\n"
        "allocated_bytes line  code\n"
        "            all\n"
        "           peak\n"
        "          0.00B   14  def outer():\n"
        "          1.00K   15      first = inner(1024)\n"
        '          1.00K   16      "a string after the first statement: not a docstring"\n'
        "          3.00K   17      return first, inner(2048)\n"
        "\n"
        "\n"
        "## inner  (example.py:6)\n"
        "\n"
        "allocated_bytes line  code\n"
        "            all\n"
        "           peak\n"
        "          1.00K    6  def inner(n):\n"
        "          3.00K   11      return torch.empty(n, dtype=torch.uint8)\n"
    )


def test_the_header_names_a_file_outside_the_working_directory_as_the_code_does(exact, example, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    lp = memlab.LineProfiler(example.no_docstring)
    assert repr(lp.display()) == (
        f"## no_docstring  ({tmp_path / 'example.py'}:48)\n\nregistered, but never called while profiling\n"
    )


def test_html_heading_names_the_file_and_line(exact, example):
    lp = memlab.LineProfiler(example.no_docstring)
    with lp:
        example.no_docstring()
    assert '<h3><span style="font-family: monospace">no_docstring  (example.py:48)</span></h3>' in (
        lp.display()._repr_html_()
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "decorated",
            [(28, "@keep"), (29, "def decorated():"), (31, "    return torch.empty(512, dtype=torch.uint8)")],
        ),
        ("nested", [(35, "    def nested():"), (38, "        return torch.empty(256, dtype=torch.uint8)")]),
        (
            "shares_a_line",
            [
                (43, "def shares_a_line():"),
                (44, '    """Doc."""; made = torch.empty(128, dtype=torch.uint8)  # noqa: E702'),
                (45, "    return made"),
            ],
        ),
        (
            "no_docstring",
            [(48, "def no_docstring():"), (49, "    return torch.empty(64, dtype=torch.uint8)")],
        ),
        ("make", [(52, "make = lambda: torch.empty(32, dtype=torch.uint8)  # noqa: E731")]),
    ],
)
def test_docstring_lines_have_no_rows_in_every_kind_of_function(exact, example, name, expected):
    func = example.enclosing() if name == "nested" else getattr(example, name)
    lp = memlab.LineProfiler(func)
    with lp:
        func()
    (table,) = lp.display().tables
    assert [(number, code) for number, code, _ in table.lines] == expected
    assert all(values is not None for number, _, values in table.lines if number not in (28, 35))
    assert lp.to_dataframe().index.get_level_values("line").tolist() == [n for n, _ in expected]
