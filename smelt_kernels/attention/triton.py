"""Triton kernels for segment attention: forward (with LSE and the sink statistic) and backward.

Layout and tiling
-----------------
q (B, Tq, Hq, D); k, v (B, Tk, Hkv, D), G = Hq / Hkv query heads per KV head. One program
owns one (batch, KV head) pair and a tile of ``BLOCK_M`` *rows*, where row r stands for
(query r // G, head r % G) of that KV head's group: the G query heads that share a K/V
tile are stacked along M, so each K/V tile is loaded once and feeds one ``tl.dot`` for
the whole group (the packed-GQA layout), and any G works with power-of-two tiles.

Query position p (keys are 0..Tk-1, queries the last Tq of them) sees keys
[start(p), p], where ``start`` (int32 (B, Tk), computed by the caller from the
segment ids) is the first position of p's segment. Starts never decrease, so a row tile
with positions p_first..p_last only visits keys start(p_first)..p_last, in three runs:

* keys below start(p_last) (only when a segment begins inside the tile): masked;
* keys every row sees (>= start(p_last) and <= p_first): no mask at all;
* the diagonal run up to p_last: masked.

Optional masking and capping, each a compile-time switch (off: the kernels compile to the
code they had without it):

* ``window`` (HAS_WINDOW): position p also needs key > p - window. A row tile's lowest key
  becomes max(start(p_first), p_first - window + 1), and the unmasked run starts above the
  last row's max(start(p_last), p_last - window + 1), so a short window visits about
  window + tile keys per row tile; a key tile of the dK/dV kernel stops at the rows up to
  min(segment end, n_last + window - 1), and its unmasked rows end at n0 + window - 1.
* ``key_ok`` (HAS_KEY_OK, uint8 (B, Tk)): keys it clears are seen by no row. Every key run
  is masked then (the middle one too); a dK/dV key tile whose keys are all cleared visits
  no row. A row that sees no key gets O = 0 and LSE = -inf; the backward reads an LSE of
  -inf as no probability anywhere (zeros, not NaN).
* ``softcap`` (SOFTCAP): scores become softcap * tanh(s / softcap) in natural units. The
  kernels' qk_scale is then 2 * log2(e) * scale / softcap, the exp2 argument of tanh
  (:func:`~.triton_tiles.tanh_exp2`), and ``cap2`` = softcap * log2(e) brings the capped
  score into the log2 domain; the backward recomputes tanh from q.k and multiplies dS by
  1 - tanh^2.

Softmax runs online in fp32 in the log2 domain (``exp2``); the kernel stores the
natural-log LSE. The sink statistic needs only the score against each row's segment
start and the row's LSE: the forward picks that score out of the S tiles it computes
anyway (only tiles at or below the tile's last segment start can hold one) and writes
the probability per row; the caller averages it.

Head dims: any multiple of 8 up to 128. A power of two runs as one block; any other head
dim as a power-of-two block plus a masked power-of-two tail (:func:`head_dim_split`:
72 and 80 = 64 + 16, 88 and 96 = 64 + 32), so each QK^T and PV product is two ``tl.dot``
calls whose widths sum to 80 or 96 columns instead of one padded to 128 (at 88: 9% over the
useful work instead of 45%). 112 runs at 128 (64 + 64 would do the same work in two
products). The caller's tensors are never padded. Gathered (query, head) rows carry a
multiple-of-8 alignment hint, so the launchers pass strides that are multiples of 8
elements (copying otherwise).

Backward (deterministic, no atomics): ``bwd_delta`` computes rowsum(dO * O);
``_bwd_dkdv`` owns a key tile and loops over every row (all G heads) that can see it,
accumulating dK and dV in registers, so the group's gradients are summed without
expanding K/V; ``_bwd_dq`` owns a row tile like the forward.

A row whose interval is empty (the caller encodes a segment-id row it found invalid that
way on CUDA) produces NaN in O and LSE rather than a plausible answer.

Masked pairs add nothing: in tiles with a mask, P and dS are exactly 0 there (whatever the
row's LSE), and the operand they multiply (V forward, K for dQ, Q and dO for dK/dV) enters
with its NaN and inf entries zeroed (0 * NaN is NaN); rows that do see such a value get NaN
in their whole row (forward: through the rescale factor; dK/dV: rows whose LSE or delta is
not finite are read as zeros with a NaN LSE). Offsets that can pass 2^31 elements (a
position times its row stride) are int64 (:func:`row_pointers`, :func:`key_rows`,
:func:`key_ptrs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _alloc
from ..backends import triton_interpret
from .triton_backward import bwd_delta, bwd_dkdv_kernel, bwd_dq_kernel
from .triton_tiles import (
    dot_split,
    finite_split,
    key_rows,
    key_runs,
    keys_ok,
    load_split,
    query_tile,
    row_pointers,
    sees_flagged,
    store_split,
    tanh_exp2,
    visible,
    window_runs,
)

__all__ = [
    "forward",
    "backward",
    "head_dim_split",
    "head_dim_pad",
    "block_config",
    "fwd_kernel",
    "fwd_launch",
    "bwd_launches",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# the same, as compile-time constants kernels may read
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)


# ----------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(acc_a, acc_t, m_i, l_i, s0, q_a, q_t, pos, start, start_last, k_base, v_base,
               kok_base, skt, svt, lo, hi, Tk, qk_scale, window, cap2, D: tl.constexpr,
               DA: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               WANT_SINK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_KEY_OK: tl.constexpr, SOFTCAP: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_a, k_t = load_split(k_base + key_rows(offs_n, skt), offs_n, Tk, D, DA, DT, BLOCK_N,
                               MASK, UPCAST)
        s = dot_split(q_a, q_t, k_a, k_t, DT, PRECISION) * qk_scale
        if SOFTCAP:  # s was the exp2 argument of tanh; capped, in log2 units
            s = cap2 * tanh_exp2(s)
        if MASK:
            vis = visible(offs_n[None, :], start[:, None], pos[:, None], window,
                          keys_ok(kok_base, offs_n, Tk, HAS_KEY_OK)[None, :], HAS_WINDOW,
                          HAS_KEY_OK)
            s = tl.where(vis, s, float("-inf"))
        if WANT_SINK:
            # every row's segment start is <= start_last: only the first tiles hold one
            if n0 <= start_last:
                s0 += tl.sum(tl.where(offs_n[None, :] == start[:, None], s, 0.0), 1)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_a, v_t = load_split(v_base + key_rows(offs_n, svt), offs_n, Tk, D, DA, DT, BLOCK_N,
                               MASK, UPCAST)
        if MASK:  # masked values add nothing (see the module docstring)
            v_a, v_t, v_bad = finite_split(v_a, v_t, DT)
            alpha = tl.where(sees_flagged(vis, v_bad) > 0, float("nan"), alpha)
        p = p.to(v_a.dtype)
        acc_a = tl.dot(p, v_a, acc_a * alpha[:, None], input_precision=PRECISION)
        if DT > 0:
            acc_t = tl.dot(p, v_t, acc_t * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc_a, acc_t, m_i, l_i, s0


@triton.jit(do_not_specialize=["Tq", "Tk"])
def fwd_kernel(Q, K, V, O, LSE, PSINK, START, KEY_OK,
                sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
                Tq, Tk, Hq, qk_scale, window, cap2,
                G: tl.constexpr, D: tl.constexpr, DA: tl.constexpr, DT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEG: tl.constexpr,
                WANT_SINK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_KEY_OK: tl.constexpr, SOFTCAP: tl.constexpr):
    b, hkv, rows, row_ok, qi, h, pos, pos_first, pos_last, start, start_first, start_last = (
        query_tile(START, Tq, Tk, Hq, G, BLOCK_M, HAS_SEG))
    q_a, q_t = load_split(row_pointers(Q + b * sqb, qi, pos_first - (Tk - Tq), h, sqt, sqh), rows, 0, D, DA, DT, BLOCK_M,
                           False, UPCAST)
    k_base = K + b * skb + hkv * skh
    v_base = V + b * svb + hkv * svh
    kok_base = KEY_OK + b * Tk

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, DA], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_M, DT if DT > 0 else 16], dtype=tl.float32)
    lo_first, lo_last = window_runs(start_first, start_last, pos_first, pos_last, window,
                                    HAS_WINDOW)
    lo, mid, diag, hi = key_runs(lo_first, lo_last, pos_first, pos_last, BLOCK_N)
    s0 = tl.zeros([BLOCK_M], dtype=tl.float32)  # score against the segment's first key
    acc_a, acc_t, m_i, l_i, s0 = _fwd_inner(
        acc_a, acc_t, m_i, l_i, s0, q_a, q_t, pos, start, start_last, k_base, v_base, kok_base,
        skt, svt, lo, mid, Tk, qk_scale, window, cap2, D, DA, DT, BLOCK_N, True, WANT_SINK,
        PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK, SOFTCAP)
    # keys every row sees: unmasked, unless key_ok may clear some of them
    acc_a, acc_t, m_i, l_i, s0 = _fwd_inner(
        acc_a, acc_t, m_i, l_i, s0, q_a, q_t, pos, start, start_last, k_base, v_base, kok_base,
        skt, svt, mid, diag, Tk, qk_scale, window, cap2, D, DA, DT, BLOCK_N, HAS_KEY_OK,
        WANT_SINK, PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK, SOFTCAP)
    acc_a, acc_t, m_i, l_i, s0 = _fwd_inner(
        acc_a, acc_t, m_i, l_i, s0, q_a, q_t, pos, start, start_last, k_base, v_base, kok_base,
        skt, svt, diag, hi, Tk, qk_scale, window, cap2, D, DA, DT, BLOCK_N, True, WANT_SINK,
        PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK, SOFTCAP)

    if HAS_KEY_OK:
        # a row that sees no key (key_ok cleared them all): o = 0, lse = -inf; an empty
        # interval (invalid segment ids) still NaN
        seen = l_i > 0
        none = tl.where(start <= pos, 0.0, float("nan"))
        l_seen = tl.where(seen, l_i, 1.0)  # no 0 in the log or the division
        lse2 = tl.where(seen, m_i + tl.math.log2(l_seen), none - float("inf"))
        inv_l = tl.where(seen, 1.0 / l_seen, none)
    else:
        # an empty interval (invalid segment ids) gives NaN, never a plausible number
        lse2 = tl.where(l_i > 0, m_i + tl.math.log2(l_i), float("nan"))
        inv_l = 1.0 / l_i
    store_split(row_pointers(O + b * sob, qi, pos_first - (Tk - Tq), h, sot, soh),
                 (acc_a * inv_l[:, None]).to(O.dtype.element_ty),
                 (acc_t * inv_l[:, None]).to(O.dtype.element_ty), rows, Tq * G, D, DA, DT)
    stat = (b * Hq + h) * Tq + qi
    tl.store(LSE + stat, lse2 * _LN2, mask=row_ok)
    if WANT_SINK:
        p0 = tl.where(start != pos, tl.math.exp2(s0 - lse2), 0.0)
        if HAS_WINDOW:  # a start key the window leaves out (its tile may not be visited)
            p0 = tl.where(start > pos - window, p0, 0.0)
        if HAS_KEY_OK:  # a row that sees nothing: 0 (its lse is -inf)
            p0 = tl.where((l_i > 0) | (start > pos), p0, 0.0)
        tl.store(PSINK + stat, p0, mask=row_ok)



# ----------------------------------------------------------------------------- launchers
def head_dim_split(d: int) -> tuple[int, int]:
    """(DA, DT): the head dim runs as a power-of-two block of DA columns plus, when DT > 0, a
    masked power-of-two tail of DT columns (88 = 64 + 32 with 24 used; 72 = 64 + 16). Without
    a tail DA is the next power of two (>= 16, what ``tl.dot`` needs), masked when above d."""
    full = max(16, triton.next_power_of_2(d))
    if d == full or d < 16:
        return full, 0
    da = full // 2
    dt = max(16, triton.next_power_of_2(d - da))
    return (full, 0) if da + dt >= full else (da, dt)


def head_dim_pad(d: int) -> int:
    """The register width a head dim runs at: the two blocks of :func:`head_dim_split`."""
    da, dt = head_dim_split(d)
    return da + dt


def block_config(kind: str, d: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, masked: bool = False) -> dict:
    """Tile sizes per kernel (``kind`` 'fwd', 'dq' or 'dkdv') at head dim ``d``. The
    interpreter gets small tiles (so small tests cross many tile edges). The GPU values are
    FlashAttention-2-style choices for Hopper, each compiled by ``python -m
    smelt_tools.audit`` for sm_90a without register spills and with shared memory under the
    limit, but not timed on the device; fp32 inputs (exact "ieee" products) get small tiles.
    ``masked``: a window, key_ok or softcap is on; their masks and tanh take registers the
    16-bit forward and dK/dV tiles do not have to spare (they spilled): the forward takes
    32-wide key tiles, dK/dV 8 warps (and 32 rows at a time from width 96)."""
    if device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    width = head_dim_pad(d)
    if dtype == torch.float32:  # exact fp32 products: small tiles, chosen for no spills
        if kind == "fwd":
            return dict(BLOCK_M=32, BLOCK_N=32 if d <= 64 else 16, num_warps=8 if d <= 64 else 4, num_stages=2)
        return dict(BLOCK_M=16, BLOCK_N=16 if kind == "dq" else 32, num_warps=4 if kind == "dq" else 8,
                    num_stages=2)
    if kind == "fwd":
        return dict(BLOCK_M=128, BLOCK_N=32 if masked else 64, num_warps=8, num_stages=3)
    # dq (rows streamed over key tiles) and dkdv (keys streamed over row tiles): 64 x 64
    # keeps two fp32 accumulators plus the streamed tiles in registers up to 96 columns; at
    # 128 dK/dV streams 32 rows at a time (64 spilled 120 bytes at head dim 112)
    bm = 32 if kind == "dkdv" and (width > 96 or (masked and width > 80)) else 64
    warps = 8 if width > 64 or (masked and kind == "dkdv") else 4
    return dict(BLOCK_M=bm, BLOCK_N=64, num_warps=warps, num_stages=2)


def _precision(dtype: torch.dtype):
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    # the interpreter's tl.dot mishandles bfloat16 operands: compute those in fp32 there
    return triton_interpret() and dtype == torch.bfloat16


def _rows_aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself if its D stride is 1 and its other strides are multiples of 8 elements (what
    the kernels' alignment hints promise), else a contiguous copy."""
    ok = x.stride(-1) == 1 and all(st % 8 == 0 for st in x.stride()[:-1])
    return x if ok else x.contiguous()


