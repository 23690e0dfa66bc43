"""The ``chunked`` variant of the ``"cpu"`` attention backend: ATen's CPU flash-attention
kernel on segment-aware chunks (:func:`chunked_forward`, :func:`chunked_backward`), where the
native kernel cannot run (see :mod:`smelt_kernels.attention.cpu`).

The chunked path. A batch row's queries are cut into chunks of ``CHUNK`` positions. A chunk
[c0, c1) only needs keys from the start of its first query's segment, and splits into two
calls of ``aten._scaled_dot_product_flash_attention_for_cpu``:

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

__all__ = ["CHUNK", "chunked_forward", "chunked_backward", "chunked_missing"]

CHUNK = 128


def chunked_missing() -> Optional[str]:
    ops = torch.ops.aten
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ):
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


def _block_mask(
    starts: list[int], c0: int, c1: int, k0: int, g: int, dtype: torch.dtype
) -> torch.Tensor:
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
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H): whether each row of x (B, T, H, D) holds only finite values."""
    return torch.isfinite(x).all(-1)


def _seen(bad: torch.Tensor, start: Optional[torch.Tensor], Tq: int) -> torch.Tensor:
    """(B, Tq, H): whether the interval [start(p), p] of each query position p holds a key
    flagged in ``bad`` (B, Tk, H)."""
    B, Tk, H = bad.shape
    cnt = torch.cat([bad.new_zeros(B, 1, H, dtype=torch.int64), bad.long().cumsum(1)], 1)
    pos = torch.arange(Tk - Tq, Tk)
    st = start[:, Tk - Tq :].long() if start is not None else torch.zeros(B, Tq, dtype=torch.long)
    return (cnt[:, pos + 1] - cnt.gather(1, st[..., None].expand(B, Tq, H))) > 0


def _seen_by(rows: torch.Tensor, end: Optional[torch.Tensor], Tk: int) -> torch.Tensor:
    """(B, Tk, H): whether a query flagged in ``rows`` (B, Tq, H) sees each key: key j is
    seen by the positions j .. end(j) of its segment."""
    B, Tq, H = rows.shape
    at = torch.cat([rows.new_zeros(B, Tk - Tq, H), rows], 1).long()  # by position
    cnt = torch.cat([at.new_zeros(B, 1, H), at.cumsum(1)], 1)
    e = end.long() if end is not None else torch.full((B, Tk), Tk - 1, dtype=torch.long)
    return (cnt.gather(1, (e + 1)[..., None].expand(B, Tk, H)) - cnt[:, :Tk]) > 0


def _group(x: torch.Tensor, g: int, to_kv: bool) -> torch.Tensor:
    """(B, T, Hq) -> (B, T, Hkv), any over each KV head's g query heads; or back, repeated."""
    if to_kv:
        return x.reshape(*x.shape[:2], -1, g).any(-1)
    return x.repeat_interleave(g, dim=2)


def _zero_non_finite(*xs):
    return [torch.where(torch.isfinite(x), x, 0) for x in xs]


def chunked_forward(q, k, v, start: Optional[torch.Tensor], scale: float, want_sink: bool):
    """:func:`forward` on ATen's CPU flash kernel in segment-aware chunks (any float dtype).

    ATen's kernel adds its mask to the scores, and NaN + -inf is NaN: a NaN or inf that a
    query does not see would reach it. So inputs that are not all finite run with those
    values zeroed, and the queries that see one (or whose own q is one) get NaN: the output
    row where they see a non-finite key or value, the LSE where they see a non-finite key."""
    reason = chunked_missing()
    if reason is not None:
        raise RuntimeError(f"segment_attention cpu: chunked path unavailable: {reason}")
    starts = start.tolist() if start is not None else None
    fk, fv, fq = _finite_rows(k), _finite_rows(v), _finite_rows(q)
    if bool(fk.all()) and bool(fv.all()) and bool(fq.all()):
        o, lse = _chunked_forward(q, k, v, starts, scale)
    else:
        g = q.shape[2] // k.shape[2]
        lse_bad = _group(_seen(~fk, start, q.shape[1]), g, False) | ~fq
        o_bad = lse_bad | _group(_seen(~fv, start, q.shape[1]), g, False)
        o, lse = _chunked_forward(*_zero_non_finite(q, k, v), starts, scale)
        o = o.masked_fill(o_bad[..., None], float("nan"))
        lse = lse.masked_fill(lse_bad.transpose(1, 2), float("nan"))
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
            qc = qp[b : b + 1, :, rows]
            od, ld = _flash(qc, kp[b : b + 1, :, k0:c1], vp[b : b + 1, :, k0:c1], mask, scale)
            if prefix is not None:
                s0, n = prefix
                oa, la = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qc[:, :, :n], kp[b : b + 1, :, s0:c0], vp[b : b + 1, :, s0:c0], scale=scale
                )
                lm = torch.logaddexp(la, ld[:, :, :n])
                od[:, :, :n] = (
                    oa.to(lse_dtype) * torch.exp(la - lm)[..., None]
                    + od[:, :, :n].to(lse_dtype) * torch.exp(ld[:, :, :n] - lm)[..., None]
                ).to(q.dtype)
                ld[:, :, :n] = lm
            op[b : b + 1, :, rows] = od
            lsep[b : b + 1, :, rows] = ld
    return _unpack(op, g), _unpack_lse(lsep, g)


