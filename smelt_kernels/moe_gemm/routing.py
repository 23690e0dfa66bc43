"""Routing metadata for the grouped MoE GEMMs, built on the device without host syncs.

From ``topk_ids`` (T, k) and the expert count E this computes, with shapes known on the
host (so the whole thing can be captured in a CUDA graph):

* ``order`` int32 (T*k,): the (token, slot) pair index p = t*k + j at each sorted row,
  pairs sorted by expert with a *stable* counting sort (ties keep pair order);
* ``rev`` int32 (T*k,): the sorted row of each pair (-1 for a pair whose id is outside
  [0, E), which then takes part in nothing);
* ``offsets`` int32 (E+1,): expert e owns sorted rows [offsets[e], offsets[e+1]);
* a tile table of ``cdiv(T*k, BM) + E`` entries (an upper bound: each expert adds at most
  one partial tile) listing (expert, first row, end row) per row tile; unused entries
  have expert -1 and the kernels return at once for them.

The counting sort runs as two Triton kernels (per-block histograms, then a stable scatter
using each pair's rank inside its block) around a prefix sum in torch.
:func:`smelt_kernels.moe_gemm.reference.sort_pairs` does the same with
``torch.sort(stable=True)`` for devices without Triton; both are deterministic and agree
exactly on valid ids. Sorted rows past ``offsets[E]`` (pairs with an invalid id) hold pair
and token 0 here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _alloc
from . import reference

__all__ = ["Tiles", "sort_pairs", "tile_table", "tiles"]


@dataclass
class Tiles:
    order: torch.Tensor  # int32 (TK,)
    rev: torch.Tensor  # int32 (TK,)
    offsets: torch.Tensor  # int32 (E + 1,)
    tok: torch.Tensor  # int32 (TK,): token of each sorted row (order // k)
    tile_e: torch.Tensor  # int32 (n_tiles,): expert of each tile, -1 if unused
    tile_r0: torch.Tensor  # int32 (n_tiles,): first sorted row
    tile_r1: torch.Tensor  # int32 (n_tiles,): end sorted row (exclusive)
    block_m: int


_KERNELS = None


def _kernels():
    """The Triton kernels, defined on first use (Triton is optional)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton  # optional: loaded with the kernels
    import triton.language as tl

    @triton.jit
    def _count_kernel(IDS, COUNTS, n, E, BLOCK: tl.constexpr, EB: tl.constexpr):
        # COUNTS[b, e] = number of pairs in block b with expert e
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        ids = tl.load(IDS + offs, mask=offs < n, other=-1)
        ids = tl.where((ids >= 0) & (ids < E), ids, -1)
        for e0 in range(0, E, EB):
            ex = e0 + tl.arange(0, EB)
            hit = (ids[:, None] == ex[None, :]).to(tl.int32)
            tl.store(COUNTS + pid * E + ex, tl.sum(hit, axis=0), mask=ex < E)

    @triton.jit
    def _scatter_kernel(IDS, BASE, ORDER, REV, TOK, n, E, K_TOP, BLOCK: tl.constexpr):
        # each pair goes to BASE[b, e] + (number of earlier pairs of its block with expert e)
        pid = tl.program_id(0)
        lane = tl.arange(0, BLOCK)
        offs = pid * BLOCK + lane
        inb = offs < n
        ids = tl.load(IDS + offs, mask=inb, other=-1)
        valid = (ids >= 0) & (ids < E) & inb
        ids = tl.where(valid, ids, -1)
        earlier = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(BASE + pid * E + ids, mask=valid, other=0)
        pos = base + rank
        tl.store(ORDER + pos, offs, mask=valid)
        tl.store(TOK + pos, offs // K_TOP, mask=valid)
        tl.store(REV + offs, tl.where(valid, pos, -1), mask=inb)

    _KERNELS = (_count_kernel, _scatter_kernel)
    return _KERNELS


def sort_pairs(topk_ids: torch.Tensor, num_experts: int):
    """(order, rev, offsets, tok) by the Triton counting sort (see the module docstring)."""
    import triton  # optional: only this path needs it

    count_kernel, scatter_kernel = _kernels()
    T, k = topk_ids.shape
    n, E, dev = T * k, num_experts, topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32)
    block = 64
    nb = max(1, triton.cdiv(n, block))
    counts = _alloc.empty((nb, E), torch.int32, dev)
    count_kernel[(nb,)](ids, counts, n, E, BLOCK=block, EB=64)
    # exclusive prefix sums: expert-major over (expert, block)
    total = counts.sum(0, dtype=torch.int32)
    start = torch.cumsum(total, 0, dtype=torch.int32) - total
    within = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    base = (start[None, :] + within).contiguous()
    offsets = torch.cat([start, total.sum(0, keepdim=True, dtype=torch.int32)])
    order = _alloc.empty((n,), torch.int32, dev)
    tok = _alloc.empty((n,), torch.int32, dev)
    rev = _alloc.empty((n,), torch.int32, dev)
    scatter_kernel[(nb,)](ids, base, order, rev, tok, n, E, k, BLOCK=block)
    # the scatter writes the rows of valid pairs, [0, offsets[E]); the rest hold 0
    written = torch.arange(n, device=dev) < offsets[-1]
    return torch.where(written, order, 0), rev, offsets, torch.where(written, tok, 0)


def tile_table(offsets: torch.Tensor, n_rows: int, block_m: int, extra_group: bool = False):
    """(tile_e, tile_r0, tile_r1) for groups [offsets[g], offsets[g+1]), ``cdiv(n_rows, BM)
    + G`` entries. With ``extra_group`` the rows [offsets[-1], n_rows) form one more group,
    numbered G (the grouped GEMM writes zeros there)."""
    dev = offsets.device
    offs = offsets.to(torch.int32)
    if extra_group:
        offs = torch.cat([offs, torch.full((1,), n_rows, dtype=torch.int32, device=dev)])
    G = offs.numel() - 1
    n_tiles = -(-n_rows // block_m) + G
    sizes = (offs[1:] - offs[:-1]).clamp_min(0)
    per = (sizes + block_m - 1) // block_m
    cum = torch.cumsum(per, 0, dtype=torch.int32)
    tid = torch.arange(n_tiles, dtype=torch.int32, device=dev)
    g = torch.searchsorted(cum, tid, right=True, out_int32=True)
    used = g < G
    gc = g.clamp(max=max(G - 1, 0))
    first = cum[gc] - per[gc]
    r0 = offs[gc] + (tid - first) * block_m
    r1 = torch.minimum(r0 + block_m, offs[gc + 1])
    neg = torch.full_like(g, -1)
    return torch.where(used, g, neg), torch.where(used, r0, neg), torch.where(used, r1, neg)


def tiles(topk_ids: torch.Tensor, num_experts: int, block_m: int, use_triton: bool = True) -> Tiles:
    """The routing sort and its tile table, what the Triton/CUDA kernels launch over."""
    sort = sort_pairs if use_triton else reference.sort_pairs
    order, rev, offsets, tok = sort(topk_ids, num_experts)
    te, t0, t1 = tile_table(offsets, order.numel(), block_m)
    return Tiles(order, rev, offsets, tok, te, t0, t1, block_m)
