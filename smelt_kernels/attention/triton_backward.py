"""The backward kernels of segment attention in Triton: ``bwd_delta`` (rowsum(dO * O)),
``bwd_dkdv_kernel`` (a key tile's dK and dV over the row tiles that see it) and
``bwd_dq_kernel`` (a row tile's dQ, like the forward). Launched by
:mod:`smelt_kernels.attention.triton`, whose docstring gives the layout and the masking."""

import triton
import triton.language as tl

from .triton_tiles import (
    dot_split,
    finite_split,
    key_ptrs,
    key_runs,
    keys_ok,
    load_split,
    query_tile,
    row_pointers,
    store_split,
    tanh_exp2,
    visible,
    window_runs,
)

__all__ = ["bwd_delta", "bwd_dq_kernel", "bwd_dkdv_kernel"]

# log2(e), a compile-time constant kernels may read
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["n_rows", "Tq"])
def bwd_delta(O, DO, DELTA, n_rows, Tq, Hq, D: tl.constexpr, D_PAD: tl.constexpr,
               BLOCK: tl.constexpr):
    """DELTA[b, h, t] = sum_d O[b, t, h, d] * dO[b, t, h, d] (both contiguous); see below for
    rows that are not finite."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_PAD)
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < D)
    ptr = rows[:, None] * D + offs_d[None, :]
    o = tl.load(O + ptr, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptr, mask=mask, other=0.0).to(tl.float32)
    h = rows % Hq
    t = (rows // Hq) % Tq
    b = rows // Hq // Tq
    # a row whose dO is not all finite gets NaN, any other non-finite sum inf: the dK/dV
    # kernel reads the rows marked NaN as zeros where it applies a mask
    do_ok = tl.max(tl.where(tl.abs(do) < float("inf"), 0, 1), 1) == 0
    d = tl.sum(o * do, 1)
    d = tl.where(do_ok, tl.where(tl.abs(d) < float("inf"), d, float("inf")), float("nan"))
    tl.store(DELTA + (b * Hq + h) * Tq + t, d, mask=rows < n_rows)


@triton.jit
def _bwd_dq_inner(dq_a, dq_t, q_a, q_t, do_a, do_t, lse2, delta, pos, start, k_base, v_base,
                  kok_base, skt, svt, lo, hi, Tk, qk_scale, window, cap2, D: tl.constexpr,
                  DA: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_KEY_OK: tl.constexpr, SOFTCAP: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_a, k_t = load_split(key_ptrs(k_base, n0, skt, BLOCK_N), offs_n, Tk, D, DA, DT, BLOCK_N,
                               MASK, UPCAST)
        v_a, v_t = load_split(key_ptrs(v_base, n0, svt, BLOCK_N), offs_n, Tk, D, DA, DT, BLOCK_N,
                               MASK, UPCAST)
        s = dot_split(q_a, q_t, k_a, k_t, DT, PRECISION) * qk_scale
        if SOFTCAP:  # capped scores; dS takes tanh' = 1 - tanh^2
            th = tanh_exp2(s)
            s = cap2 * th
        if MASK:  # masked keys add nothing (see the module docstring)
            k_a, k_t, _ = finite_split(k_a, k_t, DT)
        p = tl.math.exp2(s - lse2[:, None])
        if SOFTCAP:  # P times tanh' (tanh not kept through the product below)
            p = p * (1.0 - th * th)
        dp = dot_split(do_a, do_t, v_a, v_t, DT, PRECISION)
        ds = p * (dp - delta[:, None])
        if MASK:
            vis = visible(offs_n[None, :], start[:, None], pos[:, None], window,
                          keys_ok(kok_base, offs_n, Tk, HAS_KEY_OK)[None, :], HAS_WINDOW,
                          HAS_KEY_OK)
            ds = tl.where(vis, ds, 0.0)
        ds = ds.to(k_a.dtype)
        dq_a = tl.dot(ds, k_a, dq_a, input_precision=PRECISION)
        if DT > 0:
            dq_t = tl.dot(ds, k_t, dq_t, input_precision=PRECISION)
    return dq_a, dq_t


@triton.jit(do_not_specialize=["Tq", "Tk"])
def bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, START, KEY_OK,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh,
                   Tq, Tk, Hq, sm_scale, qk_scale, window, cap2,
                   G: tl.constexpr, D: tl.constexpr, DA: tl.constexpr, DT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEG: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_KEY_OK: tl.constexpr, SOFTCAP: tl.constexpr):
    """dQ for a row tile; DQ has dO's strides (sd*)."""
    b, hkv, rows, row_ok, qi, h, pos, pos_first, pos_last, start, start_first, start_last = (
        query_tile(START, Tq, Tk, Hq, G, BLOCK_M, HAS_SEG))
    q_a, q_t = load_split(row_pointers(Q + b * sqb, qi, pos_first - (Tk - Tq), h, sqt, sqh), rows, 0, D, DA, DT, BLOCK_M,
                           False, UPCAST)
    do_a, do_t = load_split(row_pointers(DO + b * sdb, qi, pos_first - (Tk - Tq), h, sdt, sdh), rows, 0, D, DA, DT, BLOCK_M,
                             False, UPCAST)
    stat = (b * Hq + h) * Tq + qi
    lse2 = tl.load(LSE + stat) * _LOG2E
    if HAS_KEY_OK:  # a row that sees no key (lse -inf) has no probability anywhere
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(DELTA + stat)
    k_base = K + b * skb + hkv * skh
    v_base = V + b * svb + hkv * svh
    kok_base = KEY_OK + b * Tk
    dq_a = tl.zeros([BLOCK_M, DA], dtype=tl.float32)
    dq_t = tl.zeros([BLOCK_M, DT if DT > 0 else 16], dtype=tl.float32)
    lo_first, lo_last = window_runs(start_first, start_last, pos_first, pos_last, window,
                                    HAS_WINDOW)
    lo, mid, diag, hi = key_runs(lo_first, lo_last, pos_first, pos_last, BLOCK_N)
    dq_a, dq_t = _bwd_dq_inner(dq_a, dq_t, q_a, q_t, do_a, do_t, lse2, delta, pos, start, k_base,
                               v_base, kok_base, skt, svt, lo, mid, Tk, qk_scale, window, cap2, D,
                               DA, DT, BLOCK_N, True, PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK,
                               SOFTCAP)
    dq_a, dq_t = _bwd_dq_inner(dq_a, dq_t, q_a, q_t, do_a, do_t, lse2, delta, pos, start, k_base,
                               v_base, kok_base, skt, svt, mid, diag, Tk, qk_scale, window, cap2, D,
                               DA, DT, BLOCK_N, HAS_KEY_OK, PRECISION, UPCAST, HAS_WINDOW,
                               HAS_KEY_OK, SOFTCAP)
    dq_a, dq_t = _bwd_dq_inner(dq_a, dq_t, q_a, q_t, do_a, do_t, lse2, delta, pos, start, k_base,
                               v_base, kok_base, skt, svt, diag, hi, Tk, qk_scale, window, cap2, D,
                               DA, DT, BLOCK_N, True, PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK,
                               SOFTCAP)
    store_split(row_pointers(DQ + b * sdb, qi, pos_first - (Tk - Tq), h, sdt, sdh), (dq_a * sm_scale).to(DQ.dtype.element_ty),
                 (dq_t * sm_scale).to(DQ.dtype.element_ty), rows, Tq * G, D, DA, DT)