def _meta(q, has_seg: bool) -> dict:
    B, Tq, Hq, D = q.shape
    da, dt = head_dim_split(D)
    return dict(D=D, DA=da, DT=dt, HAS_SEG=has_seg, PRECISION=_precision(q.dtype),
                UPCAST=_upcast(q.dtype))


def _masked(Tk: int, window: int, key_ok, softcap: float) -> bool:
    """Whether a window (below Tk), key_ok or softcap is on (see :func:`block_config`)."""
    return 0 < window < Tk or key_ok is not None or softcap > 0


def _feature_args(Tk, scale, window, key_ok, softcap, dummy):
    """(KEY_OK pointer, qk_scale, window, cap2) and the feature switches of a launch. A window
    of Tk or more hides nothing: off. qk_scale multiplies q.k: scale * log2(e) (scores in log2
    units) or, with a softcap, 2 * log2(e) * scale / softcap (the exp2 argument of tanh, the
    score then softcap * log2(e) * tanh: cap2)."""
    has_window = 0 < window < Tk
    flags = dict(HAS_WINDOW=has_window, HAS_KEY_OK=key_ok is not None, SOFTCAP=softcap > 0)
    kok = key_ok.contiguous().view(torch.uint8) if key_ok is not None else dummy
    qk = 2 * LOG2E * scale / softcap if softcap > 0 else scale * LOG2E
    return (kok, qk, window if has_window else 0, softcap * LOG2E), flags


