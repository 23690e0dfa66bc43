"""Output allocation for kernel launchers, with optional poisoning.

With ``SMELT_POISON=1`` (the test suite sets it) every buffer a kernel is meant to write
completely is filled with NaN (floats) or the most negative integer before the launch, so
an element the kernel forgets to write fails the comparison instead of passing by luck.
"""

from __future__ import annotations

import os

import torch

__all__ = ["empty", "poisoning"]


def poisoning() -> bool:
    return os.environ.get("SMELT_POISON", "0") not in ("", "0")


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if poisoning():
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        elif dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(dtype).min)
    return t
