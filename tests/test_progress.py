"""A progress line is written, rewritten in place and ended only on a terminal (or when asked);
every update is a record on the ``memlab`` logger."""

from __future__ import annotations

import io
import logging

import pytest

from memlab._progress import Progress, progress_shown


class Terminal(io.StringIO):
    """A stream that says it is a terminal, and keeps what was written to it."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch):
    monkeypatch.delenv("MEMLAB_PROGRESS", raising=False)


def _work(stream) -> None:
    with Progress("search", stream=stream) as shown:
        shown.update("trying batch 128 (estimate 1)", logging.DEBUG)
        shown.update("batch 128 fits (1 estimate)")
        shown.done("largest batch 128; 1 estimate")


def test_on_a_terminal_one_line_is_rewritten_in_place_and_ended():
    terminal = Terminal()
    _work(terminal)
    assert terminal.getvalue() == (
        "\rmemlab search: trying batch 128 (estimate 1)"
        "\rmemlab search: batch 128 fits (1 estimate)  "  # spaces over the longer line before
        "\rmemlab search: largest batch 128; 1 estimate\n"
    )


def test_every_update_is_logged_on_the_memlab_logger(caplog):
    caplog.set_level(logging.DEBUG, logger="memlab")
    _work(io.StringIO())
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("memlab", "DEBUG", "search: trying batch 128 (estimate 1)"),
        ("memlab", "INFO", "search: batch 128 fits (1 estimate)"),
        ("memlab", "INFO", "search: largest batch 128; 1 estimate"),
    ]


def test_quiet_when_the_stream_is_not_a_terminal():
    stream = io.StringIO()
    _work(stream)
    assert stream.getvalue() == ""


@pytest.mark.parametrize(("progress", "setting", "shown"), [
    (False, None, False),  # asked: quiet on a terminal
    (None, "0", False),
    (None, "1", True),
    (True, "0", True),  # the argument wins over the environment
    (None, None, True),
])  # fmt: skip
def test_asked_for_or_against_by_argument_or_environment(progress, setting, shown, monkeypatch):
    if setting is not None:
        monkeypatch.setenv("MEMLAB_PROGRESS", setting)
    assert progress_shown(progress, Terminal()) is shown


def test_shown_when_asked_on_a_stream_that_is_not_a_terminal(monkeypatch):
    monkeypatch.setenv("MEMLAB_PROGRESS", "1")
    stream = io.StringIO()
    with Progress("estimate", stream=stream) as shown:
        shown.done("peak reserved 2.00M")
    assert stream.getvalue() == "\rmemlab estimate: peak reserved 2.00M\n"


def test_a_line_left_open_by_an_error_is_ended():
    terminal = Terminal()
    with pytest.raises(RuntimeError), Progress("estimate", stream=terminal) as shown:
        shown.update("step 1 of 2")
        raise RuntimeError("inside the work")
    assert terminal.getvalue() == "\rmemlab estimate: step 1 of 2\n"


def test_a_broken_stream_does_not_stop_the_work():
    terminal = Terminal()
    terminal.close()
    with Progress("estimate", stream=terminal) as shown:
        shown.update("step 1 of 2")
        shown.done("done")
    assert shown.shown is False


def test_bad_settings_are_typed_errors(monkeypatch):
    with pytest.raises(TypeError, match=r"progress must be True \(show it\), False \(hide it\) or None"):
        Progress("estimate", progress="yes")
    with pytest.raises(TypeError, match="task must be a non-empty str"):
        Progress("")
    monkeypatch.setenv("MEMLAB_PROGRESS", "true")
    with pytest.raises(ValueError, match=r"MEMLAB_PROGRESS must be 0 \(no progress line\) or 1 .*'true'"):
        Progress("estimate")
