"""The ``"cpu"`` backend of segment attention: ATen's CPU flash-attention kernel on
segment-aware chunks.

A batch row's queries are cut into chunks of ``CHUNK`` positions. A chunk [c0, c1) only
needs keys from the start of its first query's segment, and splits into two calls of
``aten._scaled_dot_product_flash_attention_for_cpu``:

* the diagonal block (keys c0..c1-1), with a small additive mask built from the segment
  starts (one shared causal mask for chunks inside one segment);
* the prefix: keys start(c0)..c0-1, seen (entirely, without a mask) by exactly the rows of
  the chunk's first segment when that segment began before c0; no other row sees them.

The two partial results merge through their log-sum-exps. A prefix of at most one chunk
is folded into the masked call instead (keys start(c0)..c1-1), which halves the number
of calls for short documents. The backward calls the ATen
backward kernel on the same pieces with the merged O and LSE (its gradient formula only
needs those), accumulating in fp32. Keys outside every chunk's interval are never
touched, so documents of any length cost their useful work plus one chunk's diagonal.

GQA without expanding K/V: the G query heads of a KV head are packed as rows, q
(B, Tq, Hq, D) -> (B, Hkv, Tq*G, D) with row t*G + g, so one call serves the group and
dK/dV come out summed over it. The Python loop runs over chunks (Tq / CHUNK per row),
never over tokens.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from . import reference

__all__ = ["available", "forward", "backward", "CHUNK"]

CHUNK = 128


def available() -> Optional[str]:
    """None if ATen's CPU flash-attention kernels are present, else why not."""
    ops = torch.ops.aten
    for name in ("_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention_for_cpu_backward"):
        if not hasattr(ops, name):
            return f"this torch build lacks aten.{name}"
    return None


def _pack(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, T, Hq, D) -> (B, Hkv, T*G, D), row t*G + g."""
    B, T, Hq, D = x.shape
    g = Hq // hkv
    return x.reshape(B, T, hkv, g, D).transpose(1, 2).reshape(B, hkv, T * g, D)


def _unpack(x: torch.Tensor, g: int) -> torch.Tensor:
    B, hkv, TG, D = x.shape
    return x.reshape(B, hkv, TG // g, g, D).transpose(1, 2).reshape(B, TG // g, hkv * g, D)


def _pack_lse(lse: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, T) -> (B, Hkv, T*G)."""
    B, Hq, T = lse.shape
    g = Hq // hkv
    return lse.reshape(B, hkv, g, T).transpose(2, 3).reshape(B, hkv, T * g)


