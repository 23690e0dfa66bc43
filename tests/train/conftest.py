"""Shared pieces of the trainer tests: a small real corpus and micro model configs."""

import shutil
from pathlib import Path

import pytest

from smelt_model.train.data import stdlib_root

MODULES = (
    "textwrap",
    "string",
    "glob",
    "fnmatch",
    "shlex",
    "bisect",
    "heapq",
    "colorsys",
    "keyword",
    "copy",
    "abc",
    "numbers",
)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A dozen standard-library modules, one document each."""
    root = tmp_path_factory.mktemp("corpus")
    for name in MODULES:
        shutil.copy(stdlib_root() / f"{name}.py", root / f"{name}.py")
    return root
