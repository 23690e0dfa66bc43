"""Pure-torch RMSNorm: the eager form :class:`smelt_kernels.layers.RMSNorm` runs where the
native kernel does not, and the tests' oracle (in float64)."""

from __future__ import annotations

import torch

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, normalised in float32 (float64 stays
    float64), rounded to ``x``'s dtype before the gain."""
    xf = x if x.dtype == torch.float64 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight
