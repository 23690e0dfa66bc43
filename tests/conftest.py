"""Test-session set-up: Triton through its interpreter when there is no GPU, poisoned
outputs, and the shared helpers (tests/helpers*.py) and the benchmarks' modules (bench/)
importable from every test folder, and a small real corpus."""

import os
import shutil
import sys
from pathlib import Path

# Both must be set before any module that defines Triton kernels is imported.
os.environ.setdefault("SMELT_POISON", "1")
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.join(os.path.dirname(_TESTS), "bench")]

import helpers  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from smelt_model.data.corpus import stdlib_root  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def triton_device():
    """The device Triton kernels run on here (skips the test where there is none)."""
    return helpers.triton_device()


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend_device(request):
    """(backend, device) for each CPU-side backend: a test runs once per backend (Triton on
    its device, skipped where there is none)."""
    return request.param, helpers.device_for(request.param)


# a small real corpus for the data, trainer and analysis tests
CORPUS_MODULES = (
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
    for name in CORPUS_MODULES:
        shutil.copy(stdlib_root() / f"{name}.py", root / f"{name}.py")
    return root
