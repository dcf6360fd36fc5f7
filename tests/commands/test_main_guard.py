"""``memlab run`` runs a script with an ``if __name__ == "__main__":`` guard in two parts: the
script behaves as under ``python`` (line numbers, ``from __future__``, names bound below the
guard), and a name given with ``-f`` is checked in between."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from memlab.cli import main
from memlab.commands._main_guard import split_at_main_guard
from memlab.line_profiler import decorators


@pytest.fixture(autouse=True)
def fresh_global_profiler(monkeypatch: Any) -> None:
    monkeypatch.setattr(decorators, "_global", None)


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("guard", "split"),
    [
        ('if __name__ == "__main__":', True),
        ("if __name__ == '__main__':", True),
        ('if "__main__" == __name__:', True),
        ('if __name__ != "__main__":', False),
        ('if __name__ == "__main__" and True:', False),
        ('while __name__ == "__main__":', False),
    ],
)
def test_only_the_main_guard_splits_a_script(guard: str, split: bool) -> None:
    source = (
        f"def f():\n    return 1\n\n{guard}\n    f()\n    break\n"
        if guard.startswith("while")
        else (f"def f():\n    return 1\n\n{guard}\n    f()\n")
    )
    assert (split_at_main_guard(source, "s.py") is not None) is split


def test_the_names_the_main_part_may_bind() -> None:
    source = textwrap.dedent(
        """\
        import os

        def helper():
            global late
            late = 1

        if __name__ == "__main__":
            import json as js, xml.dom
            from collections import OrderedDict as od
            for i, (j, k) in enumerate([(1, 2)]):
                pass
            with open(os.devnull) as handle:
                pass
            try:
                pass
            except OSError as error:
                pass
            def defined_below():
                inner_local = 1
            class Below:
                attribute = 1
            squares = [n * n for n in range(3)]
        """
    )
    split = split_at_main_guard(source, "s.py")
    assert split is not None and split.may_bind == {
        *("js", "xml", "od", "i", "j", "k", "handle", "error", "defined_below", "Below", "squares"),
        "late",  # declared global in a function the main part may call
    }
    assert split_at_main_guard(source + "    from os.path import *\n", "s.py").may_bind is None


def test_the_two_parts_keep_line_numbers_future_imports_and_the_docstring(
    tmp_path: Path, capsys: Any
) -> None:
    script = write(
        tmp_path,
        "script.py",
        '''\
        """The module's docstring."""
        from __future__ import annotations

        import sys


        if __name__ == "__main__":
            def annotated(x: NotDefinedAnywhere) -> None:  # noqa: F821 (postponed annotations)
                return None
            print(__doc__, annotated.__annotations__["x"], sys._getframe().f_lineno)
            raise ValueError("from the main part")
        ''',
    )
    assert main(["run", str(script)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "The module's docstring. NotDefinedAnywhere 10\n"
    assert captured.err.splitlines()[-4:] == [
        f'  File "{script}", line 11, in <module>',
        '    raise ValueError("from the main part")',
        "ValueError: from the main part",
        "memlab run: nothing was profiled: decorate functions with @memlab.profile or name them with -f",
    ]


def test_a_name_the_main_part_imports_is_not_reported_early_and_is_profiled(
    tmp_path: Path, capsys: Any
) -> None:
    write(tmp_path, "memlab_guard_helpers.py", "import torch\n\n\ndef step():\n    return torch.empty(256)\n")
    script = write(
        tmp_path,
        "train.py",
        """\
        import sys

        print("defined")

        if __name__ == "__main__":
            sys.path.insert(0, sys.argv[1])
            from memlab_guard_helpers import step
            step()
        """,
    )
    assert main(["run", "-f", "step", str(script), str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("defined\n")
    assert captured.out.split("\n\n", 1)[1].splitlines() == [
        f"## step  ({tmp_path / 'memlab_guard_helpers.py'}:4)",
        "",
        "active_bytes reserved_bytes line  code",
        "         all            all",
        "        peak           peak",
        "       0.00B          0.00B    4  def step():",
        "       1.00K          2.00M    5      return torch.empty(256)",
    ]


def test_a_function_bound_by_assignment_above_the_guard_is_profiled_from_the_guard_on(
    tmp_path: Path, capsys: Any
) -> None:
    script = write(
        tmp_path,
        "train.py",
        """\
        import functools
        import torch

        def make(n):
            return torch.empty(n)

        step = functools.partial(make, 256)

        if __name__ == "__main__":
            step()
        """,
    )
    assert main(["run", "-f", "step", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.split("\n\n", 1)[1].splitlines() == [
        f"## make  ({script}:4)",
        "",
        "active_bytes reserved_bytes line  code",
        "         all            all",
        "        peak           peak",
        "       0.00B          0.00B    4  def make(n):",
        "       1.00K          2.00M    5      return torch.empty(n)",
    ]


def test_a_script_without_a_guard_is_checked_once_at_its_end(tmp_path: Path, capsys: Any) -> None:
    script = write(tmp_path, "flat.py", "def work():\n    return 1\n\nprint(work())\n")
    assert main(["run", "-f", "wrok", str(script)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == (
        "1\n",
        f"memlab run: error: -f wrok: {script} defines no function named wrok; it defines work\n",
    )


def test_a_name_a_function_may_declare_global_is_checked_only_at_the_end(tmp_path: Path, capsys: Any) -> None:
    script = write(
        tmp_path,
        "late.py",
        """\
        import functools
        import torch

        def make(n):
            return torch.empty(n)

        def install():
            global step
            step = functools.partial(make, 64)

        if __name__ == "__main__":
            install()
            step()
        """,
    )
    assert main(["run", "-f", "step", str(script)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # bound, though only after it ran: never reported as undefined
    assert captured.out.split("\n\n", 1)[1] == (
        f"## make  ({script}:4)\n\nregistered, but never called while profiling\n"
    )
