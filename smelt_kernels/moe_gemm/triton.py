"""Triton kernels for the grouped top-k expert GEMMs: forward, backward and the plain grouped GEMM.

Rows are the T*k (token, slot) pairs sorted by expert (:mod:`smelt_kernels.moe_gemm.routing`);
a tile table lists (expert, first row, end row) per row tile, sized from host-known upper
bounds, and programs of unused tiles return at once. Programs walk tiles expert-major in
groups of ``GROUP`` row tiles that sweep all column blocks together, so one expert's
weight tiles are reused from L2 (the usual grouped ordering, per expert).

Forward (:func:`forward`):

* ``_up_kernel``: gathers token rows of x in the A-load (no permuted copy of x), computes
  the gate and up blocks of W1[e] in two accumulators and applies SwiGLU in the epilogue;
  stores the pre-activation (for backward) and h = silu(gate) * up.
* ``_rows_kernel``: O = h @ W2[e]^T per tile.
* ``_combine_kernel``: y[t] = sum_j w[t,j] O[rev(t,j)], a gather-and-sum in slot order.

Backward (:func:`backward`), all deterministic (fixed reduction orders, no atomics):

* ``_dh_kernel``: G = dy[tok] @ W2[e] with the gather fused, then dSwiGLU and the routing
  weight gradient in the epilogue (h is recomputed from the saved pre-activation); the
  per-row sums over each column block go to a (blocks, rows) buffer summed in order.
* ``_rows_kernel``: dXs = dP @ W1[e]; ``_combine_kernel`` sums each token's k rows.
* ``_wgrad_kernel``: dW1[e] = dP_e^T @ x[tok_e] and dW2[e] = dy[tok_e]^T @ (w h)_e, one
  program per (expert, output tile) looping over that expert's rows (varlen K), gathers
  fused.

bf16 operands are upcast to fp32 before ``tl.dot`` under the interpreter only (its bf16
dot is wrong); fp32 operands use IEEE products unless TF32 is enabled in torch.

Offsets: row offsets (token, sorted and output rows times their stride) and the weight
offsets of an expert (rows of W times H or d_e, which can pass 2^31 elements in one
expert's matrix) are computed in int64; the rest (row and column indices themselves,
T*k < 2^31 by validation) in int32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import _alloc
from ..backends import triton_interpret
from . import routing as moe_routing

__all__ = ["forward", "backward", "grouped_gemm", "grouped_gemm_wgrad", "config", "tile_key"]


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _tile_pid(pid, n_tiles, n_cols, GROUP: tl.constexpr):
    per_group = GROUP * n_cols
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_tiles - first, GROUP)
    t = first + (pid % per_group) % size
    nb = (pid % per_group) // size
    return t, nb


@triton.jit
def _tile_expert(TILE_E, n_tiles, n, BN: tl.constexpr, GROUP: tl.constexpr):
    # this program's tile t, its block nb of n columns, and the tile's expert (< 0: a
    # padding tile, nothing to do)
    t, nb = _tile_pid(tl.program_id(0), n_tiles, tl.cdiv(n, BN), GROUP)
    return t, nb, tl.load(TILE_E + t)


@triton.jit
def _tile_tokens(A, s_a, TOK, TILE_R0, TILE_R1, t, nb, n, BM: tl.constexpr, BN: tl.constexpr):
    # tile t's sorted rows and which exist, pointers to their tokens' rows of A (row stride
    # s_a), and block nb's columns of n and which exist
    rows, rmask = _tile_rows(TILE_R0, TILE_R1, t, BM)
    tok = tl.load(TOK + rows, mask=rmask, other=0).to(tl.int64)
    cols = nb * BN + tl.arange(0, BN)
    return rows, rmask, A + tok * s_a, cols, cols < n


@triton.jit
def _a_slice(a_rows, rmask, k0, K, BK: tl.constexpr):
    # columns k0 .. k0 + BK of the rows at a_rows (zero past K and in missing rows), their
    # indices and which of them exist
    ks = k0 + tl.arange(0, BK)
    kmask = ks < K
    return ks, kmask, tl.load(a_rows[:, None] + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                              other=0.0)


@triton.jit
def _tile_rows(TILE_R0, TILE_R1, t, BM: tl.constexpr):
    # the sorted rows of tile t (a tile never spans two experts) and which of them exist
    rows = tl.load(TILE_R0 + t) + tl.arange(0, BM)
    return rows, rows < tl.load(TILE_R1 + t)


@triton.jit
def _up_kernel(X, W1, TOK, TILE_E, TILE_R0, TILE_R1, PRE, HID,
               n_tiles, H, DE, s_x, s_we, s_wn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    t, nb, e = _tile_expert(TILE_E, n_tiles, DE, BN, GROUP)
    if e < 0:
        return
    rows, rmask, a_rows, cols, cmask = _tile_tokens(X, s_x, TOK, TILE_R0, TILE_R1, t, nb, DE, BM, BN)
    # weight rows of the gate and up columns (int64: an expert's matrix may pass 2^31 elements)
    w_gate = W1 + e.to(tl.int64) * s_we + cols.to(tl.int64)[None, :] * s_wn
    w_up = w_gate + DE * s_wn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        ks, kmask, a = _a_slice(a_rows, rmask, k0, H, BK)
        bmask = kmask[:, None] & cmask[None, :]
        bg = tl.load(w_gate + ks[:, None], mask=bmask, other=0.0)
        bu = tl.load(w_up + ks[:, None], mask=bmask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
    out_mask = rmask[:, None] & cmask[None, :]
    pre = PRE + rows.to(tl.int64)[:, None] * (2 * DE) + cols[None, :]
    tl.store(pre, acc_g.to(PRE.dtype.element_ty), mask=out_mask)
    tl.store(pre + DE, acc_u.to(PRE.dtype.element_ty), mask=out_mask)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(HID + rows.to(tl.int64)[:, None] * DE + cols[None, :], h.to(HID.dtype.element_ty), mask=out_mask)


@triton.jit
def _rows_kernel(A, B, C, IDX, TILE_E, TILE_R0, TILE_R1,
                 n_tiles, N, K, s_a, s_be, s_bk, s_bn, s_c, zero_group,
                 GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # C[r, :] = A[idx(r), :] @ B[e] with B[e][k][n] at B + e*s_be + k*s_bk + n*s_bn;
    # tiles of group `zero_group` (rows outside every group) are written as zeros
    t, nb, e = _tile_expert(TILE_E, n_tiles, N, BN, GROUP)
    if e < 0:
        return
    rows, rmask = _tile_rows(TILE_R0, TILE_R1, t, BM)
    cols = nb * BN + tl.arange(0, BN)
    cmask = cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if e != zero_group:
        if GATHER:
            src = tl.load(IDX + rows, mask=rmask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        a_rows = A + src * s_a
        b_cols = B + e.to(tl.int64) * s_be + cols.to(tl.int64)[None, :] * s_bn
        for k0 in range(0, K, BK):
            ks, kmask, a = _a_slice(a_rows, rmask, k0, K, BK)
            b = tl.load(b_cols + (ks.to(tl.int64) * s_bk)[:, None],
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
    c = C + rows.to(tl.int64)[:, None] * s_c + cols[None, :]
    tl.store(c, acc.to(C.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(SRC, REV, TW, Y, T, H, K_TOP,
                    HAS_W: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    # Y[t] = sum_j w[t, j] * SRC[rev[t*k + j]] in slot order (rows with rev < 0 add nothing)
    ts = tl.program_id(0) * BT + tl.arange(0, BT)
    cs = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = ts < T
    cmask = cs < H
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in range(0, K_TOP):
        r = tl.load(REV + ts * K_TOP + j, mask=tmask, other=-1)
        ok = (r >= 0) & tmask
        v = tl.load(SRC + r.to(tl.int64)[:, None] * H + cs[None, :], mask=ok[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(TW + ts * K_TOP + j, mask=ok, other=0.0)
            v = v * w[:, None]
        acc += v
    tl.store(Y + ts.to(tl.int64)[:, None] * H + cs[None, :], acc.to(Y.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _dh_kernel(DY, W2, PRE, TW, ORDER, TOK, TILE_E, TILE_R0, TILE_R1, DP, HW, DTWP,
               n_tiles, n_rows, H, DE, s_dy, s_we,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    t, nb, e = _tile_expert(TILE_E, n_tiles, DE, BN, GROUP)
    if e < 0:
        return
    rows, rmask, a_rows, cols, cmask = _tile_tokens(DY, s_dy, TOK, TILE_R0, TILE_R1, t, nb, DE, BM,
                                                    BN)
    w_cols = W2 + e.to(tl.int64) * s_we + cols[None, :]
    G = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        ks, kmask, a = _a_slice(a_rows, rmask, k0, H, BK)
        b = tl.load(w_cols + (ks.to(tl.int64) * DE)[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        G = tl.dot(a, b, G, input_precision=PREC)
    # epilogue: h recomputed from the pre-activation; dSwiGLU; the routing-weight gradient
    m2 = rmask[:, None] & cmask[None, :]
    pre = PRE + rows.to(tl.int64)[:, None] * (2 * DE) + cols[None, :]
    g = tl.load(pre, mask=m2, other=0.0).to(tl.float32)
    u = tl.load(pre + DE, mask=m2, other=0.0).to(tl.float32)
    pair = tl.load(ORDER + rows, mask=rmask, other=0)
    w = tl.load(TW + pair, mask=rmask, other=0.0)
    s = tl.sigmoid(g)
    silu = g * s
    h = silu * u
    tl.store(DTWP + nb.to(tl.int64) * n_rows + rows, tl.sum(G * h, axis=1), mask=rmask)
    dh = G * w[:, None]
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * silu
    dp = DP + rows.to(tl.int64)[:, None] * (2 * DE) + cols[None, :]
    tl.store(dp, dg.to(DP.dtype.element_ty), mask=m2)
    tl.store(dp + DE, du.to(DP.dtype.element_ty), mask=m2)
    tl.store(HW + rows.to(tl.int64)[:, None] * DE + cols[None, :], (h * w[:, None]).to(HW.dtype.element_ty), mask=m2)


@triton.jit
def _wgrad_kernel(L, R, OUT, IDX_L, IDX_R, OFF, NI, NC, s_l, s_r, s_oe, s_oi,
                  GATHER_L: tl.constexpr, GATHER_R: tl.constexpr,
                  BI: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr, UPCAST: tl.constexpr):
    # OUT[e, i, c] = sum over rows r of group e of L[il(r), i] * R[ir(r), c]
    e = tl.program_id(0)
    n_cb = tl.cdiv(NC, BC)
    ii = (tl.program_id(1) // n_cb) * BI + tl.arange(0, BI)
    cc = (tl.program_id(1) % n_cb) * BC + tl.arange(0, BC)
    imask = ii < NI
    cmask = cc < NC
    r0 = tl.load(OFF + e)
    r1 = tl.load(OFF + e + 1)
    acc = tl.zeros((BI, BC), dtype=tl.float32)
    for k0 in range(r0, r1, BK):
        rs = k0 + tl.arange(0, BK)
        rmask = rs < r1
        if GATHER_L:
            li = tl.load(IDX_L + rs, mask=rmask, other=0).to(tl.int64)
        else:
            li = rs.to(tl.int64)
        if GATHER_R:
            ri = tl.load(IDX_R + rs, mask=rmask, other=0).to(tl.int64)
        else:
            ri = rs.to(tl.int64)
        lt = tl.load(L + li[None, :] * s_l + ii[:, None], mask=imask[:, None] & rmask[None, :], other=0.0)
        rt = tl.load(R + ri[:, None] * s_r + cc[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            lt = lt.to(tl.float32)
            rt = rt.to(tl.float32)
        acc = tl.dot(lt, rt, acc, input_precision=PREC)
    out = OUT + e.to(tl.int64) * s_oe + ii.to(tl.int64)[:, None] * s_oi + cc[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=imask[:, None] & cmask[None, :])


# ----------------------------------------------------------------------------- launchers
def _fit(n: int, choices, slack: float) -> int:
    """The largest block in ``choices`` whose masked tail leaves at most ``slack`` of the
    blocks' columns unused; else the block that wastes least."""
    def waste(b):
        return (triton.cdiv(n, b) * b - n) / (triton.cdiv(n, b) * b)
    ok = [b for b in choices if waste(b) <= slack]
    return max(ok) if ok else min(choices, key=waste)


