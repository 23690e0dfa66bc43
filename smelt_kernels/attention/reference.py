"""Pure-torch paths of segment attention: the oracle for every attention kernel, and the
``"torch"`` backend.

Written to be plainly correct, not fast: they materialise the (B, Hq, Tq, Tk) scores. They
compute in the dtype they are given (tests pass float64 copies to get a high-precision
oracle), except softmax statistics, which are kept in at least float32. They do not
validate their inputs: the public op does that.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["segment_mask", "segment_attention", "query_starts", "start_probs"]


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


def query_starts(start: Optional[torch.Tensor], B: int, Tq: int, Tk: int, device):
    """(segment start of each query (B, Tq) int64, counted mask (B, Tq)): a query counts
    towards the sink statistic unless it is itself its segment's first token. ``start``:
    int32 (B, Tk) segment start of every position, or None (one segment per row)."""
    q_pos = torch.arange(Tk - Tq, Tk, device=device)
    s = start[:, Tk - Tq:].long() if start is not None else \
        torch.zeros(B, Tq, dtype=torch.long, device=device)
    return s, s != q_pos[None, :]


def start_probs(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                start: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """(B, Hq, Tq) probability each query puts on its segment's first key, from the score
    against that key and the query's LSE; 0 for queries that do not count (see
    :func:`query_starts`). What a kernel that does not pick the sink out of its score tiles
    hands to the op."""
    B, Tq, Hq, D = q.shape
    Tk, hkv = k.shape[1], k.shape[2]
    s_q, counted = query_starts(start, B, Tq, Tk, q.device)
    k0 = torch.gather(k, 1, s_q[:, :, None, None].expand(B, Tq, hkv, D))
    s0 = (q.to(lse.dtype).reshape(B, Tq, hkv, Hq // hkv, D) * k0.to(lse.dtype)[:, :, :, None]).sum(-1)
    p0 = torch.exp(s0.reshape(B, Tq, Hq).transpose(1, 2) * scale - lse)
    return torch.where(counted[:, None, :], p0, 0.0)
