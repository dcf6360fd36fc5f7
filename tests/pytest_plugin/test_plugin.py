"""The pytest plugin, run on test files with ``pytester``: limits, leaks, the table, the suite-wide
limit and usage errors. On CPU a TensorTracker models the CUDA caching allocator: ``torch.empty(n)``
of float32 takes ``4n`` bytes rounded up to 512 B; a first block of at most 1 MiB reserves a 2 MiB
segment, a larger one below 10 MiB a 20 MiB segment, a larger one its size rounded up to 2 MiB.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest_plugins = ["pytester"]

TESTS = """\
import pytest
import torch

keep = []


@pytest.mark.limit_tensor_memory("64 MiB")
def test_over():
    a = torch.empty(16 * 1024 * 1024)
    b = torch.empty(4 * 1024 * 1024)
    del a, b


@pytest.mark.limit_tensor_memory("64 MiB")
def test_under():
    a = torch.empty(1024 * 1024)


@pytest.mark.limit_tensor_leaks("1 MiB")
def test_leak():
    keep.append(torch.empty(1024 * 1024))
    x = torch.empty(1024)


def test_plain():
    a = torch.empty(2 * 1024 * 1024)
"""


@pytest.fixture(autouse=True, scope="module")
def measuring_imported() -> None:
    """Import what measuring imports (torch._dynamo with it) before the in-process runs: pytester
    removes the modules a run imported when it ends, and torch cannot import them twice."""
    from memlab.pytest_plugin.measure import measured

    with measured(history=True, leaks=True) as measurement:
        torch.empty(1)
    measurement.peak_sites("allocated")


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_file=textwrap.dedent(source))
    return pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--strict-markers", *args
    )


def block(lines: list[str], first: str, count: int) -> list[str]:
    """The ``count`` lines of output that start at the line equal to ``first``."""
    start = lines.index(first)
    return lines[start : start + count]


def test_a_test_over_its_limit_fails_with_its_peak_and_the_lines_that_held_it(pytester):
    result = run(pytester, TESTS, "-k", "over or under")
    result.assert_outcomes(failed=1, passed=1)
    assert block(
        result.outlines,
        "Test was limited to 64.00M of allocated tensor memory but peaked at 80.00M on cpu",
        4,
    ) == [
        "Test was limited to 64.00M of allocated tensor memory but peaked at 80.00M on cpu",
        "Allocations held at the peak, most bytes first:",
        "     64.00M in 1 tensor   test_file.py:9  a = torch.empty(16 * 1024 * 1024)",
        "     16.00M in 1 tensor   test_file.py:10  b = torch.empty(4 * 1024 * 1024)",
    ]
    assert "FAILED test_file.py::test_over - Failed: Test was limited to 64.00M" in result.stdout.str()


def test_a_leaking_test_fails_naming_the_line_that_allocated_what_survived(pytester):
    result = run(pytester, TESTS, "-k", "leak")
    result.assert_outcomes(failed=1)
    first = (
        "Test was limited to 1.00M of leaked tensor memory but 4.00M was still allocated at its end on cpu"
    )
    assert block(result.outlines, first, 3) == [
        first,
        "Allocations still alive, most bytes first:",
        "      4.00M in 1 tensor   test_file.py:21  keep.append(torch.empty(1024 * 1024))",
    ]


def test_the_memlab_table_lists_the_highest_peaks_allocated_and_reserved(pytester):
    result = run(pytester, TESTS, "--memlab", "--memlab-top", "3")
    result.assert_outcomes(failed=2, passed=2)
    header = " allocated   reserved  device  test"
    assert block(result.outlines, header, 5) == [
        header,
        "    80.00M     80.00M  cpu     test_file.py::test_over",
        "     8.00M     20.00M  cpu     test_file.py::test_plain",
        "     4.00M     22.00M  cpu     test_file.py::test_leak",
        "Peaks of each test call's own tensors (setup and teardown excluded); cuda: torch.cuda.memory_stats, "
        "other devices: the CUDA caching allocator modelled by memlab.TensorTracker (with the cuBLAS "
        "workspaces of the GPU it models, named after the test where a matmul made them; "
        "CUBLAS_WORKSPACE_CONFIG=:0:0 turns them off)",
    ]
    assert "memlab: tests with the highest tensor peaks" in result.outlines[result.outlines.index(header) - 1]


def test_a_suite_wide_limit_applies_to_every_test_and_a_mark_overrides_it(pytester):
    result = run(pytester, TESTS, "--memlab-limit", "6 MiB", "-k", "plain or under")
    result.assert_outcomes(failed=1, passed=1)
    assert (
        "Test was limited to 6.00M of allocated tensor memory but peaked at 8.00M on cpu" in result.outlines
    )
    assert "FAILED test_file.py::test_plain - Failed: Test was limited to 6.00M" in result.stdout.str()


def test_the_suite_wide_limit_can_come_from_the_ini_file(pytester):
    pytester.makeini("[pytest]\nmemlab_limit = 2 MiB\n")
    result = run(pytester, TESTS, "-k", "plain or under")
    result.assert_outcomes(failed=1, passed=1)
    assert (
        "Test was limited to 2.00M of allocated tensor memory but peaked at 8.00M on cpu" in result.outlines
    )


def test_the_reserved_metric_checks_the_modelled_segments(pytester):
    source = """\
        import pytest, torch

        @pytest.mark.limit_tensor_memory("16 MiB", metric="reserved")
        def test_reserved():
            a = torch.empty(2 * 1024 * 1024)
        """
    result = run(pytester, source)
    result.assert_outcomes(failed=1)
    assert (
        "Test was limited to 16.00M of reserved tensor memory but peaked at 20.00M on cpu" in result.outlines
    )
    assert "      8.00M in 1 tensor   test_file.py:5  a = torch.empty(2 * 1024 * 1024)" in result.outlines


def test_meta_tensors_are_measured_on_the_meta_device_without_taking_memory(pytester):
    source = """\
        import pytest, torch

        @pytest.mark.limit_tensor_memory("1 GiB", device="meta")
        def test_big():
            weights = [torch.empty(256, 1024, 1024, device="meta") for _ in range(3)]
        """
    result = run(pytester, source)
    result.assert_outcomes(failed=1)
    assert block(
        result.outlines, "Test was limited to 1.00G of allocated tensor memory but peaked at 3.00G on meta", 3
    ) == [
        "Test was limited to 1.00G of allocated tensor memory but peaked at 3.00G on meta",
        "Allocations held at the peak, most bytes first:",
        "      3.00G in 3 tensors  test_file.py:5  "
        'weights = [torch.empty(256, 1024, 1024, device="meta") for _ in range(3)]',
    ]


def test_a_test_that_raises_reports_its_own_error_not_its_limit(pytester):
    source = """\
        import pytest, torch

        @pytest.mark.limit_tensor_memory(1024)
        def test_raises():
            a = torch.empty(1024 * 1024)
            raise RuntimeError("own failure")
        """
    result = run(pytester, source)
    result.assert_outcomes(failed=1)
    assert "FAILED test_file.py::test_raises - RuntimeError: own failure" in result.outlines
    assert not any(line.startswith("Test was limited") for line in result.outlines)


@pytest.mark.parametrize(
    ("mark", "error"),
    [
        (
            "limit_tensor_memory('64 MiB', metric='peak')",
            "metric must be one of 'allocated', 'reserved'; got 'peak'",
        ),
        (
            "limit_tensor_memory('lots')",
            "limit 'lots' is not a size; write a number with an optional unit",
        ),
        (
            "limit_tensor_memory()",
            "limit_tensor_memory(limit, metric='allocated', device=None) needs a limit, "
            "e.g. limit_tensor_memory('64 MiB')",
        ),
        (
            "limit_tensor_memory('1 GiB', devise='cpu')",
            "limit_tensor_memory(limit, metric='allocated', device=None) got an unknown argument 'devise'; "
            "valid: limit, metric, device",
        ),
        ("limit_tensor_memory('1 GiB', device='gpu')", "device 'gpu' is not a device; valid: 'cpu', 'meta'"),
        ("limit_tensor_leaks(-1)", "limit must be >= 0 bytes, got -1"),
        ("limit_tensor_leaks('1 MiB', 'cpu')", "limit_tensor_leaks(limit) takes at most 1 arguments, got 2"),
    ],
)
def test_bad_mark_arguments_are_usage_errors_naming_the_test(pytester, mark, error):
    source = f"""\
        import pytest

        @pytest.mark.{mark}
        def test_marked():
            pass
        """
    result = run(pytester, source)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: test_file.py::test_marked: @pytest.mark.{mark}: {error}" in result.stderr.str()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--memlab-limit", "2 gigs"], "ERROR: --memlab-limit '2 gigs' is not a size"),
        (["--memlab", "--memlab-top", "0"], "ERROR: --memlab-top must be 1 or more, got 0"),
    ],
)
def test_bad_options_are_usage_errors(pytester, args, error):
    result = run(pytester, "def test_nothing():\n    pass\n", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert error in result.stderr.str()


def test_without_marks_or_options_the_plugin_imports_nothing_and_measures_nothing(pytester):
    # A fresh interpreter: the plugin is loaded through its entry point, torch never imported.
    source = """\
        import sys

        def test_untouched(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("memlab")
            assert not pytestconfig.pluginmanager.has_plugin("memlab-measuring")
            assert [m for m in ("torch", "pandas") if m in sys.modules] == []
        """
    pytester.makepyfile(test_file=textwrap.dedent(source))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=1)


def test_a_failing_measured_test_shows_its_own_line_and_no_plugin_or_tracker_frame(pytester):
    source = """\
        import pytest, torch

        def reshape(x):
            return x.view(3, 7)

        @pytest.mark.limit_tensor_memory("1 MiB")
        def test_fails():
            reshape(torch.ones(10))
        """
    result = run(pytester, source, "--tb=long")
    result.assert_outcomes(failed=1)
    shown = failure(result.outlines)
    assert not [line for line in shown if "memlab" in line or "torch/" in line]
    assert shown[-6:] == [  # ends where the test's code called the op
        "    def reshape(x):",
        ">       return x.view(3, 7)",
        "               ^^^^^^^^^^^^",
        "E       RuntimeError: shape '[3, 7]' is invalid for input of size 10",
        "",
        "test_file.py:4: RuntimeError",
    ]
    # unmeasured, the same test fails with the same traceback
    plain = run(pytester, source.replace('@pytest.mark.limit_tensor_memory("1 MiB")', "#"), "--tb=long")
    assert [line for line in failure(plain.outlines) if line.strip() != "#"] == [
        line for line in shown if "limit_tensor_memory" not in line
    ]


def failure(lines: list[str]) -> list[str]:
    """The lines of the one failure's report, up to its ``file:line: Error`` line."""
    start = next(i for i, line in enumerate(lines) if "FAILURES" in line) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("test_file.py:4: ")) + 1
    return lines[start:end]