def tile_key(rows_per_group: float, n: int | None = None, k: int | None = None) -> tuple:
    """The key tile choices are made on: the tokens-per-expert bucket, the output width and
    the reduction depth. Buckets: fewer than 64 rows per expert (decode, small batches),
    64-255 (a few thousand tokens over hundreds of experts: SMELT's 200M cell has ~114 at
    4k tokens), 256 and more (~900 at 32k tokens)."""
    bucket = 0 if rows_per_group < 64 else 1 if rows_per_group < 256 else 2
    return bucket, n, k


def config(device: torch.device, rows_per_group: float = 0.0, n: int | None = None,
           k: int | None = None, kind: str = "gemm", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile sizes for a grouped GEMM with ``rows_per_group`` mean rows per expert, output
    width ``n`` and reduction depth ``k``; ``kind`` is "gemm", "up" (two accumulators: the
    SwiGLU up-projection) or "dgrad" (the dSwiGLU epilogue's register load). The interpreter gets small tiles (so small tests cross many
    tile edges). On the GPU: BM 64 (one warpgroup's wgmma height) below 256 rows per expert,
    128 above; BN (128 or 64; 64 with two accumulators) and BK (64 or 32) fitted to n and k
    with masked tails: the largest block whose tail wastes at most 1/8 (BN) or 1/16 (BK) of
    the padded work (at d_e 352: BN 64, 9% unused in the last column block; K 352: BK 32,
    which divides it; K 1056: BK 64, 3%), rather than a fixed 128. Every configuration is compiled by ``python -m smelt_tools.audit`` without spills;
    none is timed on a device yet."""
    if device.type != "cuda":
        return dict(BM=16, BN=16, BK=16, GROUP=4, num_warps=1, num_stages=1)
    if kind not in ("gemm", "up", "dgrad"):
        raise ValueError(f"kind must be 'gemm', 'up' or 'dgrad', got {kind!r}")
    cfg = dict(_gpu_config(tile_key(rows_per_group, n, k), kind))
    if dtype == torch.float32:  # fp32 operands: BN 128 spilled (the down projection, 32 bytes)
        cfg["BN"] = min(cfg["BN"], 64)
    return cfg


@functools.lru_cache(maxsize=None)
def _gpu_config(key: tuple, kind: str) -> tuple:
    bucket, n, k = key
    bm = 128 if bucket == 2 else 64
    bn = _fit(n, (64,) if kind != "gemm" else (128, 64), 1 / 8) if n else 64
    bk = _fit(k, (64, 32), 1 / 16) if k else 64
    warps = 8 if bm == 128 else 4
    if kind == "dgrad":
        # the dSwiGLU epilogue holds ~8 (BM, BN) fp32 tiles: at 4 warps x 64 x 64 or
        # 8 warps x 128 x 64 it spills (255 registers), at 8 x 64 x 64 or 8 x 128 x 32 not
        warps, bn = 8, (bn if bm == 64 else 32)
    return tuple(dict(BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=3).items())


def _wgrad_config(device: torch.device, ni: int | None = None, nc: int | None = None) -> dict:
    if device.type != "cuda":
        return dict(BI=16, BC=16, BK=16, num_warps=1, num_stages=1)
    bi = _fit(ni, (128, 64), 1 / 8) if ni else 64
    bc = _fit(nc, (128, 64), 1 / 8) if nc else 64
    if bi * bc > 128 * 64:
        bc = 64
    return dict(BI=bi, BC=bc, BK=64, num_warps=8 if bi * bc >= 128 * 64 else 4, num_stages=3)


def _precision(dtype: torch.dtype):
    if dtype != torch.float32 and not _upcast(dtype):
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not triton_interpret() else "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    # the interpreter's tl.dot mishandles bfloat16 operands: compute those in fp32 there
    return triton_interpret() and dtype == torch.bfloat16


def _meta(dtype: torch.dtype) -> dict:
    return dict(PREC=_precision(dtype), UPCAST=_upcast(dtype))


def _rows(a, b, c, idx, tiles, N, K, s_be, s_bk, s_bn, cfg, zero_group=-1):
    """Launch ``_rows_kernel`` over the tile table (see its comment)."""
    n_tiles = tiles.tile_e.numel()
    grid = (n_tiles * triton.cdiv(N, cfg["BN"]),)
    _rows_kernel[grid](a, b, c, idx if idx is not None else tiles.tile_e, tiles.tile_e, tiles.tile_r0,
                       tiles.tile_r1, n_tiles, N, K, a.stride(0), s_be, s_bk, s_bn, c.stride(0),
                       zero_group, GATHER=idx is not None, **cfg, **_meta(a.dtype))


def _combine(src, rev, tw, T, k, out_dtype):
    H = src.shape[1]
    y = _alloc.empty((T, H), out_dtype, src.device)
    bt, bh = (16, 32) if src.device.type != "cuda" else (32, 128)
    grid = (triton.cdiv(T, bt), triton.cdiv(H, bh))
    _combine_kernel[grid](src, rev, tw if tw is not None else src, y, T, H, k,
                          HAS_W=tw is not None, BT=bt, BH=bh)
    return y


def _wgrad(L, R, out, idx_l, idx_r, offsets, NI, NC, s_oe, s_oi):
    cfg = _wgrad_config(L.device, NI, NC)
    E = offsets.numel() - 1
    grid = (E, triton.cdiv(NI, cfg["BI"]) * triton.cdiv(NC, cfg["BC"]))
    dummy = offsets
    _wgrad_kernel[grid](L, R, out, idx_l if idx_l is not None else dummy,
                        idx_r if idx_r is not None else dummy, offsets, NI, NC,
                        L.stride(0), R.stride(0), s_oe, s_oi,
                        GATHER_L=idx_l is not None, GATHER_R=idx_r is not None, **cfg, **_meta(L.dtype))


def make_tiles(topk_ids: torch.Tensor, num_experts: int, device: torch.device) -> moe_routing.Tiles:
    T, k = topk_ids.shape
    cfg = config(device, T * k / max(num_experts, 1))
    return moe_routing.tiles(topk_ids, num_experts, cfg["BM"], use_triton=True)


def forward(x, w1, w2, topk_weights, topk_ids, tiles=None):
    """(y, pre-activation (T*k, 2 d_e) in sorted-row order, order, rev, offsets)."""
    T, H = x.shape
    E, two_de, _ = w1.shape
    de, k = two_de // 2, topk_ids.shape[1]
    TK = T * k
    tiles = tiles or make_tiles(topk_ids, E, x.device)
    cfg = config(x.device, TK / E, de, H, kind="up")
    cfg["BM"] = tiles.block_m
    cfg_down = dict(config(x.device, TK / E, H, de, dtype=x.dtype), BM=tiles.block_m)
    n_tiles = tiles.tile_e.numel()
    pre = _alloc.empty((TK, 2 * de), x.dtype, x.device)
    hid = _alloc.empty((TK, de), x.dtype, x.device)
    grid = (n_tiles * triton.cdiv(de, cfg["BN"]),)
    _up_kernel[grid](x, w1, tiles.tok, tiles.tile_e, tiles.tile_r0, tiles.tile_r1, pre, hid,
                     n_tiles, H, de, x.stride(0), w1.stride(0), w1.stride(1), **cfg, **_meta(x.dtype))
    out = _alloc.empty((TK, H), x.dtype, x.device)
    # O = h @ W2[e]^T: B[e][k][n] = w2[e][n][k]
    _rows(hid, w2, out, None, tiles, H, de, w2.stride(0), w2.stride(2), w2.stride(1), cfg_down)
    y = _combine(out, tiles.rev, topk_weights, T, k, x.dtype)
    return y, pre, tiles.order, tiles.rev, tiles.offsets


def backward(dy, x, w1, w2, topk_weights, pre, order, rev, offsets):
    """(dx, dw1, dw2, dtopk_weights fp32) for :func:`forward`'s outputs."""
    T, H = x.shape
    E, two_de, _ = w1.shape
    de = two_de // 2
    TK = order.numel()
    k = TK // max(T, 1)
    cfg = config(x.device, TK / E, de, H, kind="dgrad")
    te, t0, t1 = moe_routing.tile_table(offsets, TK, cfg["BM"])
    tok = (order // k).to(torch.int32)
    tiles = moe_routing.Tiles(order, rev, offsets, tok, te, t0, t1, cfg["BM"])
    n_tiles = te.numel()
    n_cb = triton.cdiv(de, cfg["BN"])
    dp = _alloc.empty((TK, 2 * de), x.dtype, x.device)
    hw = _alloc.empty((TK, de), x.dtype, x.device)
    dtwp = _alloc.empty((n_cb, TK), torch.float32, x.device)
    _dh_kernel[(n_tiles * n_cb,)](dy, w2, pre, topk_weights, order, tok, te, t0, t1, dp, hw, dtwp,
                                  n_tiles, TK, H, de, dy.stride(0), w2.stride(0), **cfg, **_meta(x.dtype))
    dtw_sorted = dtwp.sum(0)
    valid = rev >= 0
    dtw = torch.where(valid, dtw_sorted[rev.clamp_min(0).long()], torch.zeros_like(dtw_sorted[:1]))
    dxs = _alloc.empty((TK, H), x.dtype, x.device)
    # dXs = dP @ W1[e]: B[e][k][n] = w1[e][k][n]
    _rows(dp, w1, dxs, None, tiles, H, 2 * de, w1.stride(0), w1.stride(1), w1.stride(2),
          config(x.device, TK / E, H, 2 * de, dtype=x.dtype))
    dx = _combine(dxs, rev, None, T, k, x.dtype)
    dw1 = _alloc.empty(w1.shape, w1.dtype, w1.device)
    _wgrad(dp, x, dw1, None, tok, offsets, 2 * de, H, dw1.stride(0), dw1.stride(1))
    dw2 = _alloc.empty(w2.shape, w2.dtype, w2.device)
    _wgrad(dy, hw, dw2, tok, None, offsets, H, de, dw2.stride(0), dw2.stride(1))
    return dx, dw1, dw2, dtw.view(T, k)


def grouped_gemm(a, b, offsets, gather, trans_b: bool):
    """c[r] = a[g(r)] @ (b[e]^T if trans_b else b[e]) for rows r of group e (offsets (E+1,)
    int32 starts); rows past offsets[-1] are zero."""
    M = gather.numel() if gather is not None else a.shape[0]
    N = b.shape[1] if trans_b else b.shape[2]
    K = a.shape[1]
    E = b.shape[0]
    cfg = config(a.device, M / max(E, 1), N, K, dtype=a.dtype)
    te, t0, t1 = moe_routing.tile_table(offsets, M, cfg["BM"], extra_group=True)
    tiles = moe_routing.Tiles(None, None, offsets, None, te, t0, t1, cfg["BM"])
    c = _alloc.empty((M, N), a.dtype, a.device)
    s_bk, s_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    _rows(a, b, c, gather, tiles, N, K, b.stride(0), s_bk, s_bn, cfg, zero_group=E)
    return c


def grouped_gemm_wgrad(dc, a, offsets, gather):
    """db[e] = dc[rows of e]^T @ a[g(rows of e)], shape (E, N, K)."""
    E = offsets.numel() - 1
    N, K = dc.shape[1], a.shape[1]
    db = _alloc.empty((E, N, K), a.dtype, a.device)
    _wgrad(dc, a, db, None, gather, offsets, N, K, db.stride(0), db.stride(1))
    return db