def fwd_launch(q, k, v, o, lse, psink, start, scale, want_sink, cfg, window=0, key_ok=None,
                softcap=0.0):
    """(grid, args, kwargs) of the forward kernel; also what the audit compiles."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    grid = (triton.cdiv(Tq * G, cfg["BLOCK_M"]), B * Hkv)
    (kok, qk, win, cap2), flags = _feature_args(Tk, scale, window, key_ok, softcap, lse)
    args = (q, k, v, o, lse, psink, start if start is not None else lse, kok,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            Tq, Tk, Hq, qk, win, cap2)
    return grid, args, dict(G=G, WANT_SINK=want_sink, **_meta(q, start is not None), **flags,
                            **cfg)


def bwd_launches(do, q, k, v, lse, delta, dq, dk, dv, start, end, scale, cfg_dkdv, cfg_dq,
                  window=0, key_ok=None, softcap=0.0):
    """[(kernel, grid, args, kwargs)] of the dK/dV and dQ kernels."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    seg = start if start is not None else delta
    (kok, qk, win, cap2), flags = _feature_args(Tk, scale, window, key_ok, softcap, delta)
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
              Tq, Tk, Hq, scale, qk, win, cap2)
    meta = dict(G=G, **_meta(q, start is not None), **flags)
    return [
        (bwd_dkdv_kernel, (triton.cdiv(Tk, cfg_dkdv["BLOCK_N"]), B * Hkv),
         (q, k, v, do, lse, delta, dk, dv, seg, end if start is not None else seg, kok, *common),
         dict(meta, **cfg_dkdv)),
        (bwd_dq_kernel, (triton.cdiv(Tq * G, cfg_dq["BLOCK_M"]), B * Hkv),
         (q, k, v, do, lse, delta, dq, seg, kok, *common), dict(meta, **cfg_dq)),
    ]


