"""Pure-torch reference implementations: the oracle for every kernel, and the ``"torch"`` backend.

Written to be plainly correct, not fast. They compute in the dtype they are given (tests
pass float64 copies to get a high-precision oracle), except softmax statistics, which are
kept in at least float32. They do not validate their inputs: the public ops do that.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "route",
    "moe_ffn",
    "segment_mask",
    "segment_attention",
]


# ----------------------------------------------------------------------------- MoE
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


# ----------------------------------------------------------------------------- attention
def segment_mask(segment_ids: torch.Tensor, q_len: Optional[int] = None) -> torch.Tensor:
    """Boolean (B, Tq, Tk) mask: query i sees key j iff same segment and j <= position(i).

    ``segment_ids`` (B, Tk) labels the keys; the Tq = ``q_len`` queries are the last Tq
    positions (the decode form); Tq = Tk by default.
    """
    B, Tk = segment_ids.shape
    Tq = Tk if q_len is None else q_len
    pos_q = torch.arange(Tk - Tq, Tk, device=segment_ids.device)
    pos_k = torch.arange(Tk, device=segment_ids.device)
    seg_q = segment_ids[:, Tk - Tq:]
    same = seg_q[:, :, None] == segment_ids[:, None, :]
    causal = pos_k[None, :] <= pos_q[:, None]
    return same & causal[None]


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
):
    """Causal attention inside segments, with GQA. Returns (o, lse, sink).

    q: (B, Tq, Hq, D); k, v: (B, Tk, Hkv, D), Tq <= Tk, queries aligned to the end;
    segment_ids: (B, Tk) or None (one segment). o: (B, Tq, Hq, D) in q's dtype;
    lse: (B, Hq, Tq) natural-log log-sum-exp of the scaled scores (float32 or float64);
    sink: (B, Hq) mean probability that a query puts on the first key of its own segment,
    over queries that are not themselves a segment start (0 where there are none).
    """
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if segment_ids is None:
        segment_ids = torch.zeros(B, Tk, dtype=torch.long, device=q.device)
    scale = D ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = Hq // Hkv
    kk = k.to(acc).repeat_interleave(group, dim=2)
    vv = v.to(acc).repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kk) * scale
    mask = segment_mask(segment_ids, Tq)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv).to(q.dtype)

    # first key of each query's segment, and whether the query is that key itself
    seg = segment_ids
    pos_k = torch.arange(Tk, device=q.device)
    is_start = torch.ones_like(seg, dtype=torch.bool)
    is_start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start_idx = torch.cummax(torch.where(is_start, pos_k, torch.zeros_like(pos_k)), dim=1).values
    q_start = start_idx[:, Tk - Tq:]  # (B, Tq)
    q_pos = pos_k[Tk - Tq:]
    counted = q_start != q_pos[None, :]  # (B, Tq)
    p_start = torch.gather(p, 3, q_start[:, None, :, None].expand(B, Hq, Tq, 1)).squeeze(-1)
    num = (p_start * counted[:, None, :]).sum(-1)
    den = counted.sum(-1).to(acc)[:, None]
    sink = torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num))
    return o, lse, sink
