"""Pure-torch paths of the MoE op: the oracle for every MoE kernel, and the ``"torch"`` backend.

Written to be plainly correct, not fast. They compute in the dtype they are given (tests
pass float64 copies to get a high-precision oracle), except the router softmax, which is
kept in float32. They do not validate their inputs: the public ops do that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["route", "moe_ffn"]


def route(logits: torch.Tensor, top_k: int = 8, renormalize: bool = True):
    """Softmax over experts, then top-k. Returns (weights fp32 (T, k), ids int32 (T, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * W2[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),  e = ids[t, j].

    x: (T, H); w1: (E, 2*d_e, H), gate rows first then up rows; w2: (E, H, d_e);
    topk_weights, topk_ids: (T, k). One expert at a time, in x's dtype.
    """
    T, H = x.shape
    E, two_de, _ = w1.shape
    d_e = two_de // 2
    ids = topk_ids.long()
    y = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    for e in range(E):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        a = x[tok] @ w1[e].t()
        h = F.silu(a[:, :d_e]) * a[:, d_e:]
        out = h @ w2[e].t()
        y = y.index_add(0, tok, out * topk_weights[tok, slot].to(x.dtype)[:, None])
    return y
