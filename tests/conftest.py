"""Test-session set-up: Triton through its interpreter when there is no GPU, poisoned outputs."""

import os

# Both must be set before any module that defines Triton kernels is imported.
os.environ.setdefault("SMELT_POISON", "1")
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

