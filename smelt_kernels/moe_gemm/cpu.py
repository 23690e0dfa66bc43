"""The ``"cpu"`` backend of the MoE ops: the native kernels of ``csrc/moe_gemm/cpu_*.cpp``
(``torch.ops.smelt_cpu.*``, from the optional ``smelt_kernels._cpu`` extension).

The forward sorts the (token, slot) pairs by expert with a stable counting sort, runs each
expert's two GEMMs with SwiGLU between them and combines in slot order; the backward runs the
dgrad and weight-gradient GEMMs on the same sort. fp32 forwards with experts of at most 1 MB
of weights run an AVX-512 kernel on row pointers (``cpu_rows.h``) where the CPU has it; the
rest run oneDNN brgemm micro-kernels on packed panels (``SMELT_CPU_GENERIC=1`` forces those).
Everything is bitwise deterministic and independent of the thread count.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends

__all__ = ["missing", "forward", "backward", "grouped_mm", "grouped_wgrad", "forward_kernel"]

_SOURCE = "csrc/moe_gemm/cpu_forward.cpp"


def missing(op: str) -> Optional[str]:
    """None if the extension provides ``torch.ops.smelt_cpu.<op>``, else why not."""
    return backends.extension_op_missing("_cpu", op, _SOURCE)


def forward(x, w1, w2, topk_weights, topk_ids, save_preact: bool):
    """(y, preact, order, rev, offsets): see :func:`smelt_kernels.moe_gemm.ops.moe_ffn`."""
    return torch.ops.smelt_cpu.moe_ffn_fwd(x, w1, w2, topk_weights, topk_ids, save_preact)


def backward(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets):
    """(dx, dw1, dw2, dtopk_weights) from the forward's saved sort and pre-activation."""
    return torch.ops.smelt_cpu.moe_ffn_bwd(grad_y, x, w1, w2, topk_weights, topk_ids, preact,
                                           order, rev, offsets)


def grouped_mm(a, b, offsets, gather, trans_b: bool):
    return torch.ops.smelt_cpu.grouped_mm(a, b, offsets, gather, trans_b)


def grouped_wgrad(dc, a, offsets, gather):
    return torch.ops.smelt_cpu.grouped_mm_wgrad(dc, a, offsets, gather)


def forward_kernel(hidden_size: int, expert_size: int, dtype: torch.dtype) -> str:
    """``"rows"``, ``"panels"`` or ``"panels-16bit"``: the forward kernel this shape gets here."""
    return torch.ops.smelt_cpu.moe_forward_kernel(hidden_size, expert_size, dtype)
