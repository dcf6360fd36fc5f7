"""The supported torch range: the version read without importing torch, and the error at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlab import _torch_version
from memlab._torch_version import UnsupportedTorchError, check_supported, parse_version, torch_at_least

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.12.0a0+git1234abc", (2, 12, 0)),
        ("2.8", (2, 8, 0)),
        ("10.1.2", (10, 1, 2)),
    ],
)
def test_versions_read_as_their_release_numbers(text, expected):
    assert parse_version(text) == expected


def test_a_string_that_is_no_version_is_refused_with_what_is_valid():
    with pytest.raises(
        ValueError, match=r"^not a torch version: 'nightly'; valid: a release such as '2.13.0'"
    ):
        parse_version("nightly")


def test_the_installed_version_is_torchs_own():
    assert _torch_version.torch_version() == parse_version(torch.__version__)
    major, minor, _ = parse_version(torch.__version__)
    assert torch_at_least(major, minor)
    assert not torch_at_least(major, minor + 1)


def test_an_older_torch_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(_torch_version, "_installed", lambda: "2.1.2")
    with pytest.raises(UnsupportedTorchError) as raised:
        check_supported()
    assert str(raised.value) == (
        "memlab needs torch 2.8 or newer (tested: 2.8.0, 2.11.0, 2.13.0, 2.14.1), but torch 2.1.2 is "
        "installed; install a supported one first, e.g. pip install 'torch>=2.8'"
    )
    assert isinstance(raised.value, ImportError)


def test_a_newer_torch_than_tested_warns_and_runs(monkeypatch):
    monkeypatch.setattr(_torch_version, "_installed", lambda: "2.99.0")
    with pytest.warns(
        UserWarning, match=r"^memlab is tested with torch 2\.8\.0, .*; torch 2\.99\.0 is newer than 2\.14"
    ):
        check_supported()


def test_import_memlab_beside_an_old_torch_says_so_in_one_line(tmp_path):
    # A torch 2.1.2 distribution first on sys.path: what importlib.metadata (and pip) would see.
    info = tmp_path / "torch-2.1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.1.2\n")
    result = subprocess.run(
        [sys.executable, "-c", "import memlab"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "memlab._torch_version.UnsupportedTorchError: memlab needs torch 2.8 or newer (tested: 2.8.0, "
        "2.11.0, 2.13.0, 2.14.1), but torch 2.1.2 is installed; install a supported one first, "
        "e.g. pip install 'torch>=2.8'"
    )
    assert "torch/" not in result.stderr  # raised before anything of torch's was imported
