"""Tile helpers of the segment-attention Triton kernels (:mod:`smelt_kernels.attention.triton`):
loading and storing rows of a power-of-two head-dim block and its tail, their products, row
and key offsets in 64-bit, and the key runs a row tile visits. See that module for the layout.
"""

import triton
import triton.language as tl


@triton.jit
def _load_tile(
    ptrs, offs_n, n_max, offs_d, D: tl.constexpr, CHECK_N: tl.constexpr, EVEN_D: tl.constexpr
):
    """Load a (rows, width) tile; rows >= n_max (if CHECK_N) and columns >= D read as 0."""
    if CHECK_N:
        if EVEN_D:
            x = tl.load(ptrs, mask=offs_n[:, None] < n_max, other=0.0)
        else:
            x = tl.load(ptrs, mask=(offs_n[:, None] < n_max) & (offs_d[None, :] < D), other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def load_split(
    rows_ptr,
    offs_n,
    n_max,
    D: tl.constexpr,
    DA: tl.constexpr,
    DT: tl.constexpr,
    ROWS: tl.constexpr,
    CHECK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The head-dim blocks of ``ROWS`` rows (``rows_ptr`` (ROWS, 1) points at column 0):
    columns [0, DA) and, when DT > 0, the masked tail [DA, DA + DT). Without a tail the
    second value is an unused (ROWS, 16) placeholder."""
    offs_a = tl.arange(0, DA)
    xa = _load_tile(rows_ptr + offs_a[None, :], offs_n, n_max, offs_a, D, CHECK_N, DA <= D)
    if DT > 0:
        offs_t = DA + tl.arange(0, DT)
        xt = _load_tile(rows_ptr + offs_t[None, :], offs_n, n_max, offs_t, D, CHECK_N, DA + DT == D)
    else:
        xt = tl.zeros([ROWS, 16], dtype=xa.dtype)
    if UPCAST:
        xa = xa.to(tl.float32)
        xt = xt.to(tl.float32)
    return xa, xt


@triton.jit
def store_split(
    rows_ptr, xa, xt, offs_n, n_max, D: tl.constexpr, DA: tl.constexpr, DT: tl.constexpr
):
    offs_a = tl.arange(0, DA)
    if DA <= D:
        tl.store(rows_ptr + offs_a[None, :], xa, mask=offs_n[:, None] < n_max)
    else:
        tl.store(
            rows_ptr + offs_a[None, :], xa, mask=(offs_n[:, None] < n_max) & (offs_a[None, :] < D)
        )
    if DT > 0:
        offs_t = DA + tl.arange(0, DT)
        tl.store(
            rows_ptr + offs_t[None, :], xt, mask=(offs_n[:, None] < n_max) & (offs_t[None, :] < D)
        )


@triton.jit
def finite_split(xa, xt, DT: tl.constexpr):
    """The tile's head-dim blocks with their NaN and inf entries zeroed, and per row (axis 0)
    1 where the row had one, else 0."""
    ok_a = tl.abs(xa) < float("inf")  # False for NaN and +-inf
    bad = tl.max(tl.where(ok_a, 0, 1), 1)
    xa = tl.where(ok_a, xa, tl.zeros_like(xa))
    if DT > 0:
        ok_t = tl.abs(xt) < float("inf")
        bad = tl.maximum(bad, tl.max(tl.where(ok_t, 0, 1), 1))
        xt = tl.where(ok_t, xt, tl.zeros_like(xt))
    return xa, xt, bad


@triton.jit
def sees_flagged(vis, bad):
    """Per row of ``vis`` (rows, cols): 1 where it sees a column whose ``bad`` flag is set."""
    return tl.max(tl.where(vis & (bad[None, :] > 0), 1, 0), 1)


@triton.jit
def dot_split(a_a, a_t, b_a, b_t, DT: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b^T over both head-dim blocks (the tail only when DT > 0)."""
    s = tl.dot(a_a, tl.trans(b_a), input_precision=PRECISION)
    if DT > 0:
        s = tl.dot(a_t, tl.trans(b_t), s, input_precision=PRECISION)
    return s


@triton.jit
def row_pointers(base, qi, qi0, h, st, sh):
    """Pointers (rows, 1) to gathered (query, head) rows from ``base``: query qi0's offset
    in int64 (a batch row may hold more than 2^31 elements), the rest relative to it in
    int32 (qi - qi0 is at most a tile). The launcher makes every stride a multiple of 8
    elements, so rows start 16-byte aligned and loads vectorise."""
    return (base + tl.cast(qi0, tl.int64) * st) + tl.multiple_of((qi - qi0) * st + h * sh, 8)[
        :, None
    ]


@triton.jit
def key_rows(offs_n, st):
    """Row offsets (keys, 1) of key positions ``offs_n`` with row stride ``st``, in int64
    (the forward's form: there it compiles without spills, the other one not)."""
    return offs_n.to(tl.int64)[:, None] * st


@triton.jit
def key_ptrs(base, n0, st, BLOCK_N: tl.constexpr):
    """Pointers (keys, 1) to the rows of keys n0 .. n0 + BLOCK_N - 1 (row stride ``st``):
    n0's offset in int64, the rest relative to it."""
    return (base + tl.cast(n0, tl.int64) * st) + (tl.arange(0, BLOCK_N) * st)[:, None]


@triton.jit
def row_tile(tile, Tq, Tk, hkv, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of a tile: (rows, valid, query index, head, position) and the tile's first and
    last valid positions. Rows past the end are clamped onto the last row (never stored)."""
    n_rows = Tq * G
    r0 = tile * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows_c = tl.minimum(rows, n_rows - 1)
    qi = rows_c // G
    h = hkv * G + rows_c % G
    off = Tk - Tq
    pos_first = r0 // G + off
    pos_last = (tl.minimum(r0 + BLOCK_M, n_rows) - 1) // G + off
    return rows, row_ok, qi, h, qi + off, pos_first, pos_last


@triton.jit
def key_runs(start_first, start_last, pos_first, pos_last, BLOCK_N: tl.constexpr):
    """Bounds of the three key runs of a row tile: [lo, mid) masked, [mid, diag) unmasked,
    [diag, hi) masked. ``start_first`` / ``start_last``: the lowest key the tile's first /
    last row sees (their segment starts, raised by a window: :func:`window_runs`); rows'
    lowest keys never decrease, so every row sees [mid, diag). Tiles start at lo, so the
    runs never overlap."""
    lo = start_first
    mid = lo + tl.cdiv(tl.maximum(start_last - lo, 0), BLOCK_N) * BLOCK_N
    diag = mid + (tl.maximum(pos_first + 1 - mid, 0) // BLOCK_N) * BLOCK_N
    return lo, mid, diag, pos_last + 1


@triton.jit
def visible(keys, start, pos, window, key_ok, HAS_WINDOW: tl.constexpr, HAS_KEY_OK: tl.constexpr):
    """Which (key, position) pairs are seen (the operands broadcast against each other): key
    in [start, pos], above pos - ``window`` (HAS_WINDOW) and cleared by no ``key_ok``
    (HAS_KEY_OK)."""
    vis = (keys >= start) & (keys <= pos)
    if HAS_WINDOW:
        vis = vis & (keys > pos - window)
    if HAS_KEY_OK:
        vis = vis & key_ok
    return vis


@triton.jit
def keys_ok(KEY_OK, offs_n, Tk, HAS_KEY_OK: tl.constexpr):
    """Per key of ``offs_n``: its ``KEY_OK`` flag (uint8, one row of it), False past Tk;
    without HAS_KEY_OK a placeholder nobody reads."""
    if HAS_KEY_OK:
        ok = tl.load(KEY_OK + offs_n, mask=offs_n < Tk, other=0) != 0
    else:
        ok = offs_n < Tk
    return ok


@triton.jit
def tanh_exp2(y):
    """tanh(x) for y = 2 x log2(e): 1 - 2 / (2^y + 1). Stable for large |y|: 2^y overflows
    to inf (1) or underflows to 0 (-1), never NaN for a finite y."""
    return 1.0 - 2.0 / (tl.math.exp2(y) + 1.0)


@triton.jit
def window_runs(lo_first, lo_last, pos_first, pos_last, window, HAS_WINDOW: tl.constexpr):
    """The lowest key a row tile's first and last rows see, given their segment starts: with
    HAS_WINDOW, also above position - ``window``."""
    if HAS_WINDOW:
        lo_first = tl.maximum(lo_first, pos_first - window + 1)
        lo_last = tl.maximum(lo_last, pos_last - window + 1)
    return lo_first, lo_last


@triton.jit
def seg_starts(
    START, b, Tk, pos, pos_first, pos_last, HAS_SEG: tl.constexpr, BLOCK_M: tl.constexpr
):
    if HAS_SEG:
        seg = START + b * Tk
        start = tl.load(seg + pos)
        start_first = tl.load(seg + pos_first)
        start_last = tl.load(seg + pos_last)
    else:
        start = tl.zeros([BLOCK_M], dtype=tl.int32)
        start_first = pos_first * 0
        start_last = pos_first * 0
    return start, start_first, start_last


@triton.jit
def query_tile(START, Tq, Tk, Hq, G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SEG: tl.constexpr):
    # this program's row tile (the longest tiles, at the last positions, first), its batch
    # row b and KV head, its rows (row_tile) and their segment starts (seg_starts)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    Hkv = Hq // G
    b = (bh // Hkv).to(tl.int64)
    hkv = bh % Hkv
    rows, row_ok, qi, h, pos, pos_first, pos_last = row_tile(tile, Tq, Tk, hkv, G, BLOCK_M)
    start, start_first, start_last = seg_starts(
        START, b, Tk, pos, pos_first, pos_last, HAS_SEG, BLOCK_M
    )
    return b, hkv, rows, row_ok, qi, h, pos, pos_first, pos_last, start, start_first, start_last
