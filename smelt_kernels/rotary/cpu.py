"""The ``"cpu"`` backend of the rotary embedding: ``csrc/rotary/cpu_rotary.cpp``
(``torch.ops.smelt_cpu.rotary``). One pass forward and one backward (the same kernel
rotating back), for float32, bfloat16 and float16 ``x`` with float32 tables; each
position's cos/sin row is read once for all its heads."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import backends

__all__ = ["missing", "forward", "backward", "infer"]


@functools.cache  # the extension does not change within a process
def missing() -> Optional[str]:
    """None when the native kernel is available, else why not."""
    return backends.extension_op_missing("_cpu", "rotary", "csrc/rotary/cpu_rotary.cpp")


def forward(x, cos, sin):
    """``x`` rotated by the tables' angles."""
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.rotary(x, cos, sin, False)


def backward(dy, cos, sin):
    """dx: ``dy`` rotated back (by the negated angles)."""
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.rotary(dy, cos, sin, True)


infer = forward