def chunked_backward(
    do, q, k, v, o, lse, start: Optional[torch.Tensor], end: Optional[torch.Tensor], scale: float
):
    """:func:`backward` on ATen's CPU flash backward kernel, on the same chunks. Inputs that
    are not all finite run zeroed (see :func:`chunked_forward`), then what a query that is not
    finite feeds is NaN: its dq, the dk of the keys it sees, and their dv where its LSE or dO
    is the cause."""
    fin = [_finite_rows(x) for x in (q, k, v, do, o)] + [torch.isfinite(lse).transpose(1, 2)]
    if all(bool(f.all()) for f in fin):
        return _chunked_backward(do, q, k, v, o, lse, start, end, scale)
    g = q.shape[2] // k.shape[2]
    fq, _, _, fdo, fo, flse = fin
    row_p = ~flse | ~fdo  # its probabilities or dO are not finite: dq, dk and dv it feeds
    row_ds = row_p | ~fo  # its dS rows are not finite: dq and dk it feeds
    do0, q0, k0, v0, o0, lse0 = _zero_non_finite(do, q, k, v, o, lse)
    dq, dk, dv = _chunked_backward(do0, q0, k0, v0, o0, lse0, start, end, scale)
    Tk = k.shape[1]
    dq = dq.masked_fill((row_ds | ~fq)[..., None], float("nan"))
    dk = dk.masked_fill(_seen_by(_group(row_ds | ~fq, g, True), end, Tk)[..., None], float("nan"))
    dv = dv.masked_fill(_seen_by(_group(row_p, g, True), end, Tk)[..., None], float("nan"))
    return dq, dk, dv


def _chunked_backward(
    do, q, k, v, o, lse, start: Optional[torch.Tensor], end: Optional[torch.Tensor], scale: float
):
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
            qc, doc, oc, lc = (x[b : b + 1, :, rows] for x in (qp, dop, op, lsep))
            gq, gk, gv = bwd(
                doc,
                qc,
                kp[b : b + 1, :, k0:c1],
                vp[b : b + 1, :, k0:c1],
                oc,
                lc,
                0.0,
                False,
                attn_mask=mask,
                scale=scale,
            )
            dq[b : b + 1, :, rows] += gq
            dk[b : b + 1, :, k0:c1] += gk
            dv[b : b + 1, :, k0:c1] += gv
            if prefix is not None:
                s0, n = prefix
                gq, gk, gv = bwd(
                    doc[:, :, :n],
                    qc[:, :, :n],
                    kp[b : b + 1, :, s0:c0],
                    vp[b : b + 1, :, s0:c0],
                    oc[:, :, :n],
                    lc[:, :, :n],
                    0.0,
                    False,
                    scale=scale,
                )
                dq[b : b + 1, :, rows][:, :, :n] += gq
                dk[b : b + 1, :, s0:c0] += gk
                dv[b : b + 1, :, s0:c0] += gv
    return (
        _unpack(dq, g).to(q.dtype),
        dk.transpose(1, 2).contiguous().to(k.dtype),
        dv.transpose(1, 2).contiguous().to(v.dtype),
    )