def forward(q, k, v, start, scale: float, want_sink: bool, window: int = 0, key_ok=None,
            softcap: float = 0.0):
    """o (B, Tq, Hq, D), lse (B, Hq, Tq) fp32 and, with ``want_sink``, the per-row
    probability on the segment's first key (B, Hq, Tq) fp32 (0 for segment starts, and
    where that key is not seen). ``start``: int32 (B, Tk) segment start of every position,
    or None (one segment). ``window`` (0: none): position p sees keys above p - window only;
    ``key_ok`` (bool (B, Tk) or None): keys it clears are seen by no query; ``softcap`` (0:
    none): scores become softcap * tanh(s / softcap). A query that sees no key gets o = 0,
    lse = -inf."""
    q, k, v = (_rows_aligned(x) for x in (q, k, v))
    B, Tq, Hq, D = q.shape
    o = _alloc.empty((B, Tq, Hq, D), q.dtype, q.device)
    lse = _alloc.empty((B, Hq, Tq), torch.float32, q.device)
    psink = _alloc.empty((B, Hq, Tq), torch.float32, q.device) if want_sink else lse
    if q.numel() == 0:  # no query (Tq, Hq or B is 0): nothing to compute
        return o, lse, (psink if want_sink else None)
    cfg = block_config("fwd", D, q.device, q.dtype, _masked(k.shape[1], window, key_ok, softcap))
    grid, args, kwargs = fwd_launch(q, k, v, o, lse, psink, start, scale, want_sink, cfg, window,
                                     key_ok, softcap)
    fwd_kernel[grid](*args, **kwargs)
    return o, lse, (psink if want_sink else None)