@triton.jit
def _bwd_dkdv_inner(dk_a, dk_t, dv_a, dv_t, k_a, k_t, v_a, v_t, offs_n, kok, q_base, do_base,
                    stat_base, LSE, DELTA, seg, sqt, sqh, sdt, sdh, lo, hi, Tq, Tk, hkv, qk_scale,
                    window, cap2, G: tl.constexpr, D: tl.constexpr, DA: tl.constexpr,
                    DT: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                    HAS_SEG: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_KEY_OK: tl.constexpr, SOFTCAP: tl.constexpr):
    n_rows = Tq * G
    off = Tk - Tq
    for r0 in range(lo, hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        rows_c = tl.minimum(rows, n_rows - 1)
        qi = rows_c // G
        h = hkv * G + rows_c % G
        pos = qi + off
        stat = stat_base + h.to(tl.int64) * Tq + qi
        lse2 = tl.load(LSE + stat) * _LOG2E
        delta = tl.load(DELTA + stat)
        q_ptr = row_pointers(q_base, qi, r0 // G, h, sqt, sqh)
        do_ptr = row_pointers(do_base, qi, r0 // G, h, sdt, sdh)
        if MASK:
            # Masked rows add nothing (see the module docstring): a row whose q or dO may not
            # be all finite (its LSE is not finite, or bwd_delta marked its delta NaN) is
            # read as zeros, with a NaN LSE, so that the keys it sees get NaN through P. (A
            # row that sees no key, LSE -inf, is one of them: every pair of it is masked.)
            skip = tl.where((tl.abs(lse2) < float("inf")) & (delta == delta), 0, 1)
            lse2 = tl.where(skip > 0, float("nan"), lse2)
            q_a, q_t = load_split(q_ptr, skip, 1, D, DA, DT, BLOCK_M, True, UPCAST)
            do_a, do_t = load_split(do_ptr, skip, 1, D, DA, DT, BLOCK_M, True, UPCAST)
        else:
            q_a, q_t = load_split(q_ptr, rows, 0, D, DA, DT, BLOCK_M, False, UPCAST)
            do_a, do_t = load_split(do_ptr, rows, 0, D, DA, DT, BLOCK_M, False, UPCAST)
        s_t = dot_split(k_a, k_t, q_a, q_t, DT, PRECISION) * qk_scale  # (keys, rows)
        if SOFTCAP:  # capped scores; dS takes tanh' = 1 - tanh^2
            th = tanh_exp2(s_t)
            s_t = cap2 * th
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASK:
            if HAS_SEG:
                start = tl.load(seg + pos)
            else:
                start = tl.zeros([BLOCK_M], dtype=tl.int32)
            vis = visible(offs_n[:, None], start[None, :], pos[None, :], window, kok[:, None],
                          HAS_WINDOW, HAS_KEY_OK) & row_ok[None, :]
            p_t = tl.where(vis, p_t, 0.0)
        p_lo = p_t.to(do_a.dtype)
        if SOFTCAP:  # from here P times tanh' (tanh not kept through the products below)
            p_t = p_t * (1.0 - th * th)
        dv_a = tl.dot(p_lo, do_a, dv_a, input_precision=PRECISION)
        if DT > 0:
            dv_t = tl.dot(p_lo, do_t, dv_t, input_precision=PRECISION)
        dp_t = dot_split(v_a, v_t, do_a, do_t, DT, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if MASK:
            ds_t = tl.where(vis, ds_t, 0.0)
        ds_t = ds_t.to(q_a.dtype)
        dk_a = tl.dot(ds_t, q_a, dk_a, input_precision=PRECISION)
        if DT > 0:
            dk_t = tl.dot(ds_t, q_t, dk_t, input_precision=PRECISION)
    return dk_a, dk_t, dv_a, dv_t


@triton.jit(do_not_specialize=["Tq", "Tk"])
def bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, START, END, KEY_OK,
                     sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh,
                     Tq, Tk, Hq, sm_scale, qk_scale, window, cap2,
                     G: tl.constexpr, D: tl.constexpr, DA: tl.constexpr, DT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEG: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_KEY_OK: tl.constexpr, SOFTCAP: tl.constexpr):
    """dK, dV for a key tile of one KV head, summed over every row (all G heads) that sees
    it. DK and DV are contiguous (B, Tk, Hkv, D)."""
    n0 = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    Hkv = Hq // G
    b = (bh // Hkv).to(tl.int64)
    hkv = bh % Hkv
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_a, k_t = load_split(key_ptrs(K + b * skb + hkv * skh, n0, skt, BLOCK_N), offs_n, Tk, D, DA, DT,
                           BLOCK_N, True, UPCAST)
    v_a, v_t = load_split(key_ptrs(V + b * svb + hkv * svh, n0, svt, BLOCK_N), offs_n, Tk, D, DA, DT,
                           BLOCK_N, True, UPCAST)
    kok = keys_ok(KEY_OK + b * Tk, offs_n, Tk, HAS_KEY_OK)
    n_last = tl.minimum(n0 + BLOCK_N, Tk) - 1
    seg = START + b * Tk
    if HAS_SEG:
        end_first = tl.load(END + b * Tk + n0)
        end_last = tl.load(END + b * Tk + n_last)
    else:
        end_first = n_last * 0 + Tk - 1
        end_last = end_first
    if HAS_WINDOW:  # rows at or past a key's position + window do not see it
        end_first = tl.minimum(end_first, n0 + window - 1)
        end_last = tl.minimum(end_last, n_last + window - 1)
    off = Tk - Tq
    # rows that can see a key of this tile: positions max(n0, off) .. end of n_last's segment
    # (or n_last + window - 1, if lower)
    row_lo = (tl.maximum(n0, off) - off) * G
    row_hi = (end_last - off + 1) * G
    # masked while the tile's first position is below its last key; then unmasked while the
    # tile's last position stays in n0's segment (and window); the rest masked
    mid = row_lo + tl.cdiv(tl.maximum((n_last - off) * G - row_lo, 0), BLOCK_M) * BLOCK_M
    tail = mid + (tl.maximum((end_first - off + 1) * G - mid, 0) // BLOCK_M) * BLOCK_M
    if HAS_KEY_OK:  # a tile whose keys are all cleared: no row sees it, dK = dV = 0
        some = tl.max(kok.to(tl.int32), 0) > 0
        mid = tl.where(some, mid, row_lo)
        tail = tl.where(some, tail, row_lo)
        row_hi = tl.where(some, row_hi, row_lo)
    q_base = Q + b * sqb
    do_base = DO + b * sdb
    stat_base = b * Hq * Tq
    dk_a = tl.zeros([BLOCK_N, DA], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_N, DA], dtype=tl.float32)
    dk_t = tl.zeros([BLOCK_N, DT if DT > 0 else 16], dtype=tl.float32)
    dv_t = tl.zeros([BLOCK_N, DT if DT > 0 else 16], dtype=tl.float32)
    dk_a, dk_t, dv_a, dv_t = _bwd_dkdv_inner(
        dk_a, dk_t, dv_a, dv_t, k_a, k_t, v_a, v_t, offs_n, kok, q_base, do_base, stat_base, LSE,
        DELTA, seg, sqt, sqh, sdt, sdh, row_lo, mid, Tq, Tk, hkv, qk_scale, window, cap2, G, D, DA,
        DT, BLOCK_M, True, HAS_SEG, PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK, SOFTCAP)
    dk_a, dk_t, dv_a, dv_t = _bwd_dkdv_inner(
        dk_a, dk_t, dv_a, dv_t, k_a, k_t, v_a, v_t, offs_n, kok, q_base, do_base, stat_base, LSE,
        DELTA, seg, sqt, sqh, sdt, sdh, mid, tail, Tq, Tk, hkv, qk_scale, window, cap2, G, D, DA,
        DT, BLOCK_M, HAS_KEY_OK, HAS_SEG, PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK, SOFTCAP)
    dk_a, dk_t, dv_a, dv_t = _bwd_dkdv_inner(
        dk_a, dk_t, dv_a, dv_t, k_a, k_t, v_a, v_t, offs_n, kok, q_base, do_base, stat_base, LSE,
        DELTA, seg, sqt, sqh, sdt, sdh, tail, row_hi, Tq, Tk, hkv, qk_scale, window, cap2, G, D, DA,
        DT, BLOCK_M, True, HAS_SEG, PRECISION, UPCAST, HAS_WINDOW, HAS_KEY_OK, SOFTCAP)
    out = DK.dtype.element_ty
    rows = b * Tk * Hkv * D + hkv * D
    store_split(key_ptrs(DK + rows, n0, Hkv * D, BLOCK_N), (dk_a * sm_scale).to(out),
                 (dk_t * sm_scale).to(out), offs_n, Tk, D, DA, DT)
    store_split(key_ptrs(DV + rows, n0, Hkv * D, BLOCK_N), dv_a.to(out), dv_t.to(out), offs_n, Tk,
                 D, DA, DT)
