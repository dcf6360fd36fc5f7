"""``@memlab.profile``, ``@memlab.profile_every`` and the global profiler behind them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import memlab

U8 = torch.uint8


EXACT = (
    "modelled (no CUDA GPU here): exact bytes of cpu tensors (memlab.TensorTracker(allocator=None)); "
    "tensors made before the tracker was entered are not counted\n\n"
)


def run_script(tmp_path, source, **env):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,  # the tables name the script as script.py
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=True,
    )
    return result.stdout


def test_the_bare_decorator_records_and_reports_at_exit(global_profiler, exact, capsys):
    @memlab.profile
    def make():
        return torch.empty(4096, dtype=U8)

    make()
    global_profiler.print_at_exit()
    first = make.__wrapped__.__code__.co_firstlineno + 1
    assert capsys.readouterr().out == EXACT + (
        "## test_the_bare_decorator_records_and_reports_at_exit.<locals>.make"
        f"  (tests/line_profiler/test_decorators.py:{first})\n"
        "\n"
        "active_bytes reserved_bytes line  code\n"
        "         all            all\n"
        "        peak           peak\n"
        f"                            {first - 1:>4}      @memlab.profile\n"
        f"       0.00B          0.00B {first:>4}      def make():\n"
        f"       4.00K          4.00K {first + 1:>4}          return torch.empty(4096, dtype=U8)\n"
    )


def test_the_decorator_with_columns_records_and_reports_those_columns(global_profiler, exact, capsys):
    @memlab.profile(columns=("hits", "allocated_bytes.all.allocated"))
    def make():
        return torch.empty(100, dtype=U8)

    make()
    make()
    global_profiler.print_at_exit()
    lines = capsys.readouterr().out.splitlines()
    assert lines[4:7] == ["hits allocated_bytes line  code", "                 all", "           allocated"]
    assert lines[-1].split()[:2] == ["2", "200.00B"]


class Model:
    def __init__(self, width):
        self.width = width

    @memlab.profile(columns=("allocated_bytes.all.peak",))
    def forward(self):
        return torch.empty(self.width, dtype=U8)


def test_the_decorator_works_on_methods(global_profiler, exact, rows):
    assert Model(3000).forward().numel() == 3000
    assert rows(global_profiler, Model.forward, ("hits", "allocated_bytes.all.peak")) == [
        ('@memlab.profile(columns=("allocated_bytes.all.peak",))', None, None),
        ("def forward(self):", 1, 0),
        ("return torch.empty(self.width, dtype=U8)", 1, 3000),
    ]


def test_profile_every_prints_the_stats_of_each_group_of_calls(global_profiler, exact, capsys):
    @memlab.profile_every(2, columns=("hits", "allocated_bytes.all.peak"))
    def make(n):
        return torch.empty(n, dtype=U8)

    for n in (1024, 2048, 3072, 4096, 5120):
        make(n)
    out = capsys.readouterr().out
    assert out.count(EXACT) == 2  # each report says where its numbers come from
    tables = out.replace(EXACT, "").split("## ")[1:]
    assert len(tables) == 2
    assert tables[0].endswith("\n\n") and tables[1].endswith("\n\n")  # a blank line after each
    tables = [table.rstrip("\n") for table in tables]
    name = "test_profile_every_prints_the_stats_of_each_group_of_calls.<locals>.make"
    where = f"(tests/line_profiler/test_decorators.py:{make.__wrapped__.__code__.co_firstlineno + 1})"
    assert tables[0].startswith(f"{name} (calls 1-2)  {where}\n")
    assert tables[1].startswith(f"{name} (calls 3-4)  {where}\n")
    assert tables[0].splitlines()[-1].split()[:2] == ["2", "2.00K"]
    assert tables[1].splitlines()[-1].split()[:2] == ["2", "4.00K"]


def test_profile_every_prints_the_calls_left_over_at_exit_once(global_profiler, exact, capsys):
    @memlab.profile_every(output_interval=2, columns=("hits", "allocated_bytes.all.peak"))
    def make(n):
        return torch.empty(n, dtype=U8)

    for n in (1024, 2048, 3072):
        make(n)
    name = "test_profile_every_prints_the_calls_left_over_at_exit_once.<locals>.make"
    first = make.__wrapped__.__code__.co_firstlineno
    where = f"(tests/line_profiler/test_decorators.py:{first + 1})"
    assert capsys.readouterr().out.count(f"## {name} (calls 1-2)  {where}\n") == 1
    global_profiler.print_at_exit()
    assert capsys.readouterr().out == EXACT + (
        f"## {name} (call 3)  {where}\n"
        "\n"
        "hits allocated_bytes line  code\n"
        "                 all\n"
        "                peak\n"
        f"                     {first:>4}      @memlab.profile_every(output_interval=2, "
        'columns=("hits", "allocated_bytes.all.peak"))\n'
        f"   1           0.00B {first + 1:>4}      def make(n):\n"
        f"   1           3.00K {first + 2:>4}          return torch.empty(n, dtype=U8)\n"
        "\n"
    )
    global_profiler.print_at_exit()  # printed once: nothing is left now
    assert capsys.readouterr().out == ""


def test_profile_every_leftovers_are_printed_when_the_interpreter_exits(tmp_path):
    out = run_script(
        tmp_path,
        """
        import torch, memlab

        @memlab.profile_every(output_interval=2, columns=("hits",))
        def make():
            return torch.empty(10)

        for _ in range(3):
            make()
        print("end of script")
        """,
    )
    assert [line for line in out.splitlines() if line.startswith(("## ", "end"))] == [
        "## make (calls 1-2)  (script.py:5)",
        "end of script",
        "## make (call 3)  (script.py:5)",
    ]


def test_profile_every_disabled_returns_the_function_unchanged():
    def make():
        return 1

    assert memlab.profile_every(3, enable=False)(make) is make


def test_memlab_profile_0_turns_the_decorators_into_no_ops(monkeypatch):
    monkeypatch.setenv("MEMLAB_PROFILE", "0")

    def make():
        return 1

    assert memlab.profile(make) is make
    assert memlab.profile(columns=("hits",))(make) is make
    assert memlab.profile_every(2)(make) is make


def test_clear_global_line_profiler_forgets_the_numbers_but_keeps_profiling(global_profiler, exact, rows):
    @memlab.profile
    def make():
        return torch.empty(10, dtype=U8)

    make()
    memlab.clear_global_line_profiler()
    assert rows(global_profiler, make, ("hits",))[1] == ("def make():", None)
    make()
    assert rows(global_profiler, make, ("hits",))[1] == ("def make():", 1)


def test_set_target_gpu_meta_measures_meta_tensors(global_profiler, exact, rows):
    memlab.set_target_gpu("meta")

    @memlab.profile(columns=("allocated_bytes.all.peak",))
    def make():
        on_meta = torch.empty(1 << 20, dtype=U8, device="meta")
        on_cpu = torch.empty(10, dtype=U8)
        return on_meta, on_cpu

    make()
    assert rows(global_profiler, make, ("allocated_bytes.all.peak",))[2:] == [
        ('on_meta = torch.empty(1 << 20, dtype=U8, device="meta")', 1 << 20),
        ("on_cpu = torch.empty(10, dtype=U8)", 1 << 20),
        ("return on_meta, on_cpu", 1 << 20),
    ]


def test_nothing_happens_at_import_or_decoration_time(tmp_path):
    out = run_script(
        tmp_path,
        """
        import atexit, sys, threading
        import torch
        callbacks = atexit._ncallbacks()
        import memlab

        @memlab.profile
        def make():
            return 1

        registered = atexit._ncallbacks() - callbacks
        state = (sys.gettrace(), threading.gettrace(), torch.cuda.is_initialized(), registered)
        # one exit hook: the line on calls that ran in DataLoader workers, which only the process
        # that decorated can print (a function called only in workers has no table to follow);
        # without such calls it prints nothing (the output below is empty)
        assert state == (None, None, False, 1), state
        """,
    )
    assert out == ""


def test_the_report_is_printed_at_exit_once_a_profiled_function_ran(tmp_path):
    out = run_script(
        tmp_path,
        """
        import torch
        import memlab

        @memlab.profile
        def inner():
            torch.nn.Linear(100, 100)

        @memlab.profile
        def outer():
            linear = torch.nn.Linear(100, 100)
            linear2 = torch.nn.Linear(100, 100)
            inner()

        outer()
        """,
    )
    assert out == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        "(memlab.TensorTracker); no tensors existed before profiling\n\n"
        "## inner  (script.py:6)\n\nactive_bytes reserved_bytes line  code\n         all            all\n"
        "        peak           peak\n"
        "                               5  @memlab.profile\n"
        "      80.00K          2.00M    6  def inner():\n"
        "     120.00K          2.00M    7      torch.nn.Linear(100, 100)\n"
        "\n\n"
        "## outer  (script.py:10)\n\nactive_bytes reserved_bytes line  code\n         all            all\n"
        "        peak           peak\n"
        "                               9  @memlab.profile\n"
        "       0.00B          0.00B   10  def outer():\n"
        "      40.00K          2.00M   11      linear = torch.nn.Linear(100, 100)\n"
        "      80.00K          2.00M   12      linear2 = torch.nn.Linear(100, 100)\n"
        "     120.00K          2.00M   13      inner()\n"
    )


def test_nothing_is_printed_at_exit_when_no_profiled_function_ran(tmp_path):
    out = run_script(
        tmp_path,
        """
        import memlab

        @memlab.profile
        def make():
            return 1
        """,
    )
    assert out == ""


def test_memlab_profile_0_runs_without_tracing_or_report(tmp_path):
    out = run_script(
        tmp_path,
        """
        import sys
        import memlab

        @memlab.profile
        def make():
            return sys.gettrace()

        print(make())
        """,
        MEMLAB_PROFILE="0",
    )
    assert out == "None\n"


def test_profile_every_on_a_generator_reports_when_the_generator_is_exhausted(global_profiler, exact, capsys):
    @memlab.profile_every(1, columns=("hits", "allocated_bytes.all.peak"))
    def chunks(n):
        for _ in range(n):
            yield torch.empty(1024, dtype=U8)

    assert [c.numel() for c in chunks(2)] == [1024, 1024]
    out = capsys.readouterr().out
    assert out.count("## ") == 1 and "(call 1)" in out
    assert out.endswith("\n\n")
    assert out.splitlines()[-2].split()[:2] == ["2", "2.00K"]


def test_the_decorator_on_a_class_profiles_its_methods(global_profiler, exact, capsys):
    @memlab.profile(columns=("hits",))
    class Counter:
        def __init__(self):
            self.count = 0

        def bump(self):
            self.count += 1
            return self.count

    counter = Counter()
    assert (counter.bump(), counter.bump()) == (1, 2)
    global_profiler.print_at_exit()
    out = capsys.readouterr().out
    assert out.count("## ") == 2
    assert [line.split()[0] for line in out.splitlines() if line.strip().endswith("return self.count")] == [
        "2"
    ]


def test_set_target_gpu_inside_profiled_code_applies_from_the_next_call(global_profiler, exact, rows):
    @memlab.profile(columns=("allocated_bytes.all.peak",))
    def make():
        block = torch.empty(1024, dtype=U8, device="meta")
        memlab.set_target_gpu(torch.device("meta"))
        return block

    make()  # measured on the default device (cpu): the meta block is not there
    make()  # measured on meta
    assert rows(global_profiler, make, ("hits", "allocated_bytes.all.peak"))[2] == (
        'block = torch.empty(1024, dtype=U8, device="meta")',
        2,
        1024,
    )
    assert global_profiler.target_gpu == torch.device("meta")
