"""Pure-torch paths of the MoE ops: the oracle for every MoE kernel, and the ``"torch"`` backend.

Written to be plainly correct, not fast: one expert at a time over the (token, slot) pairs
sorted by expert, reading the group offsets on the host. They compute in the dtype they are
given (tests pass float64 copies to get a high-precision oracle), except the router softmax,
which is kept in float32. They do not validate their inputs: the public ops do that.

* :func:`route`: softmax over experts, top-k, optional renormalisation.
* :func:`sort_pairs`: the routing sort (a stable device sort) the kernels build with a
  counting sort.
* :func:`moe_ffn`: the oracle; :func:`moe_ffn_fwd` / :func:`moe_ffn_bwd`: the same forward
  with what backward keeps, and its explicit backward (the ``"torch"`` backend of
  ``torch.ops.smelt.moe_ffn_fwd`` / ``moe_ffn_bwd``).
* :func:`grouped_gemm` / :func:`grouped_gemm_wgrad`: the grouped GEMM and its weight gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "route",
    "sort_pairs",
    "moe_ffn",
    "moe_ffn_fwd",
    "moe_ffn_bwd",
    "grouped_gemm",
    "grouped_gemm_wgrad",
]


def route(logits: torch.Tensor, top_k: int = 8, renormalize: bool = True):
    """Softmax over experts, then top-k. Returns (weights fp32 (T, k), ids int32 (T, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int):
    """The (token, slot) pairs p = t*k + j sorted by expert, stably: int32 (order, rev,
    offsets, tok) -- the pair at each sorted row, the sorted row of each pair (-1 for an id
    outside [0, E)), expert e's rows [offsets[e], offsets[e+1]) and each sorted row's token."""
    T, k = topk_ids.shape
    n, E, dev = T * k, num_experts, topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, torch.full_like(ids, E))
    sorted_key, order = torch.sort(key, stable=True)
    rev = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=dev))
    rev = torch.where(valid, rev, torch.full_like(rev, -1))
    offsets = torch.searchsorted(sorted_key, torch.arange(E + 1, device=dev), out_int32=True)
    order = order.to(torch.int32)
    return order, rev.to(torch.int32), offsets, (order // k).to(torch.int32)


def _groups(offsets: torch.Tensor):
    """(expert, first row, end row) of every non-empty group (a host read)."""
    offs = offsets.tolist()
    return [(e, offs[e], offs[e + 1]) for e in range(len(offs) - 1) if offs[e + 1] > offs[e]]


def moe_ffn_fwd(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    save_preact: bool = True,
):
    """(y, preact, order, rev, offsets): y as :func:`moe_ffn`, the pre-activation of every
    sorted row ((T*k, 2 d_e), or (0, 2 d_e) without ``save_preact``) and the routing sort.
    A pair whose id is outside [0, E) adds nothing; an expert named twice is applied twice."""
    T, H = x.shape
    E, two_de, _ = w1.shape
    k = topk_ids.shape[1]
    d_e = two_de // 2
    order, rev, offsets, tok = sort_pairs(topk_ids, E)
    pre = x.new_zeros(T * k, two_de)
    out = x.new_zeros(T * k, H)
    # unbound once: autograd would answer each w1[e] with a zero gradient of all of w1
    w1s, w2s = w1.unbind(0), w2.unbind(0)
    for e, r0, r1 in _groups(offsets):
        a = x[tok[r0:r1].long()] @ w1s[e].t()
        pre[r0:r1] = a
        out[r0:r1] = (F.silu(a[:, :d_e]) * a[:, d_e:]) @ w2s[e].t()
    y = _combine(out, rev, topk_weights, x.dtype).reshape(T, H)
    return y, (pre if save_preact else pre[:0]), order, rev, offsets


def _combine(rows: torch.Tensor, rev: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * rows[rev[t*k + j]], skipping pairs with rev < 0."""
    T, k = weights.shape
    valid = (rev >= 0).reshape(T, k, 1)
    picked = rows[rev.clamp_min(0).long()].reshape(T, k, rows.shape[1])
    w = torch.where(valid, weights.to(dtype)[:, :, None], 0)
    return (picked * w).sum(1)


def moe_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * W2[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),  e = ids[t, j].

    x: (T, H); w1: (E, 2*d_e, H), gate rows first then up rows; w2: (E, H, d_e);
    topk_weights, topk_ids: (T, k). One expert at a time, in x's dtype; differentiable by
    autograd (the test oracle runs it on float64 leaves).
    """
    return moe_ffn_fwd(x, w1, w2, topk_weights, topk_ids, save_preact=False)[0]


def moe_ffn_bwd(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets):
    """(dx, dw1, dw2, dtopk_weights) of :func:`moe_ffn_fwd` from its saved pre-activation
    and sort, by the explicit formulas, one expert at a time."""
    T, H = x.shape
    E, two_de, _ = w1.shape
    k = topk_ids.shape[1]
    d_e = two_de // 2
    tok = (order // k).long()
    valid = (rev >= 0).reshape(T, k)
    w_rows = topk_weights.reshape(-1)[order.long()].to(x.dtype)
    dx_rows = x.new_zeros(T * k, H)
    dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
    dtw_rows = topk_weights.new_zeros(T * k)
    for e, r0, r1 in _groups(offsets):
        g, u = preact[r0:r1, :d_e], preact[r0:r1, d_e:]
        s = torch.sigmoid(g)
        h = g * s * u
        dy = grad_y[tok[r0:r1]]
        dtw_rows[r0:r1] = (dy * (h @ w2[e].t())).sum(1).to(dtw_rows.dtype)
        dout = dy * w_rows[r0:r1, None]
        dw2[e] = dout.t() @ h
        dh = dout @ w2[e]
        da = torch.cat([dh * u * s * (1 + g * (1 - s)), dh * g * s], 1)
        dw1[e] = da.t() @ x[tok[r0:r1]]
        dx_rows[r0:r1] = da @ w1[e]
    dx = _combine(dx_rows, rev, torch.ones_like(topk_weights), x.dtype)
    dtw = torch.where(valid, dtw_rows[rev.clamp_min(0).long()].reshape(T, k), 0)
    return dx, dw1, dw2, dtw


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    gather: Optional[torch.Tensor],
    trans_b: bool,
) -> torch.Tensor:
    """c[i] = A[i] @ (b[e]^T if trans_b else b[e]) for rows i in [offsets[e], offsets[e+1]),
    A = a[gather] (or a); rows from offsets[-1] on are zero. ``offsets`` (E+1,) int32 starts."""
    rows = a if gather is None else a[gather.long()]
    out = a.new_zeros(rows.shape[0], b.shape[1] if trans_b else b.shape[2])
    bs = b.unbind(0)  # once: autograd would answer each b[e] with a zero gradient of all of b
    for e, r0, r1 in _groups(offsets):
        out[r0:r1] = rows[r0:r1] @ (bs[e].t() if trans_b else bs[e])
    return out


def grouped_gemm_wgrad(
    dc: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, gather: Optional[torch.Tensor]
) -> torch.Tensor:
    """db[e] = dc[rows of e]^T @ A[rows of e]: (E, N, K) for :func:`grouped_gemm` with trans_b."""
    rows = a if gather is None else a[gather.long()]
    db = a.new_zeros(offsets.numel() - 1, dc.shape[1], a.shape[1])
    for e, r0, r1 in _groups(offsets):
        db[e] = dc[r0:r1].t() @ rows[r0:r1]
    return db