def _unpack_lse(lse: torch.Tensor, g: int) -> torch.Tensor:
    B, hkv, TG = lse.shape
    return lse.reshape(B, hkv, TG // g, g).transpose(2, 3).reshape(B, hkv * g, TG // g)


def _block_mask(starts: list[int], c0: int, c1: int, k0: int, g: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Additive (1, 1, (c1-c0)*G, c1-k0) mask for queries c0..c1-1 against keys k0..c1-1:
    packed row t*G + g sees key j iff start(t) <= j <= t."""
    st = torch.tensor(starts[c0:c1])
    p = torch.arange(c0, c1)
    j = torch.arange(k0, c1)
    vis = (j[None, :] >= st[:, None]) & (j[None, :] <= p[:, None])
    mask = torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf"))
    return mask.repeat_interleave(g, dim=0)[None, None]


def _chunks(starts: list[int], Tq: int, Tk: int, g: int, dtype: torch.dtype):
    """Per chunk: (row slice, first key k0, c0, c1, mask, prefix (s0, rows) or None).

    The masked call covers keys k0..c1-1: k0 = c0, or the first segment's start when that
    is at most a chunk back (one call instead of two). ``starts``: segment start of every
    key position of one batch row. Chunks inside one segment share one causal mask.
    """
    off = Tk - Tq
    causal: dict[int, torch.Tensor] = {}
    for c0 in range(off, Tk, CHUNK):
        c1 = min(c0 + CHUNK, Tk)
        rows = slice((c0 - off) * g, (c1 - off) * g)
        s0 = starts[c0]
        prefix = None
        k0 = c0
        if s0 < c0 and c0 - s0 <= CHUNK:
            k0 = s0
        elif s0 < c0:
            e = bisect.bisect_right(starts, s0, c0, c1)  # end of the first segment in the chunk
            prefix = (s0, (e - c0) * g)
        if k0 == c0 and starts[c1 - 1] <= c0:  # one segment, plain causal block
            if c1 - c0 not in causal:
                causal[c1 - c0] = _block_mask([0] * (c1 - c0), 0, c1 - c0, 0, g, dtype)
            mask = causal[c1 - c0]
        else:
            mask = _block_mask(starts, c0, c1, k0, g, dtype)
        yield rows, k0, c0, c1, mask, prefix


def _flash(q, k, v, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def forward(q, k, v, start: Optional[torch.Tensor], scale: float, want_sink: bool):
    """o (B, Tq, Hq, D), lse (B, Hq, Tq) (fp32, or fp64 for fp64 inputs) and, with
    ``want_sink``, each query's probability on its segment's first key (B, Hq, Tq), else None.

    ``start``: int32 (B, Tk) segment start of every key position, or None (one segment).
    """
    starts = start.tolist() if start is not None else None
    o, lse = _chunked_forward(q, k, v, starts, scale)
    return o, lse, (reference.start_probs(q, k, lse, start, scale) if want_sink else None)


def _chunked_forward(q, k, v, starts: Optional[list[list[int]]], scale: float):
    B, Tq, Hq, D = q.shape
    Tk, hkv = k.shape[1], k.shape[2]
    g = Hq // hkv
    qp = _pack(q, hkv)
    kp, vp = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, Tk, D) views
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    op = torch.empty_like(qp)
    lsep = torch.empty(B, hkv, Tq * g, dtype=lse_dtype)
    for b in range(B):
        st = starts[b] if starts is not None else [0] * Tk
        for rows, k0, c0, c1, mask, prefix in _chunks(st, Tq, Tk, g, q.dtype):
            qc = qp[b:b + 1, :, rows]
            od, ld = _flash(qc, kp[b:b + 1, :, k0:c1], vp[b:b + 1, :, k0:c1], mask, scale)
            if prefix is not None:
                s0, n = prefix
                oa, la = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qc[:, :, :n], kp[b:b + 1, :, s0:c0], vp[b:b + 1, :, s0:c0], scale=scale)
                lm = torch.logaddexp(la, ld[:, :, :n])
                od[:, :, :n] = (oa.to(lse_dtype) * torch.exp(la - lm)[..., None]
                                + od[:, :, :n].to(lse_dtype) * torch.exp(ld[:, :, :n] - lm)[..., None]
                                ).to(q.dtype)
                ld[:, :, :n] = lm
            op[b:b + 1, :, rows] = od
            lsep[b:b + 1, :, rows] = ld
    return _unpack(op, g), _unpack_lse(lsep, g)


def backward(do, q, k, v, o, lse, start: Optional[torch.Tensor], end: Optional[torch.Tensor],
             scale: float):
    """(dq, dk, dv) for :func:`forward`, from its o and lse (``end``, the last position of
    each segment, is not needed here)."""
    starts = start.tolist() if start is not None else None
    B, Tq, Hq, D = q.shape
    Tk, hkv = k.shape[1], k.shape[2]
    g = Hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qp, dop, op = _pack(q, hkv), _pack(do.to(q.dtype), hkv), _pack(o, hkv)
    lsep = _pack_lse(lse.to(acc), hkv)
    kp, vp = k.transpose(1, 2), v.transpose(1, 2)
    dq = torch.zeros(qp.shape, dtype=acc)
    dk = torch.zeros(B, hkv, Tk, D, dtype=acc)
    dv = torch.zeros(B, hkv, Tk, D, dtype=acc)
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    for b in range(B):
        st = starts[b] if starts is not None else [0] * Tk
        for rows, k0, c0, c1, mask, prefix in _chunks(st, Tq, Tk, g, q.dtype):
            qc, doc, oc, lc = (x[b:b + 1, :, rows] for x in (qp, dop, op, lsep))
            gq, gk, gv = bwd(doc, qc, kp[b:b + 1, :, k0:c1], vp[b:b + 1, :, k0:c1], oc, lc, 0.0,
                             False, attn_mask=mask, scale=scale)
            dq[b:b + 1, :, rows] += gq
            dk[b:b + 1, :, k0:c1] += gk
            dv[b:b + 1, :, k0:c1] += gv
            if prefix is not None:
                s0, n = prefix
                gq, gk, gv = bwd(doc[:, :, :n], qc[:, :, :n], kp[b:b + 1, :, s0:c0],
                                 vp[b:b + 1, :, s0:c0], oc[:, :, :n], lc[:, :, :n], 0.0, False,
                                 scale=scale)
                dq[b:b + 1, :, rows][:, :, :n] += gq
                dk[b:b + 1, :, s0:c0] += gk
                dv[b:b + 1, :, s0:c0] += gv
    return (_unpack(dq, g).to(q.dtype),
            dk.transpose(1, 2).contiguous().to(k.dtype),
            dv.transpose(1, 2).contiguous().to(v.dtype))