NESTED_CAPACITY = """\
import pytest
import torch

import memlab


def test_nested_capacity():
    a = torch.empty(1024 * 1024)
    with memlab.TensorTracker(capacity="8 MiB"), pytest.raises(torch.OutOfMemoryError):
        torch.empty(4 * 1024 * 1024)  # 16 MiB: refused by the test's own tracker, allocated by no GPU
"""


def test_a_request_a_tracker_in_the_test_refuses_is_not_in_the_table(pytester):
    result = run(pytester, NESTED_CAPACITY, "--memlab")
    result.assert_outcomes(passed=1)
    header = " allocated   reserved  device  test"
    assert block(result.outlines, header, 2) == [
        header,
        "     4.00M     20.00M  cpu     test_file.py::test_nested_capacity",
    ]


MATMUL = """\
import pytest
import torch


@pytest.mark.limit_tensor_memory("16 MiB")
def test_linear():
    model = torch.nn.Linear(1024, 1024)
    model(torch.randn(1024, 1024)).sum().backward()
"""


def test_a_matmul_tests_message_and_row_name_the_modelled_workspaces(pytester):
    """The forward's and the autograd thread's cuBLAS workspaces of the H100 modelled, 32 MiB each
    (CublasHandlePool.cpp on sm90), are in the peak: the message and the table say so."""
    result = run(pytester, MATMUL, "--memlab")
    result.assert_outcomes(failed=1)
    note = "includes 2 modelled cuBLAS workspaces of the H100: 64.00M"
    (head,) = [line for line in result.outlines if line.startswith("Test was limited to 16.00M")]
    assert head.endswith(f" on cpu; {note}")
    (row,) = [line for line in result.outlines if line.endswith("test_file.py::test_linear  (" + note + ")")]
    assert row.split()[2] == "cpu"


def test_cublas_workspace_config_0_0_leaves_the_workspaces_out(pytester, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    result = run(pytester, MATMUL, "--memlab")
    result.assert_outcomes(passed=1)  # the tensors alone fit in 16 MiB
    (row,) = [line for line in result.outlines if "test_file.py::test_linear" in line and "cpu" in line]
    assert row.endswith("test_file.py::test_linear")
