"""Pure-torch paths of segment attention: the oracle for every attention kernel, and the
``"torch"`` backend.

Written to be plainly correct, not fast: they materialise the (B, Hq, Tq, Tk) scores. They
compute in the dtype they are given (tests pass float64 copies to get a high-precision
oracle), except softmax statistics, which are kept in at least float32. They do not
validate their inputs: the public op does that.

* :func:`segment_attention`: the oracle, from segment ids (differentiable by autograd).
* :func:`forward` / :func:`backward`: the ``"torch"`` backend, with the backend-module
  signatures (segment starts instead of ids; the backward by the explicit softmax-gradient
  formulas). A query whose key interval is empty (the encoding of a row with decreasing
  ids) gets NaN, as from the kernels.

Masked pairs contribute exactly nothing, to the output and to every gradient: each sum over
keys (or, for dK and dV, over queries) runs over the visible pairs only, so a NaN or inf in
a key, value, query or output gradient reaches only what sees it. In particular a NaN in one
document never reaches another document's outputs or gradients. (A plain masked matmul
would not do that: its masked weights are zeros, and 0 * NaN is NaN.) At visible pairs,
IEEE arithmetic as usual.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "capped",
    "segment_mask",
    "segment_attention",
    "forward",
    "backward",
    "query_starts",
    "start_probs",
    "sink_mean",
]


def segment_mask(
    segment_ids: torch.Tensor,
    q_len: Optional[int] = None,
    window: int = 0,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Boolean (B, Tq, Tk) mask: query i sees key j iff same segment, j <= position(i),
    j > position(i) - ``window`` (a window of 0: no window) and ``key_mask[b, j]`` (None:
    every key).

    ``segment_ids`` (B, Tk) labels the keys; the Tq = ``q_len`` queries are the last Tq
    positions (the decode form); Tq = Tk by default.
    """
    B, Tk = segment_ids.shape
    Tq = Tk if q_len is None else q_len
    pos_q = torch.arange(Tk - Tq, Tk, device=segment_ids.device)
    pos_k = torch.arange(Tk, device=segment_ids.device)
    seg_q = segment_ids[:, Tk - Tq :]
    same = seg_q[:, :, None] == segment_ids[:, None, :]
    causal = pos_k[None, :] <= pos_q[:, None]
    if window > 0:
        causal = causal & (pos_k[None, :] > pos_q[:, None] - window)
    mask = same & causal[None]
    return mask if key_mask is None else mask & key_mask.to(torch.bool)[:, None, :]


def _visible_sum(
    equation: str, w: torch.Tensor, x: torch.Tensor, vis: torch.Tensor
) -> torch.Tensor:
    """``torch.einsum(equation, w, x)`` over the visible pairs only: ``w`` (B, Hq, Tq, Tk) is
    zero wherever ``vis`` (broadcastable to it) is False, and there a non-finite ``x`` must
    add nothing. The products run on x with its non-finite entries zeroed; an output that a
    visible pair feeds from a non-finite entry is NaN (IEEE would give NaN or inf there)."""
    finite = torch.isfinite(x)
    out = torch.einsum(equation, w, torch.where(finite, x, 0))
    hits = torch.einsum(equation, vis.expand(w.shape).to(x.dtype), (~finite).to(x.dtype))
    return torch.where(hits > 0, float("nan"), out)


def capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scores soft-capped to (-softcap, softcap): ``softcap * tanh(s / softcap)``; 0: as
    they are."""
    return softcap * torch.tanh(s / softcap) if softcap else s


def _attend(
    q,
    k,
    v,
    mask,
    scale,
    upcast: bool = True,
    empty=None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
):
    """(o in q's dtype, lse, p) of softmax attention under the boolean (B, Tq, Tk) mask,
    computed in float32 (float64 for float64 inputs; q's dtype without ``upcast``); GQA by
    repeating the KV heads; v may have a head dim of its own. Scores are soft-capped
    (``softcap`` > 0); ``sinks`` (Hq,) adds one logit per head to every row's normaliser
    (a probability that goes to no value). p is exactly 0 at masked pairs. A row that sees
    nothing gets p = 0, o = 0 and lse = -inf (or, with sinks, the sink's logit), except the
    rows of ``empty`` (B, Tq) (None: every row that sees nothing), the encoding of
    decreasing ids: NaN."""
    group = q.shape[2] // k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    acc = acc if upcast else q.dtype
    kk = k.to(acc).repeat_interleave(group, dim=2)
    vv = v.to(acc).repeat_interleave(group, dim=2)
    vis = mask[:, None]
    s = capped(torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kk) * scale, softcap)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(acc)[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])[..., : k.shape[1]]
    p = torch.where(vis, p, 0.0)  # rows that see nothing: 0 (their lse is -inf)
    empty = ~vis.any(-1, keepdim=True) if empty is None else empty[:, None, :, None]
    p = p.masked_fill(empty, float("nan"))  # an empty interval: NaN
    return _visible_sum("bhqk,bkhd->bqhd", p, vv, vis).to(q.dtype), lse, p


def _probs_at_start(p: torch.Tensor, q_start: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """(B, Hq, Tq) probability of each query on its segment's first key; 0 where not counted."""
    B, Hq, Tq, Tk = p.shape
    idx = q_start.clamp(max=Tk - 1)[:, None, :, None].expand(B, Hq, Tq, 1)
    return torch.where(counted[:, None, :], torch.gather(p, 3, idx).squeeze(-1), 0.0)


def sink_mean(p_start: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """(B, Hq) mean over counted queries of the per-query probability (B, Hq, Tq); 0 where
    no query counts."""
    num = (p_start * counted[:, None, :]).sum(-1)
    den = counted.sum(-1).to(num.dtype)[:, None]
    return torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num))


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    upcast: bool = True,
    *,
    window: int = 0,
    key_mask: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
):
    """Causal attention inside segments, with GQA. Returns (o, lse, sink).

    q: (B, Tq, Hq, D); k: (B, Tk, Hkv, D), v: (B, Tk, Hkv, Dv), Tq <= Tk, queries aligned
    to the end; segment_ids: (B, Tk) or None (one segment). ``window`` > 0: a query at
    position p sees keys after p - window only; ``key_mask`` (B, Tk) bool: keys it clears
    are seen by no query; ``softcap`` > 0: scores become ``softcap * tanh(s / softcap)``;
    ``sinks`` (Hq,): one learned logit per head in every row's softmax normaliser. o: (B,
    Tq, Hq, Dv) in q's dtype (0 for a query that sees nothing); lse: (B, Hq, Tq)
    natural-log log-sum-exp of the scaled scores and the sink (float32 or float64); sink:
    (B, Hq) mean probability that a query puts on the first key of its own segment, over
    queries that are not themselves a segment start (0 where there are none).
    ``upcast=False`` computes everything in q's dtype: what plain PyTorch gets in that
    precision (the yardstick of the tests' tolerance rule).
    """
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    if segment_ids is None:
        segment_ids = torch.zeros(B, Tk, dtype=torch.long, device=q.device)
    scale = D**-0.5 if scale is None else scale
    mask = segment_mask(segment_ids, Tq, window, key_mask)
    none = torch.zeros(B, Tq, dtype=torch.bool, device=q.device)
    o, lse, p = _attend(q, k, v, mask, scale, upcast, none, softcap, sinks)
    # first key of each query's segment, and whether the query is that key itself
    pos_k = torch.arange(Tk, device=q.device)
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.cummax(torch.where(is_start, pos_k, torch.zeros_like(pos_k)), dim=1).values
    q_start = start_idx[:, Tk - Tq :]
    counted = q_start != pos_k[None, Tk - Tq :]
    return o, lse, sink_mean(_probs_at_start(p, q_start, counted), counted)


def _interval_mask(
    start: Optional[torch.Tensor],
    B: int,
    Tq: int,
    Tk: int,
    device,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible (B, Tq, Tk), empty (B, Tq)): query i sees key j iff start(i) <= j <=
    position(i), j > position(i) - window (0: no window) and key_ok[b, j]; ``empty`` marks
    the queries whose interval [start(i), position(i)] itself is empty (the encoding of
    decreasing ids)."""
    q_start, _ = query_starts(start, B, Tq, Tk, device)
    pos_k = torch.arange(Tk, device=device)
    pos_q = torch.arange(Tk - Tq, Tk, device=device)
    lo = q_start
    if window > 0:
        lo = torch.maximum(lo, pos_q[None, :] - window + 1)
    vis = (pos_k[None, None, :] >= lo[:, :, None]) & (pos_k[None, None, :] <= pos_q[None, :, None])
    if key_ok is not None:
        vis = vis & key_ok.to(torch.bool)[:, None, :]
    return vis, q_start > pos_q[None, :]


def forward(
    q,
    k,
    v,
    start: Optional[torch.Tensor],
    scale: float,
    want_sink: bool,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """(o, lse, psink or None) with the backend-module signature: ``start`` int32 (B, Tk)
    first position of every position's segment, or None (one segment per row); ``window``
    (0: none), ``key_ok`` (bool (B, Tk) or None) and ``softcap`` (0: none) as in
    :func:`segment_attention`. A query that sees nothing: o = 0, lse = -inf."""
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    mask, empty = _interval_mask(start, B, Tq, Tk, q.device, window, key_ok)
    o, lse, p = _attend(q, k, v, mask, scale, empty=empty, softcap=softcap)
    lse = lse.masked_fill(empty[:, None], float("nan"))
    psink = _probs_at_start(p, *query_starts(start, B, Tq, Tk, q.device)) if want_sink else None
    return o.contiguous(), lse.contiguous(), psink


def backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    start: Optional[torch.Tensor],
    end: Optional[torch.Tensor],
    scale: float,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """(dq, dk, dv) of :func:`forward` by the explicit softmax-gradient formulas. The
    probabilities come from ``lse`` (so an lse that also counts a sink logit gives the
    gradients of attention with that sink); a row whose lse is -inf has none."""
    B, Tq, Hq, D = q.shape
    Tk, hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g = Hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qa, ka, va, doa = (x.to(acc) for x in (q, k, v, do))
    kk, vv = ka.repeat_interleave(g, dim=2), va.repeat_interleave(g, dim=2)
    mask, _ = _interval_mask(start, B, Tq, Tk, q.device, window, key_ok)
    vis = mask[:, None]
    raw = torch.einsum("bqhd,bkhd->bhqk", qa, kk) * scale
    s = capped(raw, softcap)
    lse_a = lse.to(acc)[..., None]
    # a row whose lse is -inf sees no key (no probability); a NaN lse stays NaN
    p = torch.where(vis & (lse_a != float("-inf")), torch.exp(s - lse_a), 0.0)
    dp = torch.einsum("bqhd,bkhd->bhqk", doa, vv)
    pdp = torch.where(vis, p * dp, 0.0)
    ds = torch.where(vis, p * (dp - pdp.sum(-1, keepdim=True)), 0.0)
    if softcap:  # at masked pairs nothing, whatever their raw score
        ds = torch.where(vis, ds * (1 - torch.tanh(raw / softcap) ** 2), 0.0)
    dq = _visible_sum("bhqk,bkhd->bqhd", ds, kk, vis) * scale
    dk = _visible_sum("bhqk,bqhd->bkhd", ds, qa, vis).reshape(B, Tk, hkv, g, D).sum(3) * scale
    dv = _visible_sum("bhqk,bqhd->bkhd", p, doa, vis).reshape(B, Tk, hkv, g, Dv).sum(3)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous())


def query_starts(start: Optional[torch.Tensor], B: int, Tq: int, Tk: int, device):
    """(segment start of each query (B, Tq) int64, counted mask (B, Tq)): a query counts
    towards the sink statistic unless it is itself its segment's first token. ``start``:
    int32 (B, Tk) segment start of every position, or None (one segment per row)."""
    q_pos = torch.arange(Tk - Tq, Tk, device=device)
    s = (
        start[:, Tk - Tq :].long()
        if start is not None
        else torch.zeros(B, Tq, dtype=torch.long, device=device)
    )
    return s, s != q_pos[None, :]


def start_probs(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, start: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """(B, Hq, Tq) probability each query puts on its segment's first key, from the score
    against that key and the query's LSE; 0 for queries that do not count (see
    :func:`query_starts`). What a kernel that does not pick the sink out of its score tiles
    hands to the op."""
    B, Tq, Hq, D = q.shape
    Tk, hkv = k.shape[1], k.shape[2]
    s_q, counted = query_starts(start, B, Tq, Tk, q.device)
    k0 = torch.gather(k, 1, s_q[:, :, None, None].expand(B, Tq, hkv, D))
    s0 = (q.to(lse.dtype).reshape(B, Tq, hkv, Hq // hkv, D) * k0.to(lse.dtype)[:, :, :, None]).sum(
        -1
    )
    p0 = torch.exp(s0.reshape(B, Tq, Hq).transpose(1, 2) * scale - lse)
    return torch.where(counted[:, None, :], p0, 0.0)
