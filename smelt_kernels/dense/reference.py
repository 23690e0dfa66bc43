"""The ``"torch"`` backend of :func:`smelt_kernels.dense.linear`: ATen's GEMM (MKL's sgemm in
fp32 on x86 builds of torch), and the tests' oracle (in float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor, trans_w: bool = True) -> torch.Tensor:
    """``x @ weight^T`` (``trans_w``, weight (N, K)) or ``x @ weight`` (weight (K, N))."""
    return F.linear(x, weight) if trans_w else x @ weight


def weight_grad(dy: torch.Tensor, x: torch.Tensor, trans_w: bool = True) -> torch.Tensor:
    """The weight's gradient of :func:`linear` for output gradient ``dy`` (M, N) and input
    ``x`` (M, K): (N, K) for ``trans_w``, else (K, N)."""
    return dy.t().mm(x) if trans_w else x.t().mm(dy)
