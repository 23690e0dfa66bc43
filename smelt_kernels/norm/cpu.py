"""The ``"cpu"`` backend of RMSNorm: ``csrc/norm/cpu_rmsnorm.cpp``
(``torch.ops.smelt_cpu.rms_norm_fwd`` / ``rms_norm_bwd``). One pass per row forward and one
backward, for float32, bfloat16 and float16 inputs whose weight has their dtype; bitwise the
same at any thread count."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import backends

__all__ = ["missing", "forward", "backward", "infer"]


@functools.cache  # the extension does not change within a process
def missing() -> Optional[str]:
    """None when the native kernel is available, else why not."""
    return backends.extension_op_missing("_cpu", "rms_norm_fwd", "csrc/norm/cpu_rmsnorm.cpp")


def forward(x, weight, eps):
    """(y, rstd): the normalised rows and each row's 1/rms (float32), which backward reads."""
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.rms_norm_fwd(x, weight, eps)


def backward(dy, x, weight, rstd):
    """(dx, dweight)."""
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.rms_norm_bwd(dy, x, weight, rstd)


def infer(x, weight, eps):
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.rms_norm_fwd(x, weight, eps)[0]
