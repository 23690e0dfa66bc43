"""Pure-torch rotary embedding: the eager form :func:`smelt_kernels.rotary.apply_rotary` runs
where the native kernel does not, and the tests' oracle (in float64)."""

from __future__ import annotations

import torch

__all__ = ["apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x1 c - x2 s`` and ``x2 c + x1 s`` over the two halves of the last dimension, in
    float32 (float64 stays float64), rounded to ``x``'s dtype. x (B, T, heads, D); cos/sin
    (T, D/2) or (B, T, D/2), broadcast over the heads."""
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float64 else x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads (and batch)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
