"""The user's frames are told from libraries' by where their files lie, not by a list of names."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

import memlab
from memlab._user_code import is_library_file, user_frame


@pytest.mark.parametrize(
    "module",
    [torch, memlab, os, json, pytest],  # torch, memlab, the standard library, any installed package
)
def test_installed_packages_the_standard_library_torch_and_memlab_are_libraries(module):
    assert is_library_file(module.__file__)


def test_transformers_accelerate_and_lightning_are_libraries_by_location():
    # found, not imported: importing lightning leaves a torchmetrics tensor alive for good (conftest.py)
    for name in ("transformers", "accelerate", "lightning"):
        where = importlib.util.find_spec(name).origin
        assert is_library_file(where)
        assert is_library_file(os.path.join(os.path.dirname(where), "any", "file.py"))


def test_scripts_tests_and_cells_are_the_users():
    assert not is_library_file(__file__)
    assert not is_library_file("/tmp/train.py")
    assert not is_library_file("<stdin>")
    assert not is_library_file("<ipython-input-3-1f2e>")
    assert is_library_file("<frozen runpy>")


def test_the_innermost_user_frame_else_the_innermost():
    import transformers

    inside = (transformers.__file__, 66, "forward")
    mine = ("/tmp/train.py", 12, "step")
    assert user_frame([inside, mine, ("/tmp/train.py", 30, "<module>")]) == mine
    assert user_frame([inside]) == inside
    assert user_frame([]) is None