def backward(do, q, k, v, o, lse, start, end, scale: float, window: int = 0, key_ok=None,
             softcap: float = 0.0):
    """(dq, dk, dv) for the forward above; ``end``: int32 (B, Tk) last position of every
    position's segment (None with ``start`` None); ``window``, ``key_ok``, ``softcap`` as
    there. The probabilities come from ``lse`` (a row whose lse is -inf has none).
    Deterministic."""
    q, k, v = (_rows_aligned(x) for x in (q, k, v))
    do = do.contiguous()
    o = o.contiguous()  # bwd_delta reads both as contiguous rows
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if q.numel() == 0:  # no query: no gradient reaches a key
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    delta = _alloc.empty((B, Hq, Tq), torch.float32, q.device)
    n = B * Tq * Hq
    blk = 16 if q.device.type != "cuda" else 64
    bwd_delta[(triton.cdiv(n, blk),)](o, do, delta, n, Tq, Hq, D=D, D_PAD=triton.next_power_of_2(D),
                                       BLOCK=blk)
    dq = _alloc.empty((B, Tq, Hq, D), q.dtype, q.device)
    dk = _alloc.empty((B, Tk, Hkv, D), k.dtype, k.device)
    dv = _alloc.empty((B, Tk, Hkv, D), v.dtype, v.device)
    masked = _masked(Tk, window, key_ok, softcap)
    launches = bwd_launches(do, q, k, v, lse, delta, dq, dk, dv, start, end, scale,
                             block_config("dkdv", D, q.device, q.dtype, masked),
                             block_config("dq", D, q.device, q.dtype, masked), window, key_ok,
                             softcap)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    return dq, dk, dv
