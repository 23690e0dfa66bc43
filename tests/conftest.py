"""Test-session set-up: Triton through its interpreter when there is no GPU, poisoned
outputs, and the shared helpers (tests/helpers*.py) and the benchmarks' modules (bench/)
importable from every test folder."""

import os
import sys

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
